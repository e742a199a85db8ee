"""write_text_atomic: a reader sees the old file or the new one, and no temporary is left."""

from __future__ import annotations

import os

import pytest

from phasewise.files import write_text_atomic


def test_the_new_text_replaces_the_old_and_no_temporary_stays(tmp_path):
    path = tmp_path / "sub" / "machine.json"
    write_text_atomic(path, "old")
    inode = os.stat(path).st_ino
    write_text_atomic(path, "new")
    assert path.read_text() == "new"
    assert os.stat(path).st_ino != inode  # a new file took the name: never rewritten in place
    assert os.listdir(path.parent) == ["machine.json"]


def test_a_write_that_fails_leaves_the_old_file_whole(tmp_path):
    path = tmp_path / "machine.json"
    write_text_atomic(path, "old")
    with pytest.raises(TypeError):
        write_text_atomic(path, b"not text")  # type: ignore[arg-type]
    assert path.read_text() == "old"
    assert os.listdir(tmp_path) == ["machine.json"]
