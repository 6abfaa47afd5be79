"""The store's expected failures, below every module that opens or reaches a store."""

from __future__ import annotations


class StoreError(Exception):
    """An expected failure to open or use the store; its message is one line a person can act on."""


class StoreLockedError(StoreError):
    """The embedded store is held by another process (``pid``, when its status file names it)."""

    def __init__(self, message: str, pid: int | None = None):
        super().__init__(message)
        self.pid = pid


__all__ = ["StoreError", "StoreLockedError"]
