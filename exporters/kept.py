"""Write-ahead records kept after storing, for restoring the rows of a part the engine loses.

A group of records, once stored, is not deleted but moved into ``<directory>/<kind>/kept`` (renamed ``….kept``:
nothing replays it), where the newest ``STAGETRACE_SPOOL_KEEP_BYTES`` (64 MiB, at most 2% of the filesystem; ``0``:
none) stay, the oldest deleted first. They are what restores the rows of a part the engine loses
(``exporters.restore``): a part that a disk fault or a power cut leaves broken holds rows that were acknowledged long
ago, whose records would be gone otherwise. A rename instead of an unlink: the cost is the disk.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import re
from pathlib import Path

from stagetrace.environment_variables import STAGETRACE_SPOOL_KEEP_BYTES
from stagetrace.exporters.segments import Segment
from stagetrace.settings import parse_size

logger = logging.getLogger("stagetrace.exporters.spool")  # the spool's lines, as before the split

# 64 MiB of requests as they arrived: some 300,000 spans of the benchmarks' batches, minutes of a busy node and
# hours of a quiet one; the 2% cap keeps a small volume (a test's tmpfs) from filling with it
DEFAULT_KEEP_BYTES = 64 * 1024 * 1024
KEEP_FRACTION_CAP = 0.02
KEPT = "kept"  # under the base: stored records, kept to restore a part the engine loses
_KEPT_NAME = re.compile(r"^(\d{20})\.([A-Za-z_][A-Za-z0-9_]*)\.(\d+)\.([0-9a-f]{32})\.([0-9a-f]{32})\.kept$")


def keep_bytes_setting(base: Path, keep_bytes: int | None = None) -> int:
    """How many bytes of stored records to keep under ``base`` (see the module docstring)."""
    if keep_bytes is None:
        raw = os.environ.get(STAGETRACE_SPOOL_KEEP_BYTES)
        keep_bytes = DEFAULT_KEEP_BYTES
        if raw:
            try:
                return parse_size(raw, zero=True)
            except ValueError as exc:
                logger.warning("ignoring %s: %s; using %d bytes", STAGETRACE_SPOOL_KEEP_BYTES, exc, keep_bytes)
        try:
            stats = os.statvfs(base)
            keep_bytes = min(keep_bytes, int(stats.f_blocks * stats.f_frsize * KEEP_FRACTION_CAP))
        except OSError:
            pass
    return max(0, int(keep_bytes))


def kept_records(base: Path) -> list[Segment]:
    """The stored records kept under ``base`` (a spool's ``<directory>/<kind>``), oldest first."""
    try:
        entries = list(os.scandir(Path(base) / KEPT))
    except OSError:
        return []
    kept = []
    for entry in entries:
        match = _KEPT_NAME.match(entry.name)
        if match is not None:
            with contextlib.suppress(OSError):
                kept.append(
                    Segment(Path(entry.path), match[2], int(match[3]), entry.stat().st_size, match[4], match[5])
                )
    return sorted(kept, key=lambda s: s.path.name)


class KeptRecords:
    """The kept records under ``base``, bounded by ``keep_bytes`` (0: none kept)."""

    def __init__(self, base: Path, keep_bytes: int = 0):
        self.base = Path(base)
        self.keep_bytes = keep_bytes
        self._kept: collections.deque[tuple[Path, int]] = collections.deque()
        self._bytes = 0
        for kept in kept_records(self.base):  # those beyond the bound (a lower setting) go at the next trim
            self._kept.append((kept.path, kept.size))
            self._bytes += kept.size

    def keep(self, segment: Segment) -> None:
        """Move a stored record here (OSError when the disk refuses); one already gone is let be."""
        kept = self.base / KEPT / f"{segment.path.name[:-4]}.kept"
        try:
            os.rename(segment.path, kept)
        except FileNotFoundError:
            if segment.path.exists():  # the first of them: make the folder
                kept.parent.mkdir(exist_ok=True, mode=0o700)
                os.rename(segment.path, kept)
            else:
                return
        self._kept.append((kept, segment.size))
        self._bytes += segment.size

    def trim(self) -> None:
        """Delete the oldest kept records beyond ``keep_bytes``; one the disk refuses to delete waits for the next."""
        while self._kept and self._bytes > self.keep_bytes:
            path, size = self._kept.popleft()
            self._bytes -= size
            with contextlib.suppress(FileNotFoundError):
                try:
                    path.unlink()
                except OSError:
                    self._kept.appendleft((path, size))
                    self._bytes += size
                    return


__all__ = ["DEFAULT_KEEP_BYTES", "KEPT", "KeptRecords", "keep_bytes_setting", "kept_records"]
