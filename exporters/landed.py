"""The tokens of the requests a spool stored, remembered so that a sender's retry is not stored twice.

A sender that never got its answer sends the same request again with the same token. The tokens of the last
``RECENT_TOKENS`` requests written ahead or stored are kept in memory and, once stored, in ``<slot>/landed`` (one a
line), which the next process to open the spool reads back, so a retry that reaches a restarted agent is still known.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

RECENT_TOKENS = 20_000  # request tokens remembered for recognising a sender's retry: minutes of a busy agent
LANDED = "landed"  # per slot: the tokens of requests stored, one per line


class LandedTokens:
    """The last ``RECENT_TOKENS`` request tokens, oldest first, and the slot's file of those stored."""

    def __init__(self):
        self._recent: dict[str, None] = {}  # request tokens of records written or stored, oldest first
        self._fd: int | None = None
        self._lines = 0
        self._path: Path | None = None

    def __contains__(self, token: str) -> bool:
        return token in self._recent

    def remember(self, token: str) -> None:
        self._recent[token] = None
        if len(self._recent) > RECENT_TOKENS:
            del self._recent[next(iter(self._recent))]

    def load(self, base: Path, directory: Path) -> None:
        """The tokens of requests stored by this slot's earlier owners and by the slots' around it (a restarted
        agent may get another slot), then this slot's file rewritten to the window and kept open for appending."""
        for path in sorted(base.glob(f"*/{LANDED}")):
            with contextlib.suppress(OSError):
                for line in path.read_text("ascii", "replace").split():
                    self.remember(line)
        self._path = directory / LANDED
        self._rewrite()

    def stored(self, tokens: list[str]) -> None:
        """Append the tokens of requests just stored (OSError when the disk refuses)."""
        if self._fd is None:
            return
        # no fsync: a retry the next owner does not recognise after a power cut is stored twice, at worst
        os.write(self._fd, "".join(f"{token}\n" for token in tokens).encode())
        self._lines += len(tokens)
        if self._lines > 2 * RECENT_TOKENS:
            self._rewrite()

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def _rewrite(self) -> None:
        self.close()
        data = "".join(f"{token}\n" for token in self._recent).encode()
        tmp = self._path.with_name(f".{LANDED}.tmp")
        tmp.write_bytes(data)
        os.rename(tmp, self._path)
        self._fd = os.open(self._path, os.O_WRONLY | os.O_APPEND)
        self._lines = len(self._recent)


__all__ = ["LANDED", "RECENT_TOKENS", "LandedTokens"]
