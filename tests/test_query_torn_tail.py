"""``query_files.torn_tail`` / ``clean_length``: the complete part of a CSV file whose last record
is torn, found in one linear pass, and how many lines that leaves out (issue #33)."""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest

from trainprobe.tools.runs.files import TornTail, clean_length, torn_tail

HEADER = "vpp_stage,step,module_name,scope,micro_step,min,norm,nans\n"


def _reference(data: bytes) -> int | None:
    """The former quadratic rule, kept here as the specification of the cut."""
    if not data:
        return 0
    if data[-1:] in (b"\n", b"\r"):
        return None
    end = data.rfind(b"\n")
    while end >= 0 and data.count(b'"', 0, end) % 2:
        end = data.rfind(b"\n", 0, end)
    return end + 1


def _write(tmp_path: Path, text: str | bytes) -> Path:
    path = tmp_path / "weight_grad_step0-1.csv"
    path.write_bytes(text.encode() if isinstance(text, str) else text)
    return path


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("", None),
        (HEADER + "0,1,w,reduced,,1.0,2.0,0\n", None),
        (HEADER + "0,1,w,reduced,,1.0,2.0,0\r", None),
        (HEADER + "0,1,w,reduced,,1.0,2.0,0\n0,1,v,red", TornTail(len(HEADER) + 25, 1, 3, False)),
        (HEADER + '0,1,"odd\nname', TornTail(len(HEADER), 2, 2, True)),
        (HEADER + '0,1,"a\nb",reduced,,0.5', TornTail(len(HEADER), 2, 2, False)),
        (HEADER + '0,1,"say ""hi""",reduced,,1,2,0\n0,2', TornTail(len(HEADER) + 32, 1, 3, False)),
        ("vpp_stage,step,modu", TornTail(0, 1, 1, False)),
    ],
    ids=["empty", "complete", "complete-cr", "torn-number", "torn-in-quoted-name", "torn-after-quoted-break",
         "doubled-quotes", "torn-header"],
)
def test_torn_tail_cases(tmp_path: Path, text: str, expected: TornTail | None) -> None:
    path = _write(tmp_path, text)
    assert torn_tail(path) == expected
    assert clean_length(path) == _reference(text.encode())


def test_one_unbalanced_quote_mid_file_is_reported_as_thousands_of_lines(tmp_path: Path) -> None:
    rows = [f"0,{i},p{i},reduced,,1.0,2.0,0\n" for i in range(5000)]
    rows[10] = '0,10,"p10,reduced,,1.0,2.0,0\n'  # an opening quote never closed
    path = _write(tmp_path, HEADER + "".join(rows) + "0,5000,torn")
    tail = torn_tail(path)
    assert tail is not None and tail.quote_open
    assert tail.first_line == 12  # header, 10 whole rows, then the row with the quote
    assert tail.lines == 4991  # that row, the 4,989 after it and the torn last line
    assert tail.cut == len(HEADER) + sum(len(r) for r in rows[:10])


def test_agrees_with_the_former_rule_on_random_files(tmp_path: Path) -> None:
    rng = random.Random(33)
    alphabet = [b"a", b",", b"\n", b'"', b"\r", b"1"]
    for case in range(400):
        data = b"".join(rng.choice(alphabet) for _ in range(rng.randrange(0, 40)))
        path = tmp_path / f"f{case}.csv"
        path.write_bytes(data)
        assert clean_length(path) == _reference(data), data
        tail = torn_tail(path)
        if tail is not None:
            assert tail.first_line == data[: tail.cut].count(b"\n") + 1
            assert tail.lines == data[tail.cut :].count(b"\n") + 1
            assert tail.quote_open == (data.count(b'"') % 2 == 1)


def test_chunked_scan_across_chunk_boundaries(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import trainprobe.tools.runs.files as query_files

    monkeypatch.setattr(query_files, "_SCAN_CHUNK", 7)
    rng = random.Random(7)
    for case in range(100):
        data = b"".join(rng.choice([b"ab", b",", b"\n", b'"', b"12"]) for _ in range(rng.randrange(1, 60)))
        path = tmp_path / f"c{case}.csv"
        path.write_bytes(data)
        assert clean_length(path) == _reference(data), data
        tail = torn_tail(path)
        if tail is not None:
            assert (tail.first_line, tail.lines) == (data[: tail.cut].count(b"\n") + 1, data[tail.cut :].count(b"\n") + 1)


def test_linear_a_4_mb_file_with_an_unbalanced_quote(tmp_path: Path) -> None:
    """The former rule took about a minute for 1 MB with one unbalanced quote (quadratic)."""
    row = "0,1,layers.0.q_proj.weight,reduced,,0.001,0.002,0\n"
    count = (4 << 20) // len(row)
    body = row * (count // 2) + '0,1,"broken,reduced,,0.001,0.002,0\n' + row * (count // 2)
    path = _write(tmp_path, HEADER + body + "0,1,torn")
    start = time.perf_counter()
    tail = torn_tail(path)
    elapsed = time.perf_counter() - start
    assert tail is not None and tail.quote_open and tail.lines == count // 2 + 2
    assert elapsed < 2.0, f"{elapsed:.2f} s for 4 MB"
