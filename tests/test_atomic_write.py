"""``sinks.files.write_atomically``: the one temporary-file-then-rename writer (issue 15.3).

The old writers used predictable temporary names (``.<name>.tmp``, ``.<name>.<pid>.tmp``) opened
without ``O_EXCL``, so a symbolic link planted under that name made them overwrite its target.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from trainprobe.engine.sinks.files import write_atomically, write_json_atomically
from trainprobe.tools.reporting.report import write_report


def _plant(folder: Path, names: list[str], victim: Path) -> None:
    for name in names:
        (folder / name).symlink_to(victim)


def test_report_does_not_follow_a_link_planted_at_the_old_temporary_name(tmp_path, monitor_runs):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    out = tmp_path / "out"
    out.mkdir()
    _plant(out, [".report.html.tmp"], victim)
    path = write_report(monitor_runs.v2, out / "report.html")
    assert victim.read_text() == "precious"
    assert path.read_text(encoding="utf-8").startswith("<!DOCTYPE html>")
    assert (out / ".report.html.tmp").is_symlink()  # left alone, not written through
    assert sorted(p.name for p in out.iterdir()) == [".report.html.tmp", "report.html"]


def test_json_writer_does_not_follow_links_at_its_old_temporary_names(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    old_names = [f".dump.json.{os.getpid()}.tmp", f".dump.json.{os.getpid()}.{threading.get_ident()}.tmp"]
    _plant(tmp_path, old_names, victim)
    write_json_atomically(tmp_path / "dump.json", {"a": 1})
    assert victim.read_text() == "precious"
    assert (tmp_path / "dump.json").read_text() == '{\n  "a": 1\n}'


def test_a_link_at_the_target_itself_is_replaced_not_followed(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    (tmp_path / "out.txt").symlink_to(victim)
    assert write_atomically(tmp_path / "out.txt", "new")
    assert victim.read_text() == "precious"
    assert not (tmp_path / "out.txt").is_symlink() and (tmp_path / "out.txt").read_text() == "new"


def test_failure_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
    target = tmp_path / "t.bin"
    target.write_bytes(b"old")

    def half_then_fail(handle):
        handle.write(b"half")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        write_atomically(target, half_then_fail)
    assert target.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["t.bin"]


def test_unless_leaves_the_file_and_permissions_follow_the_umask(tmp_path):
    target = tmp_path / "cfg.json"
    target.write_text("user's")
    assert write_atomically(target, "ours", unless=lambda: True) is False
    assert target.read_text() == "user's" and [p.name for p in tmp_path.iterdir()] == ["cfg.json"]
    old = os.umask(0o027)
    try:
        assert write_atomically(tmp_path / "new" / "f.txt", b"x")  # parent created
    finally:
        os.umask(old)
    assert (tmp_path / "new" / "f.txt").stat().st_mode & 0o777 == 0o640
