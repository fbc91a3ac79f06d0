"""The offline tools (csv2db, csv2tb, anomaly-analyse) on hostile input: each bad file is one line
on stderr naming it and exit code 2, never a traceback, never a hang (FIFOs, /dev/zero), and a
bounded fuzz of mutated CSV and JSON files raises nothing but ConfigError."""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

from reference_layouts import V1_RUN, write_reference_v1, write_reference_v2
from trainprobe.cli import main as cli_main
from trainprobe.engine.errors import ConfigError
from trainprobe.engine.safe_files import bounded_int, one_line, read_bytes, read_text
from trainprobe.engine.safe_json import depth_of, loads_checked
from trainprobe.tools.anomalies.analyser import load_anomalies, parse_step_list
from trainprobe.tools.exports.sqlite import CSV2DBConfig, csv2db
from trainprobe.tools.runs.rows import find_csv_files, read_table

CLI_TIMEOUT = 60  # seconds: a hang fails the test instead of the suite


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "trainprobe", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=CLI_TIMEOUT, stdin=subprocess.DEVNULL)


def assert_one_line_exit_2(done: subprocess.CompletedProcess[str], command: str, pattern: str) -> None:
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    assert re.match(rf"trainprobe {command}: error: .*{pattern}", lines[0]), lines[0]


def cli_in_process(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, list[str]]:
    code = cli_main(list(args))
    return code, capsys.readouterr().err.splitlines()


def one_csv(tmp_path: Path, content: bytes, name: str = "grad_reduced_0-0.csv") -> Path:
    run = tmp_path / "monitor" / V1_RUN
    run.mkdir(parents=True)
    (run / name).write_bytes(content)
    return run / name


# --------------------------------------------------------------------------- files that are not files


@pytest.mark.parametrize("command", ["csv2db", "csv2tb"])
def test_fifo_and_dev_zero_named_csv_do_not_hang(tmp_path, command):
    run = tmp_path / "monitor" / V1_RUN
    run.mkdir(parents=True)
    os.mkfifo(run / "grad_reduced_0-0.csv")
    (run / "actv_0-0.csv").symlink_to("/dev/zero")
    (run / "other_0-0.csv").mkdir()
    done = run_cli(command, str(tmp_path / "monitor"), "-o", str(tmp_path / "out"))
    assert_one_line_exit_2(done, command, r"no monitor CSV found .*skipped 3 entries that are not regular files")


def test_the_opener_refuses_what_is_not_a_regular_file(tmp_path):
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "zero").symlink_to("/dev/zero")
    (tmp_path / "dir").mkdir()
    with pytest.raises(ConfigError, match=r"fifo: a FIFO \(named pipe\), not a regular file; refused"):
        read_bytes(tmp_path / "fifo", max_bytes=10)
    with pytest.raises(ConfigError, match=r"zero: a device, not a regular file; refused"):
        read_bytes(tmp_path / "zero", max_bytes=10)
    with pytest.raises(ConfigError, match=r"dir: (is a folder, not a file|a folder, not a regular file)"):
        read_bytes(tmp_path / "dir", max_bytes=10)
    with pytest.raises(ConfigError, match=r"nope: does not exist"):
        read_bytes(tmp_path / "nope", max_bytes=10)
    (tmp_path / "big").write_bytes(b"x" * 2049)
    with pytest.raises(ConfigError, match=r"big: 2049 bytes, more than the 2 KiB this tool reads"):
        read_bytes(tmp_path / "big", max_bytes=2048)
    assert read_text(tmp_path / "big", max_bytes=4096) == "x" * 2049


def test_a_table_too_large_is_refused(tmp_path, monkeypatch):
    import trainprobe.tools.runs.rows as monitor_output

    write_reference_v1(tmp_path)
    monkeypatch.setattr(monitor_output, "MAX_CSV_BYTES", 100)
    file = find_csv_files(tmp_path, data_types=["actv"])[0]
    with pytest.raises(ConfigError, match=r"actv_0-1.csv: \d+ bytes, more than the 100 bytes this tool reads"):
        read_table(file)


def test_anomaly_json_fifo_and_device_do_not_hang(tmp_path):
    for rank, make in ((0, os.mkfifo), (1, lambda p: p.symlink_to("/dev/zero"))):
        folder = tmp_path / "anomaly_detected" / f"rank{rank}"
        folder.mkdir(parents=True)
        make(folder / "anomaly.json")
    done = run_cli("anomaly-analyse", "-d", str(tmp_path))
    assert_one_line_exit_2(done, "anomaly-analyse", r"holds no rank<r>/anomaly.json")


# --------------------------------------------------------------------------- bad content, one line each


@pytest.mark.parametrize(
    ("content", "pattern"),
    [
        (b"vpp_stage,name,step,min\n0,w\xff\xfe,0,1\n", r"not UTF-8 text \(byte 0xff at offset 27\)"),
        (b"vpp_stage,name,step,min\n0,w,99999999999999999999,1\n", r"column 'step': value '9+' is outside the 64-bit"),
        (b"vpp_stage,name,step,min,min\n0,w,0,1,2\n", r"the header names column 'min' twice"),
        (b"vpp_stage,name,step,min\n0,w\n1,x\n", r"row 1 has 2 cells, the header 4"),
        (b"vpp_stage,name,step,min\n0,w,0,one\n", r"row 1, column 'min': 'one' is not a number"),
        (b"name,min\nw,1\n", r"header \['name', 'min'\] lacks \['vpp_stage', 'step'\]"),
        (b'vpp_stage,name,step,min\n0,"a"b,0,1\n', r"line 2 is not CSV"),
        (b"vpp_stage,name,step,min\n0,a\nb,0,1\n0,c,0,1\n", r"row 1 has 2 cells"),  # a raw line break in a name
        (b"vpp_stage,name,step,m\x00n\n0,w,0,1\n", r"the header's column 'm\\x00n' holds a control character"),
    ],
)
@pytest.mark.parametrize("command", ["csv2db", "csv2tb"])
def test_bad_csv_is_one_line_naming_the_file(tmp_path, capsys, command, content, pattern):
    path = one_csv(tmp_path, content)
    code, err = cli_in_process(capsys, command, str(tmp_path / "monitor"), "-o", str(tmp_path / "out"))
    assert code == 2 and len(err) == 1, err
    assert re.match(rf"trainprobe {command}: error: {re.escape(str(path))}: .*{pattern}", err[0]), err[0]


def test_a_name_with_control_characters_stays_on_one_line(tmp_path, capsys):
    one_csv(tmp_path, b'vpp_stage,name,step,min\n0,"a\nb\rc\x1b[31m",zero,1\n')
    code, err = cli_in_process(capsys, "csv2db", str(tmp_path / "monitor"), "-o", str(tmp_path / "out"))
    assert code == 2 and len(err) == 1 and "\x1b" not in err[0]
    assert "column 'step': value 'zero' is not an integer" in err[0]


def test_rank_folder_above_2_63_exit_2(tmp_path, capsys):
    run = tmp_path / f"Nov25_06-27-30-rank{2**64}-0c5cd257"
    run.mkdir()
    (run / "grad_reduced_0-0.csv").write_text("vpp_stage,name,step,min\n0,w,0,1\n")
    code, err = cli_in_process(capsys, "csv2db", str(tmp_path), "-o", str(tmp_path / "out"))
    assert code == 2 and len(err) == 1
    assert re.match(rf"trainprobe csv2db: error: run folder .*: rank '{2**64}' is outside the 64-bit range", err[0])


def test_a_byte_order_mark_is_read_by_every_converter(tmp_path, capsys):
    run = write_reference_v1(tmp_path / "monitor")
    for path in run.glob("*.csv"):
        path.write_bytes(b"\xef\xbb\xbf" + path.read_bytes())
    assert cli_main(["csv2db", str(tmp_path / "monitor"), "-o", str(tmp_path / "db")]) == 0
    assert "csv2db: 22 rows from 4 file(s)" in capsys.readouterr().out
    assert cli_main(["csv2tb", str(tmp_path / "monitor"), "-o", str(tmp_path / "tb")]) == 0
    assert "rank0/actv: 8 rows, 48 scalars" in capsys.readouterr().out


# --------------------------------------------------------------------------- JSON


def test_deep_json_is_one_line_not_a_recursion_error(tmp_path, capsys):
    folder = tmp_path / "anomaly_detected" / "rank0"
    folder.mkdir(parents=True)
    (folder / "anomaly.json").write_text("[" * 100_000 + "]" * 100_000)
    code, err = cli_in_process(capsys, "anomaly-analyse", "-d", str(tmp_path))
    assert code == 2 and len(err) == 1 and err[0].endswith("rank0/anomaly.json: nested deeper than 64 levels; refused")
    done = subprocess.run(
        [sys.executable, "-m", "trainprobe.core.monitor.anomaly_processor", "-d", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT,
    )
    assert_one_line_exit_2(done, "anomaly-analyse", r"nested deeper than 64 levels")


@pytest.mark.parametrize(
    ("text", "pattern"),
    [
        ("[" * 65 + "]" * 65, r"nested deeper than 64 levels"),
        ('{"a": NaN}', r"NaN is not JSON"),
        ('{"a": 1, "a": 2}', r"key 'a' appears twice in one object"),
        ('{"a": ', r"not valid JSON \(Expecting value"),
        ('{"a": ' + "9" * 5000 + "}", r"not valid JSON \(Exceeds the limit"),
        ('{"a": "\\ud800"}', r"holds a lone surrogate escape such as \\ud800"),
    ],
)
def test_json_guard(text, pattern):
    with pytest.raises(ConfigError, match=rf"^where: {pattern}"):
        loads_checked(text, "where")


def test_json_depth_counts_without_recursion():
    deep: list[object] = []
    node = deep
    for _ in range(10_000):
        child: list[object] = []
        node.append(child)
        node = child
    assert (
        depth_of(deep, limit=64) == 65 and depth_of({"a": [1, {"b": []}]}, limit=64) == 4 and depth_of(3, limit=1) == 0
    )
    assert loads_checked("[" * 64 + "]" * 64, "w") is not None


def test_anomaly_integers_above_2_63(tmp_path, capsys):
    folder = tmp_path / "anomaly_detected" / "rank0"
    folder.mkdir(parents=True)
    event = {
        "rank": 0,
        "step": 2**64,
        "micro_step": 0,
        "pp_stage": 0,
        "vpp_stage": 0,
        "call_id": 0,
        "tag_name": "0:w/rank0/actv",
        "message": "",
        "group_mates": [0],
    }
    (folder / "anomaly.json").write_text(json.dumps({"k": event}))
    code, err = cli_in_process(capsys, "anomaly-analyse", "-d", str(tmp_path))
    assert code == 2 and len(err) == 1
    assert "anomaly.json: event 'k': field 'step' is outside the 64-bit range" in err[0]
    with pytest.raises(ConfigError, match=r"step_list: step '99999999999999999999' is outside the 64-bit"):
        parse_step_list("[99999999999999999999]")
    with pytest.raises(ConfigError, match=r"step_list: '\[²\]' is not a list of steps"):
        parse_step_list("[²]")


def test_bounded_int():
    assert bounded_int("-9223372036854775808", "v", "w") == -(2**63)
    for text, pattern in (("9223372036854775808", "outside"), ("١٢", "not an integer"), ("1\n", "not an integer")):
        with pytest.raises(ConfigError, match=rf"^w: v .* is {pattern}"):
            bounded_int(text, "v", "w")


# --------------------------------------------------------------------------- bounded fuzz

_SPICE = [b"\n", b"\r", b'"', b",", b"\xff", b"\x00", b"\xef\xbb\xbf", b"9" * 25, b"nan", b"-", b"\xe2\x80\xa8", b""]
_SPICE += [b"\\ud800", b"[[[[", b"NaN", b"9" * 5000]


def _mutate(data: bytes, rng: random.Random) -> bytes:
    out = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        where = rng.randrange(len(out) + 1)
        kind = rng.randrange(5)
        if kind == 0 and out:
            del out[where : where + rng.randint(1, 8)]
        elif kind == 1:
            out[where:where] = rng.choice(_SPICE)
        elif kind == 2 and out:
            out[where % len(out)] = rng.randrange(256)
        elif kind == 3:
            out = out[:where]  # a torn file
        else:
            line_start = out.rfind(b"\n", 0, where) + 1
            line_end = out.find(b"\n", where)
            out[where:where] = out[line_start : line_end + 1 if line_end >= 0 else len(out)]
    return bytes(out)


def test_fuzz_csv_reader_and_csv2db(tmp_path):
    """300 mutations of reference-layout files (V1 and V2): every outcome is a table or a ConfigError;
    a file that reads is also stored by csv2db."""
    write_reference_v1(tmp_path / "seed1")
    write_reference_v2(tmp_path / "seed2")
    seeds = [(p, p.read_bytes()) for p in sorted(tmp_path.glob("seed*/*/*.csv"))]
    rng = random.Random(20261124)
    outcomes = {"read": 0, "refused": 0}
    for index in range(300):
        source, data = seeds[index % len(seeds)]
        root = tmp_path / f"case{index}"
        target = root / source.parent.name / source.name
        target.parent.mkdir(parents=True)
        target.write_bytes(_mutate(data, rng))
        try:
            (file,) = find_csv_files(root)
            table = read_table(file)
            list(table.records())
            if index % 5 == 0:
                csv2db(CSV2DBConfig(root, output_dirpath=root / "db"))
            outcomes["read"] += 1
        except ConfigError as exc:
            assert str(exc).startswith((str(target), "monitor_path:")), exc
            outcomes["refused"] += 1
    assert outcomes["read"] > 30 and outcomes["refused"] > 30, outcomes


def test_fuzz_anomaly_json(tmp_path):
    """300 mutations of an anomaly.json: every outcome is a list of events or a ConfigError."""
    base = {
        f"0:fc1.input:0/rank0/actv_step_{s}_call_{s}": {
            "rank": 0,
            "step": s,
            "micro_step": 0,
            "pp_stage": 0,
            "vpp_stage": 0,
            "call_id": s,
            "tag_name": "0:fc1.input:0/rank0/actv",
            "message": "Rule AnomalyTurbulence reports anomaly signal",
            "group_mates": [0],
        }
        for s in range(3)
    }
    data = json.dumps(base, indent=1).encode()
    rng = random.Random(7)
    outcomes = {"read": 0, "refused": 0}
    folder = tmp_path / "anomaly_detected" / "rank0"
    folder.mkdir(parents=True)
    for _ in range(300):
        (folder / "anomaly.json").write_bytes(_mutate(data, rng))
        try:
            load_anomalies(tmp_path)
            outcomes["read"] += 1
        except ConfigError as exc:
            assert str(exc).startswith(("data_path:", str(folder / "anomaly.json")))
            outcomes["refused"] += 1
    assert outcomes["read"] > 10 and outcomes["refused"] > 100, outcomes


def test_cli_os_errors_and_control_characters_are_one_line(tmp_path, capsys, monkeypatch):
    import trainprobe.tools.exports.sqlite as csv2db_module

    assert one_line("a\nb\r\x1b[31m\u2028 c") == "a\\nb\\r\\x1b[31m\\u2028 c"

    def vanished(config: object, progress: bool = False, engine: str = "duckdb") -> None:
        raise PermissionError(13, "Permission denied", "/data/run/grad_reduced_0-0.csv")

    monkeypatch.setattr(csv2db_module, "csv2db", vanished)
    code, err = cli_in_process(capsys, "csv2db", str(tmp_path))
    assert code == 2 and err == [
        "trainprobe csv2db: error: [Errno 13] Permission denied: '/data/run/grad_reduced_0-0.csv'"
    ]


def test_tag_names_with_control_characters_print_on_one_line(tmp_path, capsys):
    folder = tmp_path / "anomaly_detected" / "rank0"
    folder.mkdir(parents=True)
    base = {"rank": 0, "micro_step": 0, "pp_stage": 0, "vpp_stage": 0, "call_id": 0, "group_mates": [0]}
    events = {
        "a": {**base, "step": 1, "tag_name": "0:f\nc\x1b[2J/rank0/actv", "message": "Rule X\x1bY z"},
        "b": {**base, "step": 2, "tag_name": "0:fc2/rank0/actv", "message": "Rule AnomalyNan reports"},
    }
    (folder / "anomaly.json").write_text(json.dumps(events))
    assert cli_main(["anomaly-analyse", "-d", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 6 and "\x1b" not in "".join(lines)
    assert "X\\x1bY " in lines[3] and lines[3].endswith(" 0:f\\nc\\x1b[2J/rank0/actv")
    assert lines[4].endswith("AnomalyNan  0:fc2/rank0/actv")


@pytest.mark.parametrize("command", ["csv2db", "csv2tb"])
def test_no_complete_row_anywhere_is_exit_2(tmp_path, capsys, command):
    """The old reader called every row of the reference's files torn and exited 0: a selection
    whose files hold no complete row at all is now an error."""
    one_csv(tmp_path, b"vpp_stage,name,step,min\n0,w,0,0.")  # header, then a torn row only
    (tmp_path / "monitor" / V1_RUN / "actv_0-0.csv").write_bytes(b"")
    code, err = cli_in_process(capsys, command, str(tmp_path / "monitor"), "-o", str(tmp_path / "out"))
    assert code == 2 and len(err) == 1, err
    assert "the 2 selected CSV file(s) under" in err[0] and "hold no complete row" in err[0]


# --------------------------------------------------------------------------- links leading out of the folder

SECRET = "TOP-SECRET-first-line"


def _secret(tmp_path: Path) -> Path:
    """A file outside the monitor output whose first line must never reach the user."""
    path = tmp_path / "private" / "id_rsa"
    path.parent.mkdir()
    path.write_text(f"{SECRET},a,b\n1,2,3\n", encoding="utf-8")
    return path


@pytest.mark.parametrize("command", ["csv2db", "csv2tb", "report"])
def test_a_csv_linking_outside_the_folder_is_skipped_unread(tmp_path, command):
    """A monitor CSV that is a link to a file outside the monitor output is skipped (one warning)
    and never opened: its first line appears nowhere (it was quoted as a 'header' before)."""
    write_reference_v1(tmp_path / "monitor")
    run = tmp_path / "monitor" / V1_RUN
    (run / "grad_unreduced_0-1.csv").symlink_to(_secret(tmp_path))
    done = run_cli(command, str(tmp_path / "monitor"), "-o", str(tmp_path / "out"))
    assert done.returncode == 0, done.stderr
    assert SECRET not in done.stdout + done.stderr
    assert "grad_unreduced_0-1.csv: a link to a file outside" in done.stderr and "skipped (not read)" in done.stderr


def test_only_links_outside_is_one_line_exit_2(tmp_path):
    run = tmp_path / "monitor" / V1_RUN
    run.mkdir(parents=True)
    (run / "actv_0-1.csv").symlink_to(_secret(tmp_path))
    done = run_cli("csv2db", str(tmp_path / "monitor"), "-o", str(tmp_path / "out"))
    assert_one_line_exit_2(done, "csv2db", r"no monitor CSV found .*skipped 1 links to files outside the folder")
    assert SECRET not in done.stderr


def test_a_file_swapped_for_a_link_after_discovery_is_refused(tmp_path):
    """The reader checks again when it opens the file (the folder may change meanwhile)."""
    write_reference_v1(tmp_path / "monitor")
    file = find_csv_files(tmp_path / "monitor", data_types=["actv"])[0]
    file.path.unlink()
    file.path.symlink_to(_secret(tmp_path))
    with pytest.raises(ConfigError, match=r"actv_0-1.csv: a link to a file outside .*monitor'; refused") as caught:
        read_table(file)
    assert SECRET not in str(caught.value)


def test_links_inside_the_folder_and_a_linked_folder_are_read(tmp_path):
    """Links that stay inside the folder given are fine, and so is a monitor output reached
    through a link (the folder the user names is trusted as a whole)."""
    write_reference_v1(tmp_path / "real")
    run = tmp_path / "real" / V1_RUN
    (run / "actv_0-1.csv").rename(tmp_path / "real" / "kept.csv")
    (run / "actv_0-1.csv").symlink_to(Path("..") / "kept.csv")
    (tmp_path / "linked").symlink_to(tmp_path / "real")
    files = find_csv_files(tmp_path / "linked")
    assert "actv" in {f.data_type for f in files}
    assert all(read_table(f).rows for f in files)


def test_the_opener_refuses_a_link_outside_within(tmp_path):
    secret = _secret(tmp_path)
    (tmp_path / "inside").mkdir()
    (tmp_path / "inside" / "link").symlink_to(secret)
    with pytest.raises(ConfigError, match=r"link: a link to a file outside .*inside'; refused") as caught:
        read_text(tmp_path / "inside" / "link", max_bytes=1000, within=tmp_path / "inside")
    assert SECRET not in str(caught.value)
    assert read_text(tmp_path / "inside" / "link", max_bytes=1000, within=tmp_path).startswith(SECRET)


def test_anomaly_json_linking_outside_is_skipped_unread(tmp_path, capsys):
    secret = tmp_path / "private" / "anomaly.json"
    secret.parent.mkdir()
    event = {"rank": 1, "step": 0, "micro_step": 0, "pp_stage": 0, "vpp_stage": 0, "call_id": 1}
    tag = f"{SECRET}/rank1/actv"
    secret.write_text(json.dumps({tag: {**event, "tag_name": tag, "message": "", "group_mates": []}}))
    folder = tmp_path / "anomaly_detected"
    (folder / "rank1").mkdir(parents=True)
    (folder / "rank1" / "anomaly.json").symlink_to(secret)
    (folder / "rank0").mkdir()
    tag = "0:fc1.input/rank0/actv"
    (folder / "rank0" / "anomaly.json").write_text(
        json.dumps({tag: {**event, "rank": 0, "tag_name": tag, "message": "", "group_mates": []}})
    )
    _, files, events = load_anomalies(folder)
    assert [e.data["rank"] for e in events] == [0] and len(files) == 1
    code, err = cli_in_process(capsys, "anomaly-analyse", "-d", str(folder), "-o", str(tmp_path / "out"))
    assert code == 0 and SECRET not in capsys.readouterr().out + "\n".join(err)


def test_report_skips_training_state_and_event_files_linking_outside(tmp_path):
    from trainprobe.tools.reporting.run import find_event_files, find_training_state

    secret = _secret(tmp_path)
    (tmp_path / "monitor" / "rank_0").mkdir(parents=True)
    (tmp_path / "monitor" / "rank_0" / "training_state.jsonl").symlink_to(secret)
    (tmp_path / "monitor" / "rank_0" / "events.out.tfevents.1.host").symlink_to(secret)
    assert find_training_state(tmp_path / "monitor") == []
    assert find_event_files(tmp_path / "monitor") == []
    # a file the user names is read wherever it is
    assert find_training_state(tmp_path / "monitor", tmp_path / "monitor" / "rank_0" / "training_state.jsonl")
