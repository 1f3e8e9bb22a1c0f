"""``sglang_tev.atomic.check_writable_file``: a long command checks where it will write before it
measures, and leaves nothing behind."""

from __future__ import annotations

import os

import pytest

from sglang_tev.atomic import atomic_write, check_writable_file


def test_a_writable_path_is_accepted_and_its_folder_made(tmp_path):
    target = tmp_path / "new" / "deeper" / "out.json"
    got = check_writable_file(target)
    assert got == target.resolve() and target.parent.is_dir()
    assert os.listdir(target.parent) == []  # the probe file is gone
    atomic_write(got, "{}")
    assert target.read_text() == "{}"


def test_a_directory_or_an_unwritable_place_is_refused(tmp_path):
    with pytest.raises(ValueError, match="is a directory"):
        check_writable_file(tmp_path)
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ValueError, match="cannot write beside"):
        check_writable_file(blocker / "out.json")  # its "folder" is a file
    if os.geteuid() != 0:  # root writes anywhere: the read-only case needs a user
        ro = tmp_path / "ro"
        ro.mkdir()
        ro.chmod(0o500)
        try:
            with pytest.raises(ValueError, match="cannot write beside"):
                check_writable_file(ro / "out.json")
        finally:
            ro.chmod(0o700)
    assert sorted(p.name for p in tmp_path.iterdir()) == (["file"] if os.geteuid() == 0 else ["file", "ro"])  # no probe left
