"""Hardening of the precision dump's files: names from user or data strings never leave
``dump_tensor_data``, fault handlers never raise, a full disk is reported as such.

Faults are real where the OS offers one without privileges (``/dev/full`` returns ENOSPC, a
NUL byte in a path is refused by every file call); elsewhere ``os.write`` / ``os.replace`` are
patched to fail as a full disk makes them fail. torch is never mocked."""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import logging
import os
import random
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import trainprobe.engine.log
from conftest import write_config
from dump_models import TwoLinear
from trainprobe.dump import PrecisionDebugger
from trainprobe.dump.store import StepStore, TensorFileWriter, disk_full, save_pt, write_json_atomically
from trainprobe.engine.file_names import MAX_NAME_BYTES, path_under, safe_file_name

ESCAPE = "../../../../escaped/ESC"
"""Four levels up from ``dump_tensor_data`` is the folder holding ``dump_path``."""


@pytest.fixture(autouse=True)
def _fresh_once_messages(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(trainprobe.engine.log, "_seen", set())  # once-per-process messages, per test


def the_rank_dir(dump: Path, step: int = 0) -> Path:
    dirs = sorted((dump / f"step{step}").iterdir())
    assert len(dirs) == 1, dirs
    return dirs[0]


def files_under(root: Path) -> list[Path]:
    return [Path(d) / f for d, _, fs in os.walk(root) for f in fs]


def data_names(entry: Any) -> list[str]:
    if isinstance(entry, dict):
        own = [entry["data_name"]] if "data_name" in entry else []
        return own + [n for v in entry.values() for n in data_names(v)]
    if isinstance(entry, list):
        return [n for v in entry for n in data_names(v)]
    return []


def assert_contained(root: Path, dump: Path, data: dict[str, Any]) -> None:
    """Every file below ``root`` is the config or lies in ``dump``; every data_name is a plain
    file in dump_tensor_data that loads."""
    rd = the_rank_dir(dump)
    outside = [p for p in files_under(root) if dump not in p.parents and p.name != "config.json"]
    assert outside == []
    tensor_dir = rd / "dump_tensor_data"
    pt_files = {p.name for p in tensor_dir.iterdir()}
    names = data_names(data)
    assert len(names) == len(set(names))
    assert set(names) == pt_files
    for name in names:
        assert safe_file_name(name) == name and ".." not in name and "/" not in name
        assert len(name.encode("utf-8")) <= MAX_NAME_BYTES
        torch.load(tensor_dir / name, weights_only=True)
    assert {p.parent for p in files_under(dump)} <= {rd, tensor_dir}


# -- names --------------------------------------------------------------------------------
def test_safe_file_name_keeps_ordinary_names_and_cleans_hostile_ones() -> None:
    assert safe_file_name("Functional.relu.0.forward.input.0", ".pt") == "Functional.relu.0.forward.input.0.pt"
    assert safe_file_name("Module.a b.Linear.forward.0", ".pt") == "Module.a b.Linear.forward.0.pt"
    cleaned = safe_file_name(ESCAPE + ".0.debug", ".pt")
    assert re.fullmatch(r"_\.__\.__\.__\._escaped_ESC\.0\.debug~[0-9a-f]{12}\.pt", cleaned)
    assert safe_file_name("a/b", ".pt") != safe_file_name("a_b", ".pt")  # distinct names stay distinct
    for hostile in ("", ".", "..", "a\x00b", "x" * 1000, "é" * 400, "a\u2028b", "s\udc80", "x."):
        name = safe_file_name(hostile, ".pt")
        assert name.endswith(".pt") and safe_file_name(name) == name
        assert len(name.encode("utf-8")) <= MAX_NAME_BYTES
    with pytest.raises(ValueError, match="not a plain file name"):
        path_under(Path("/tmp/d"), "../x.pt")
    with pytest.raises(ValueError, match="suffix '/x' is not safe"):
        safe_file_name("a", "/x")


def test_save_name_with_separators_stays_in_dump_tensor_data(tmp_path: Path) -> None:
    dump = tmp_path / "run" / "dump"
    debugger = PrecisionDebugger(config_path=write_config(tmp_path, {"task": "tensor", "level": "debug",
                                                                     "dump_path": str(dump)}))  # fmt: skip
    x = torch.randn(3, requires_grad=True)
    y = x * 2
    debugger.save(y, ESCAPE)
    y.sum().backward()
    debugger.step()

    data = json.loads((the_rank_dir(dump) / "debug.json").read_text())["data"]
    assert list(data) == [f"{ESCAPE}.0.debug", f"{ESCAPE}_grad.0.debug"]  # the JSON keeps the names
    assert_contained(tmp_path, dump, data)
    tensor_dir = the_rank_dir(dump) / "dump_tensor_data"
    assert torch.equal(torch.load(tensor_dir / data[f"{ESCAPE}.0.debug"]["data_name"], weights_only=True), y)
    assert not (tmp_path / "escaped").exists()


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x: torch.Tensor, **kwargs: torch.Tensor) -> dict[str, torch.Tensor]:
        extra = sum(kwargs.values())
        return {ESCAPE + "/out": self.lin(x) + extra, "plain": x * 2}


class _Box(nn.Module):
    """A module name with a separator (torch refuses dots there), a class name, keyword names and
    output keys that hold ``../``."""

    def __init__(self) -> None:
        super().__init__()
        hostile_class = type(ESCAPE + "/Cls", (_Block,), {})
        self.add_module("sub/dir", hostile_class())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        block = getattr(self, "sub/dir")
        out = block(x, **{ESCAPE + "/kw": x + 1, "\x00nul": x - 1})
        return out[ESCAPE + "/out"].sum() + out["plain"].sum()


def test_module_class_kwarg_and_key_names_stay_in_dump_tensor_data(tmp_path: Path) -> None:
    dump = tmp_path / "run" / "dump"
    debugger = PrecisionDebugger(task="tensor", level="L0", dump_path=str(dump))
    torch.manual_seed(0)
    model = _Box()
    x = torch.randn(2, 3, requires_grad=True)
    debugger.start(model)
    model(x).backward()
    debugger.stop()
    debugger.step()

    data = json.loads((the_rank_dir(dump) / "dump.json").read_text())["data"]
    forward = next(v for k, v in data.items() if k.endswith("forward.0") and "/Cls" in k)
    assert set(forward["input_kwargs"]) == {ESCAPE + "/kw", "\x00nul"}  # original names in the JSON
    assert set(forward["output"][0]) == {ESCAPE + "/out", "plain"}
    assert len(data_names(data)) >= 8
    assert_contained(tmp_path, dump, data)


HOSTILE_PARTS = ["/", "\\", "..", ".", "\x00", "\n", "\r", "\u2028", "\x85", "\x0c", "\t", "\udc80", "~", "é",
                 "😀", " ", ",", '"', "%s", "a", "Z", "0", "-", "_"]  # fmt: skip


def hostile_name(rng: random.Random) -> str:
    if rng.random() < 0.05:
        return "".join(rng.choice(HOSTILE_PARTS) for _ in range(rng.randint(150, 400)))  # too long
    return "".join(rng.choice(HOSTILE_PARTS) for _ in range(rng.randint(1, 12)))


def test_fuzz_no_file_outside_dump_path(tmp_path: Path) -> None:
    """A few hundred random hostile save() names and dict keys: every file lands in
    dump_tensor_data, one per data_name, each loadable."""
    rng = random.Random(20261124)
    dump = tmp_path / "run" / "dump"
    debugger = PrecisionDebugger(task="tensor", level="debug", dump_path=str(dump))
    t = torch.arange(4.0)
    names = set()
    for _ in range(300):
        name = hostile_name(rng) or "empty"
        names.add(name)
        debugger.save({hostile_name(rng): t, hostile_name(rng): [t]}, name, save_backward=False)
    debugger.step()

    data = json.loads((the_rank_dir(dump) / "debug.json").read_text())["data"]
    assert {k.rsplit(".", 2)[0] for k in data} == names
    assert_contained(tmp_path, dump, data)


def test_a_symlink_planted_at_a_file_name_is_not_followed(tmp_path: Path) -> None:
    dump = tmp_path / "dump"
    outside = tmp_path / "precious.txt"
    outside.write_text("keep me")
    debugger = PrecisionDebugger(task="tensor", level="debug", dump_path=str(dump))
    tensor_dir = dump / "step0" / f"proc{os.getpid()}" / "dump_tensor_data"
    tensor_dir.mkdir(parents=True)
    (tensor_dir / "v.0.debug.pt").symlink_to(outside)
    debugger.save(torch.ones(3), "v")
    debugger.save(torch.ones(3), "w")
    debugger.step()
    assert outside.read_text() == "keep me"
    assert torch.equal(torch.load(tensor_dir / "w.0.debug.pt", weights_only=True), torch.ones(3))


# -- fault handlers -------------------------------------------------------------------------
def test_log_error_never_raises(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = StepStore(tmp_path / "bad\x00dir", {}, TensorFileWriter(False))
    with caplog.at_level(logging.ERROR, logger="trainprobe"):
        store.log_error("first")
        store.log_error("second")
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 1 and "cannot write" in messages[0] and "first" in messages[0]
    assert not caplog.records[0].exc_info  # one line, no traceback

    ok = StepStore(tmp_path / "ok", {}, TensorFileWriter(False))
    ok.log_error("two\nlines")
    assert (tmp_path / "ok" / "dump_error_info.log").read_text().endswith(" two\\nlines\n")


def test_stop_and_step_never_raise_when_the_dump_path_is_refused(tmp_path: Path) -> None:
    """A dump_path every file call refuses (here a NUL byte, as if the config check were
    bypassed): training goes on, stop()/step() return, the fault is logged."""
    debugger = PrecisionDebugger(task="tensor", level="L1", dump_path=str(tmp_path / "d"))
    debugger.config = dataclasses.replace(debugger.config, dump_path=str(tmp_path / "bad\x00dir"))
    torch.manual_seed(0)
    model = TwoLinear()
    x = torch.randn(2, 8)
    debugger.start()
    loss = model(x).sum()
    loss.backward()
    debugger.stop()
    debugger.step()
    assert debugger.collector.disabled
    torch.manual_seed(0)
    assert torch.equal(TwoLinear()(x).sum(), loss)


# -- disk full ------------------------------------------------------------------------------
def test_save_pt_to_a_full_device_raises_enospc_and_keeps_the_device() -> None:
    with pytest.raises(OSError, match="No space left on device") as info:
        save_pt(torch.zeros(100_000), "/dev/full")
    assert info.value.errno == errno.ENOSPC
    assert Path("/dev/full").is_char_device()


def test_full_disk_is_reported_once_as_no_space(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    real_write = os.write
    refused = []

    def full_for_pt(fd: int, data: Any) -> int:
        if os.readlink(f"/proc/self/fd/{fd}").endswith(".pt"):
            refused.append(fd)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", full_for_pt)
    dump = tmp_path / "dump"
    debugger = PrecisionDebugger(task="tensor", level="L1", dump_path=str(dump))
    torch.manual_seed(0)
    model = TwoLinear()
    with caplog.at_level(logging.ERROR, logger="trainprobe"):
        debugger.start()
        model(torch.randn(2, 8)).sum().backward()
        debugger.stop()
        debugger.step()
    assert refused
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 1, messages
    assert "no space left on device writing" in messages[0] and str(dump) in messages[0]
    assert not any("inline_container" in m for m in messages)
    rd = the_rank_dir(dump)
    assert list((rd / "dump_tensor_data").iterdir()) == []  # no torn .pt file left behind
    assert json.loads((rd / "dump.json").read_text())["data"]  # the statistics are still written
    log_lines = (rd / "dump_error_info.log").read_text().splitlines()
    assert log_lines and all("no space left on device writing" in line or "could not be written" in line
                             for line in log_lines)  # fmt: skip


def test_the_writer_reports_a_real_enospc_in_one_line(caplog: pytest.LogCaptureFixture) -> None:
    writer = TensorFileWriter(False)
    seen: list[str] = []
    with caplog.at_level(logging.ERROR, logger="trainprobe"):
        writer.save(Path("/dev/full"), torch.zeros(50_000), seen.append)
        writer.save(Path("/dev/full"), torch.ones(50_000), seen.append)
        writer.wait()
    assert seen == ["no space left on device writing /dev/full"] * 2
    assert [r.getMessage() for r in caplog.records] == [
        "trainprobe dump: no space left on device writing /dev/full; dump files that do not fit are skipped"
    ]
    assert Path("/dev/full").is_char_device()


def test_a_failed_json_write_leaves_no_temporary_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "dump.json"
    target.write_text('{"old": 1}')

    def full(src: Any, dst: Any) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "replace", full)
    with pytest.raises(OSError, match="No space left"):
        write_json_atomically(target, {"new": 2})
    assert [p.name for p in tmp_path.iterdir()] == ["dump.json"]
    assert json.loads(target.read_text()) == {"old": 1}


def test_full_disk_at_json_time_is_one_line_and_the_next_step_dumps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    real_replace = os.replace

    def full(src: Any, dst: Any) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(dst))

    dump = tmp_path / "dump"
    debugger = PrecisionDebugger(task="statistics", level="L1", dump_path=str(dump))
    model = TwoLinear()
    monkeypatch.setattr(os, "replace", full)
    with caplog.at_level(logging.ERROR, logger="trainprobe"):
        for step in range(2):
            if step == 1:
                monkeypatch.setattr(os, "replace", real_replace)  # space freed
            debugger.start()
            model(torch.randn(2, 8)).sum().backward()
            debugger.stop()
            debugger.step()
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 1 and messages[0].startswith("trainprobe dump: no space left on device writing ")
    assert not caplog.records[0].exc_info
    assert not (the_rank_dir(dump, 0) / "dump.json").exists()
    assert [p.name for p in the_rank_dir(dump, 0).iterdir()] == []  # no temporary files left
    assert json.loads((the_rank_dir(dump, 1) / "dump.json").read_text())["data"]


def test_disk_full_is_recognised_without_errno(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An error that names no errno (torch's ``enforce fail at inline_container.cc``) counts as
    a full disk when the message says so or when under 1 MiB is left."""
    torch_error = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    assert disk_full(OSError(errno.ENOSPC, "x"), tmp_path)
    assert not disk_full(OSError(errno.EACCES, "x"), tmp_path)
    assert disk_full(RuntimeError("write failed: No space left on device"), tmp_path)
    assert not disk_full(torch_error, tmp_path)  # this machine's tmp has room

    class Full:  # what statvfs reports for a file system with 3 blocks of 4 KiB left
        f_bavail = 3
        f_frsize = 4096

    monkeypatch.setattr(os, "statvfs", lambda folder: Full)
    assert disk_full(torch_error, tmp_path)


# -- distinct names, distinct files (issue #27.5) ---------------------------------------------
def test_a_plain_name_never_equals_a_cleaned_one(tmp_path: Path) -> None:
    """``save({"k": t1}, "a/b")`` and ``save({"k~<digest>": t2}, "a_b")``, the second named like
    the first's cleaned file: two files, each holding its own tensor."""
    cleaned = safe_file_name("a/b.0.debug.k", ".pt")
    key = cleaned[len("a_b.0.debug.") : -len(".pt")]
    assert f"a_b.0.debug.{key}.pt" == cleaned  # the second name, kept as it is, would be that file
    dump = tmp_path / "dump"
    debugger = PrecisionDebugger(task="tensor", level="debug", dump_path=str(dump))
    t1, t2 = torch.ones(3), torch.full((3,), 2.0)
    debugger.save({"k": t1}, "a/b", save_backward=False)
    debugger.save({key: t2}, "a_b", save_backward=False)
    debugger.step()
    data = json.loads((the_rank_dir(dump) / "debug.json").read_text())["data"]
    first, second = data["a/b.0.debug"]["k"]["data_name"], data["a_b.0.debug"][key]["data_name"]
    assert first != second
    tensor_dir = the_rank_dir(dump) / "dump_tensor_data"
    assert torch.equal(torch.load(tensor_dir / first, weights_only=True), t1)
    assert torch.equal(torch.load(tensor_dir / second, weights_only=True), t2)


def adversarial_names(rng: random.Random) -> list[str]:
    """Hostile names, each with the names an attacker would pick to hit its file: its cleaned
    stem (with and without the suffix), case changes, a second digest marker, long variants."""
    names: set[str] = {"a/b", "a_b", "a\\b", "a..b", "a_.b", ".", "..", "", "x.", "x_", "~", "a~", "A/B"}
    for _ in range(400):
        names.add(hostile_name(rng))
    for base in list(names):
        for suffix in (".pt", ""):
            cleaned = safe_file_name(base, suffix)
            stem = cleaned[: -len(suffix)] if suffix else cleaned
            names.update({stem, cleaned, stem.upper(), stem + "~" + "0" * 12, stem[:-1]})
        names.add(base + "~" + hashlib.sha256(base.encode("utf-8", "surrogatepass")).hexdigest()[:12])
    names.update("x" * n for n in (240, 241, 242, 243, 244, 252, 253, 300))
    return sorted(names)


def test_distinct_names_give_distinct_file_names() -> None:
    names = adversarial_names(random.Random(27))
    assert len(names) > 2000
    for suffix in (".pt", ""):
        files = [safe_file_name(n, suffix) for n in names]
        assert len(set(files)) == len(names), [n for n in names if files.count(safe_file_name(n, suffix)) > 1][:4]
        assert all(path_under(Path("/d"), f) == Path("/d") / f for f in files)  # each a plain file name
