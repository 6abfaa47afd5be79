"""Run a command on a real pseudo-terminal of a given width, as a person at a terminal would see it."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import selectors
import struct
import subprocess
import termios
import time

QUIET_S = 0.2  # after the command exits, this long without output ends the reading
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07")


def run_on_terminal(argv: list[str], columns: int, env: dict | None = None, timeout_s: float = 120) -> tuple[int, str]:
    """(exit status, what the terminal showed: escape sequences removed, ``\\r\\n`` as ``\\n``)."""
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 50, columns, 0, 0))
    environment = {k: v for k, v in (env or os.environ).items() if k not in ("COLUMNS", "LINES", "TTY_COMPATIBLE")}
    process = subprocess.Popen(argv, stdin=follower, stdout=follower, stderr=follower, env=environment, close_fds=True)
    # The follower stays open here until the end: when the command's exit closed the last one, a read could answer
    # EIO (the terminal hung up) before the kernel had moved the command's last output to the leader, which was lost.
    chunks = []
    # a selector, not select(): the test process may hold more than 1,024 descriptors by the time it runs this
    waiting = selectors.DefaultSelector()
    waiting.register(leader, selectors.EVENT_READ)
    quiet_since = time.monotonic()
    try:
        while True:
            exited = process.poll() is not None
            if waiting.select(QUIET_S):
                chunks.append(os.read(leader, 65536))
                quiet_since = time.monotonic()
            elif exited:  # it had exited, and nothing more came for QUIET_S: all it printed is read
                break
            elif time.monotonic() - quiet_since > timeout_s:
                process.kill()
                raise TimeoutError(f"{argv} printed nothing for {timeout_s} s")
    finally:
        waiting.close()
        os.close(leader)
        os.close(follower)
    status = process.wait(timeout=timeout_s)
    return status, _ANSI.sub("", b"".join(chunks).decode("utf-8", "replace")).replace("\r\n", "\n")
