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


def test_a_written_file_keeps_its_mode_and_a_symlink_stays_a_link(tmp_path):
    """Another user's server reads a plan or a machine file this user wrote: a new file
    takes the umask's mode as open() gives it (not a temporary's 0600), an existing one
    keeps its own, and a symlinked file is written through its link."""
    new = tmp_path / "new.json"
    umask = os.umask(0o022)
    try:
        write_text_atomic(new, "x")
    finally:
        os.umask(umask)
    assert os.stat(new).st_mode & 0o777 == 0o644
    os.chmod(new, 0o640)
    write_text_atomic(new, "y")
    assert os.stat(new).st_mode & 0o777 == 0o640 and new.read_text() == "y"
    link = tmp_path / "link.json"
    link.symlink_to(new)
    write_text_atomic(link, "z")
    assert link.is_symlink() and new.read_text() == "z"


def test_a_device_or_pipe_is_never_replaced_by_a_file(tmp_path):
    """As root, bench report -o /dev/full replaced the device with the report (the rename
    over it succeeds): an output that exists and is no regular file is refused."""
    from phasewise.files import check_output

    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match="not a regular file"):
        write_text_atomic(fifo, "report")
    assert fifo.is_fifo() and not any(p.name.endswith(".tmp") for p in tmp_path.iterdir())
    link = tmp_path / "to-null"
    link.symlink_to(os.devnull)
    for path in (fifo, os.devnull, link):
        with pytest.raises(ValueError, match="-o/--output .*not a regular file"):
            check_output(path, "-o/--output")
    assert os.path.exists(os.devnull) and not os.path.isfile(os.devnull)


def test_an_output_that_cannot_be_written_is_refused_before_the_work(tmp_path):
    """os.access says yes to root everywhere: measure --out /proc/x.json measured for a
    minute, then failed on its temporary file's name. The folder is tried for real."""
    from phasewise.files import check_output

    with pytest.raises(ValueError, match=r"--out /proc/phasewise-x\.json: cannot write in /proc"):
        check_output("/proc/phasewise-x.json", "--out")
    with pytest.raises(ValueError, match="--k8s-out .*: cannot write in /proc"):
        check_output("/proc/phasewise-x/y", "--k8s-out", folder=True)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="is a file, not a folder"):
        check_output(tmp_path / "file" / "out.json", "--out")
    check_output(tmp_path / "new" / "deeper" / "out.json", "--out")  # folders to be made
    check_output(tmp_path / "dir", "--k8s-out", folder=True)
    assert [p.name for p in tmp_path.iterdir()] == ["file"]  # no probe left behind
