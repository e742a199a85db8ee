"""Files phasewise writes that other processes read while it writes them."""

from __future__ import annotations

import json
import os
import stat
import tempfile
from pathlib import Path
from typing import Any


def write_text_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` so that a reader sees the old file or the new one, never
    half of one: the text goes to a temporary file of its own in the same folder (two
    writers at once never share one), which then replaces ``path``."""
    path = Path(os.path.realpath(path))  # a symlink's target is written, the link kept
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        st = os.stat(path)
        # (a device, a pipe, a socket: the rename would replace it with a file; as root,
        # /dev/null itself)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{path}: not a regular file (phasewise writes files only)")
        mode = st.st_mode & 0o7777  # the file's own mode, kept
    except FileNotFoundError:
        umask = os.umask(0)
        os.umask(umask)
        mode = 0o666 & ~umask  # as open() would make it (mkstemp's 0600 would not)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def check_output(path: str | Path, option: str, folder: bool = False) -> None:
    """Refuse, before any work, an output the command could not write at the end: ``path``
    (given as ``option``) a folder where a file goes (``folder`` False) or a file where a
    folder goes, or under a folder that cannot be made or written. Raises ValueError
    naming the option."""
    p = Path(path)
    if str(path) == "":
        raise ValueError(f"{option}: an empty path; give a {'folder' if folder else 'file'}")
    if p.exists() and p.is_dir() != folder:
        what = "folder" if p.is_dir() else "file" if p.is_file() else "device or pipe"
        raise ValueError(f"{option} {path}: is a {what}; give a "
                         f"{'folder' if folder else 'file name'}")
    if p.exists() and not folder and not p.is_file():
        raise ValueError(f"{option} {path}: not a regular file (a device, a pipe or a "
                         "socket); give a file name")
    if p.exists() and not os.access(p, os.W_OK):
        raise ValueError(f"{option} {path}: not writable")
    parent = p if folder and p.exists() else p.parent
    while not parent.exists() and not parent.is_symlink():
        parent = parent.parent  # the folders that would be made: their first existing one
    if parent.is_symlink() and not parent.exists():
        raise ValueError(f"{option} {path}: {parent} is a symlink to a missing "
                         f"{os.readlink(parent)}")
    if not parent.is_dir():
        raise ValueError(f"{option} {path}: {parent} is a file, not a folder")
    # Tried for real: os.access says yes to root everywhere, even under /proc or on a
    # read-only mount, and the command would find out only after its work.
    try:
        if parent == p.parent or (folder and parent == p):
            fd, probe = tempfile.mkstemp(dir=parent, prefix=".phasewise-probe-")
            os.close(fd)
            os.unlink(probe)
        else:
            os.rmdir(tempfile.mkdtemp(dir=parent, prefix=".phasewise-probe-"))
    except OSError as e:
        raise ValueError(f"{option} {path}: cannot write in {parent} ({e.strerror})") from None


def read_json_file(path: str | Path) -> Any:
    """A JSON file's contents; a file that is missing, a folder, not UTF-8 or not JSON is a
    ValueError (FileNotFoundError where missing) that names it."""
    p = Path(path)
    if p.is_dir():
        raise ValueError(f"{path}: a folder, not a JSON file")
    try:
        text = p.read_bytes().decode("utf-8")
    except FileNotFoundError:
        raise FileNotFoundError(f"no such file: {path}") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text (byte {e.start}); a JSON file is") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not JSON ({e})") from None
