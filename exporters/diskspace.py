"""Headroom before the edge: the agent refuses new writes while the disk under its store or spool runs low.

A disk that fills to the last byte hurts more than the writes that fail: the engine's background merges need
room to write the part they make before they drop the parts they merged, and a spool that cannot write a
request cannot acknowledge it. So the agent keeps a **reserve** (``--min-free-space``, env
``STAGETRACE_MIN_FREE_SPACE``): while the free space on the store's or the spool's filesystem is below it, OTLP
requests are refused exactly as when the spool is full (HTTP 503 with ``Retry-After``, gRPC ``UNAVAILABLE`` with
RetryInfo: the sender keeps them and retries), the agent's own samples wait in memory instead of the spool, and
the engine refuses inserts below half the reserve (``min_free_disk_bytes_to_perform_insert``, ClickHouse's own
guard: NOT_ENOUGH_SPACE, which the writer treats as a store that is unavailable), so the last half is left to
merges. What is already spooled keeps flowing into the store meanwhile, which frees the spool's space.

The reserve is a size (``512MiB``, ``2GiB``) or a percentage of the filesystem (``5%``); ``0`` turns the check
off. The default, ``1GiB`` but at most 5% of the filesystem, suits a laptop and a GPU node alike: 1 GiB is four
times the spool's default bound and more than the merges of a node's recent parts write, and a negligible share
of a laptop's or a node's disk; the 5% cap keeps a small dedicated volume (a 4 GiB partition, a test's tmpfs)
usable instead of refusing from the start. Free space is what ``statvfs`` gives an unprivileged process
(``f_bavail``: the blocks ext4 keeps for root are not counted), measured at most every ``CHECK_EVERY_S`` and
never per span: a request costs a clock read.

The state is logged when it changes, never per request: one line when writes start being refused, one when
space is back (how long it took and how many requests were refused meanwhile).
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from stagetrace.environment_variables import STAGETRACE_MIN_FREE_SPACE
from stagetrace.settings import parse_size

logger = logging.getLogger("stagetrace.agent")

DEFAULT_BYTES = 1 << 30
DEFAULT_FRACTION_CAP = 0.05
CHECK_EVERY_S = 0.25  # how stale a measurement may be: at 100 MB/s of writes, 25 MB of a reserve
ENGINE_SHARE = 0.5  # the engine refuses inserts below this share of the reserve: the rest is left to merges

_PERCENT = re.compile(r"\s*(\d+(?:\.\d*)?)\s*%\s*")


@dataclass(frozen=True)
class Reserve:
    """Space to keep free on a filesystem: ``size`` bytes, or ``fraction`` of it; both set: the smaller (the
    default). Neither: no reserve."""

    size: int = 0
    fraction: float = 0.0

    def of(self, total: int) -> int:
        """The reserve in bytes on a filesystem of ``total`` bytes."""
        by_fraction = int(total * self.fraction)
        if self.size and self.fraction:
            return min(self.size, by_fraction)
        return self.size or by_fraction

    @property
    def off(self) -> bool:
        return not (self.size or self.fraction)

    def __str__(self) -> str:
        if self.off:
            return "0 (off)"
        parts = [_exact(self.size)] if self.size else []
        parts += [f"{self.fraction * 100:g}%"] if self.fraction else []
        return " but at most ".join(parts)


DEFAULT = Reserve(DEFAULT_BYTES, DEFAULT_FRACTION_CAP)


def parse_reserve(text: str) -> Reserve:
    """``512MiB``, ``2GiB``, ``1000000``, ``5%``, ``0`` (off) -> Reserve; ValueError says how to write it."""
    percent = _PERCENT.fullmatch(text)
    if percent:
        value = float(percent[1])
        if value >= 100:
            raise ValueError(f"{text!r} would keep the whole filesystem free: write a percentage below 100, e.g. 5%")
        return Reserve(fraction=value / 100)
    try:
        return Reserve(size=parse_size(text, zero=True))
    except ValueError:
        raise ValueError(f"{text!r} is not a size or a percentage: write e.g. 512MiB, 2GiB, 5% or 0 for none") from None


def reserve_setting(text: str | None = None) -> Reserve:
    """The reserve from ``text`` (the flag), else ``STAGETRACE_MIN_FREE_SPACE``, else the default; ValueError
    naming the flag and the variable for text that is neither a size nor a percentage."""
    chosen = text if text is not None else os.environ.get(STAGETRACE_MIN_FREE_SPACE)
    if chosen is None or not chosen.strip():
        return DEFAULT
    try:
        return parse_reserve(chosen)
    except ValueError as exc:
        raise ValueError(f"--min-free-space ({STAGETRACE_MIN_FREE_SPACE}): {exc}") from None


def mib(n: int) -> str:
    """A size for a log line: MiB below 10 GiB, else GiB, with a decimal."""
    return f"{n / (1 << 20):.1f} MiB" if n < 10 << 30 else f"{n / (1 << 30):.1f} GiB"


def _exact(n: int) -> str:
    """A size as written on the command line: ``1GiB``, ``512MiB``, else bytes."""
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n % size == 0:
            return f"{n // size}{unit}"
    return f"{n} bytes"


def _existing(path: Path) -> Path:
    """``path``, or its nearest ancestor that exists (a spool directory is made at its first write)."""
    path = Path(path).absolute()
    while not path.exists() and path.parent != path:
        path = path.parent
    return path


class Spell:
    """A condition that starts and ends (a disk full, a spool refusing): one log line when it starts, and one
    (the caller's, from ``end``) when it ends, saying how long it lasted and how many requests it refused;
    never a line per request."""

    def __init__(self, log: logging.Logger = logger):
        self.log = log
        self.since: float | None = None
        self.refused = 0

    @property
    def on(self) -> bool:
        return self.since is not None

    def begin(self, level: int, message: str, *args) -> None:
        """Enter the condition (logged once: later calls while it lasts say nothing)."""
        if self.since is None:
            self.since, self.refused = time.monotonic(), 0
            self.log.log(level, message, *args)

    def end(self) -> tuple[float, int] | None:
        """Leave it: how long it lasted (s) and how many requests it refused, for the caller's one line; None
        when it was not on."""
        if self.since is None:
            return None
        lasted, self.since = time.monotonic() - self.since, None
        return lasted, self.refused


class Headroom:
    """Free space on the filesystems under ``paths`` (``{"store": path, "spool": path}``; paths on one filesystem
    are checked once) against ``reserve`` (see the module docstring)."""

    def __init__(self, paths: dict[str, str | os.PathLike], reserve: Reserve = DEFAULT, every_s: float = CHECK_EVERY_S):
        self.paths = {what: Path(p) for what, p in paths.items() if p}
        self.reserve = reserve
        self.every_s = every_s
        self._lock = threading.Lock()
        self._next = 0.0  # monotonic time of the next measurement
        self._low: tuple[str, Path, int, int] | None = None  # (what, path, free, reserve) while below the reserve
        self._guard = 0  # the engine's insert guard in bytes (for the store's filesystem)
        self.spell = Spell()
        self.refused = 0  # requests refused for want of space, in all

    @property
    def off(self) -> bool:
        return self.reserve.off or not self.paths

    def admit(self) -> bool:
        """Whether a new request may be written; a refusal is counted (and the state logged when it changes)."""
        if self.off:
            return True
        with self._lock:
            self._measure()
            if self._low is None:
                return True
            self.refused += 1
            self.spell.refused += 1
            return False

    def room(self) -> bool:
        """Whether there is room above the reserve, refusing nothing (the agent's own samples, its periodic check)."""
        if self.off:
            return True
        with self._lock:
            self._measure()
            return self._low is None

    def reason(self) -> str:
        """Why requests are refused now, for the 503's message."""
        low = self._low
        if low is None:
            return "free space is below the reserve"
        what, path, free, reserve = low
        return f"the {what} disk is full: {mib(free)} free on {path}, below the reserve of {mib(reserve)}"

    def engine_guard(self) -> int:
        """``min_free_disk_bytes_to_perform_insert`` for inserts into an embedded store: half the reserve of its
        filesystem (0 when there is no reserve, or the store is not local)."""
        if self.off or "store" not in self.paths:
            return 0
        with self._lock:
            self._measure()
            return self._guard

    def _measure(self) -> None:
        now = time.monotonic()
        if now < self._next:
            return
        self._next = now + self.every_s
        filesystems: dict[int, tuple[list[str], Path]] = {}  # device -> (what lies on it, a path on it)
        for what, path in self.paths.items():
            try:
                where = _existing(path)
                device = os.stat(where).st_dev
            except OSError:
                continue
            filesystems.setdefault(device, ([], where))[0].append(what)
        low = None
        for names, where in filesystems.values():
            try:
                stats = os.statvfs(where)
            except OSError:
                continue
            total, free = stats.f_blocks * stats.f_frsize, stats.f_bavail * stats.f_frsize
            reserve = self.reserve.of(total)
            if "store" in names:
                self._guard = int(reserve * ENGINE_SHARE)
            if low is None and free < reserve:
                low = (" and ".join(names), where, free, reserve)
        if low is not None:
            self._low = low
            self.spell.begin(
                logging.ERROR,
                "%s disk full (%s free on %s, below the reserve of %s, --min-free-space): refusing writes",
                low[0],
                mib(low[2]),
                low[1],
                mib(low[3]),
            )
        elif self._low is not None:
            path = self._low[1]
            self._low = None
            try:
                stats = os.statvfs(path)
                free = mib(stats.f_bavail * stats.f_frsize)
            except OSError:
                free = "?"
            lasted, refused = self.spell.end()
            logger.warning(
                "space back after %.1f s (%s free on %s): accepting writes (refused %d requests)",
                lasted,
                free,
                path,
                refused,
            )


__all__ = ["DEFAULT", "Headroom", "Reserve", "Spell", "parse_reserve", "reserve_setting"]
