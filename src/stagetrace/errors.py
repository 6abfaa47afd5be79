"""The expected failures below every module that opens or reaches a store (and the command line), and a hardware
source's absence, which the collectors and the NVML binding (``stagetrace.nvml``) both raise."""

from __future__ import annotations


class StoreError(Exception):
    """An expected failure to open or use the store; its message is one line a person can act on."""


class StoreLockedError(StoreError):
    """The embedded store is held by another process (``pid``, when its status file names it)."""

    def __init__(self, message: str, pid: int | None = None):
        super().__init__(message)
        self.pid = pid


def first_line(exc: BaseException) -> str:
    """An exception's message as one line for a log or an error: its first line, else its type's name."""
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0]


class SourceUnavailable(Exception):
    """The collector's source is not on this machine (or not now); the message says which and why."""


class SchemaError(ValueError):
    """A database or cluster name that cannot be used as a ClickHouse identifier."""


__all__ = ["SchemaError", "SourceUnavailable", "StoreError", "StoreLockedError", "first_line"]
