"""Files phasewise writes that other processes read while it writes them."""

from __future__ import annotations

import json
import os
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
        mode = os.stat(path).st_mode & 0o7777  # the file's own mode, kept
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
        raise ValueError(f"{option} {path}: is a {'file' if folder else 'folder'}; give a "
                         f"{'folder' if folder else 'file name'}")
    if p.exists() and not os.access(p, os.W_OK):
        raise ValueError(f"{option} {path}: not writable")
    parent = p if folder and p.exists() else p.parent
    while not parent.exists():  # the folders that would be made: their first existing one
        parent = parent.parent
    if not parent.is_dir():
        raise ValueError(f"{option} {path}: {parent} is a file, not a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"{option} {path}: cannot write in {parent}")


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
