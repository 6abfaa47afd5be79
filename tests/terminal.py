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

_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07")


def run_on_terminal(argv: list[str], columns: int, env: dict | None = None, timeout_s: float = 120) -> tuple[int, str]:
    """(exit status, what the terminal showed: escape sequences removed, ``\\r\\n`` as ``\\n``)."""
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 50, columns, 0, 0))
    environment = {k: v for k, v in (env or os.environ).items() if k not in ("COLUMNS", "LINES", "TTY_COMPATIBLE")}
    process = subprocess.Popen(argv, stdin=follower, stdout=follower, stderr=follower, env=environment, close_fds=True)
    os.close(follower)
    chunks = []
    # a selector, not select(): the test process may hold more than 1,024 descriptors by the time it runs this
    waiting = selectors.DefaultSelector()
    waiting.register(leader, selectors.EVENT_READ)
    try:
        while True:
            if not waiting.select(timeout_s):
                process.kill()
                raise TimeoutError(f"{argv} printed nothing for {timeout_s} s")
            try:
                data = os.read(leader, 65536)
            except OSError:  # EIO: the command exited and closed the terminal
                break
            if not data:
                break
            chunks.append(data)
    finally:
        waiting.close()
        os.close(leader)
    status = process.wait(timeout=timeout_s)
    return status, _ANSI.sub("", b"".join(chunks).decode("utf-8", "replace")).replace("\r\n", "\n")
