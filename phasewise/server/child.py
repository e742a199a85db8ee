"""A helper process a server hands work to that must not run in its own: work whose failure
could kill the process (native code fed a stranger's input), or whose CPU time would hold
the event loop (the GIL is one per process).

The child is ``python -m MODULE``; it reads requests from its stdin and writes answers to its
stdout, each message a frame (a 4-byte little-endian length, then that many bytes). A
request is one frame; its answer is any number of frames, then an empty one. The first
frame the child reads is its setup; it answers it with an empty answer once ready.

``Child`` is the parent's side. It is not thread-safe: one thread drives one child.
"""

from __future__ import annotations

import os
import select
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Callable

_HEADER = struct.Struct("<I")


class ChildTimeout(Exception):
    """No answer in time; the child was killed."""


class ChildDied(Exception):
    """The child ended without answering; ``code`` is its exit status (-N: signal N)."""

    def __init__(self, code: int) -> None:
        super().__init__(describe_exit(code))
        self.code = code


def describe_exit(code: int) -> str:
    if code < 0 and -code in signal.valid_signals():
        return f"signal {signal.Signals(-code).name}"
    return f"exit status {code}"


def write_frame(fd: int, data: bytes) -> None:
    view = memoryview(_HEADER.pack(len(data)) + data)
    while view:
        view = view[os.write(fd, view):]


def _read_exact(fd: int, n: int, deadline: float | None) -> bytes | None:
    """``n`` bytes from ``fd``; None at end of file; ``TimeoutError`` past ``deadline``."""
    chunks, got = [], 0
    while got < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise TimeoutError
        chunk = os.read(fd, min(n - got, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def read_frame(fd: int, deadline: float | None = None) -> bytes | None:
    head = _read_exact(fd, _HEADER.size, deadline)
    if head is None:
        return None
    n = _HEADER.unpack(head)[0]
    return _read_exact(fd, n, deadline) if n else b""


class Child:
    """The parent's handle on one child (started on first use, restarted after a death)."""

    def __init__(self, module: str, setup: bytes, *, env: dict[str, str] | None = None,
                 start_timeout_s: float = 120.0) -> None:
        self.module = module
        self.setup = setup
        self.env = env or {}
        self.start_timeout_s = start_timeout_s
        self.proc: subprocess.Popen | None = None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> None:
        self.kill()
        self.proc = subprocess.Popen(
            # -P: no current folder first on the path (it could shadow phasewise)
            [sys.executable, "-P", "-m", self.module], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env={**os.environ, **self.env})
        try:
            self._ask(self.setup, time.monotonic() + self.start_timeout_s)
        except (ChildTimeout, ChildDied) as e:
            raise RuntimeError(f"the helper process {self.module} did not start: {e}") from e

    def ask(self, request: bytes, timeout_s: float | None,
            on_start: Callable[[], None] | None = None) -> list[bytes]:
        """Send ``request``; the frames of the answer. The time limit counts from the
        sending (a child started first is not charged for its start)."""
        if not self.running:
            self.start()
            if on_start is not None:
                on_start()
        return self._ask(request, None if timeout_s is None else time.monotonic() + timeout_s)

    def _ask(self, request: bytes, deadline: float | None) -> list[bytes]:
        proc = self.proc
        assert proc is not None and proc.stdin is not None and proc.stdout is not None
        try:
            write_frame(proc.stdin.fileno(), request)
        except OSError:
            pass  # it died: what it left to read (nothing) and its status say so
        frames: list[bytes] = []
        try:
            while True:
                frame = read_frame(proc.stdout.fileno(), deadline)
                if frame is None:
                    break
                if not frame:
                    return frames
                frames.append(frame)
        except TimeoutError:
            self.kill()
            raise ChildTimeout() from None
        try:  # its output ended: it died
            code = proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            code = -signal.SIGKILL
        self.kill()
        raise ChildDied(code)

    def kill(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        for f in (proc.stdin, proc.stdout):
            if f is not None:
                f.close()


def serve(handle: Callable[[bytes], list[bytes]], setup: Callable[[bytes], None]) -> None:
    """The child's side: ``setup`` the first frame, then answer each request with the frames
    ``handle`` returns, until stdin ends."""
    rfd, wfd = sys.stdin.fileno(), sys.stdout.fileno()
    first = read_frame(rfd)
    if first is None:
        return
    setup(first)
    write_frame(wfd, b"")
    while True:
        request = read_frame(rfd)
        if request is None:
            return
        for frame in handle(request):
            if frame:
                write_frame(wfd, frame)
        write_frame(wfd, b"")
