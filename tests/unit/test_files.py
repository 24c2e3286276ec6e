"""files.write_atomic / atomic_path: a reader sees the old file or the new one, never part of one."""

from __future__ import annotations

import os
import stat

import pytest

from mismatch_probe.files import atomic_path, write_atomic


def test_write_atomic_writes_text_and_bytes_and_leaves_no_temporary_file(tmp_path):
    write_atomic(tmp_path / "a" / "report.md", "héllo\n")
    write_atomic(tmp_path / "a" / "fig.svg", b"<svg/>")
    assert (tmp_path / "a" / "report.md").read_text(encoding="utf-8") == "héllo\n"
    assert (tmp_path / "a" / "fig.svg").read_bytes() == b"<svg/>"
    assert sorted(os.listdir(tmp_path / "a")) == ["fig.svg", "report.md"]


def test_a_failed_write_keeps_the_previous_file(tmp_path):
    target = tmp_path / "run.json"
    write_atomic(target, "old")
    with pytest.raises(RuntimeError), atomic_path(target) as tmp:
        tmp.write_text("half of the new one")
        raise RuntimeError("killed while writing")
    assert target.read_text() == "old"
    assert os.listdir(tmp_path) == ["run.json"]


def test_the_file_keeps_the_umask_permissions_not_a_private_temporary_files(tmp_path):
    old = os.umask(0o022)
    try:
        write_atomic(tmp_path / "report.html", "<html>")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "report.html").stat().st_mode) == 0o644


def test_two_writers_of_one_file_use_different_temporary_files(tmp_path):
    with atomic_path(tmp_path / "x") as a, atomic_path(tmp_path / "x") as b:
        assert a != b and a.name.startswith(".x.") and b.name.startswith(".x.")
        a.write_text("a")
        b.write_text("b")
    assert (tmp_path / "x").read_text() in ("a", "b")
