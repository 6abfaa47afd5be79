"""Parts the engine committed short are undone while the parts they were made from are still on disk.

When the disk under an embedded store fills while a merge is writing, the engine (chdb 4.4, ClickHouse 26.9) can
lose the write errors and commit the merged part anyway: measured on tmpfs and on ext4, a six-part merge into a
filesystem filled by another process committed ``all_1_6_1`` with every file empty but one ``.bin`` cut short
(``tests/test_part_guard.py`` makes it). Its rows are counted but cannot be read, and the engine detaches it as
``broken-on-start`` when the table is next loaded. Whether anything is lost depends on the parts it merged: the
engine's loader puts them back when they are still on disk. chdb removes them at once (its ``old_parts_lifetime``
is 0), so before this guard their rows were gone, and the spool's kept records, a bounded window of the newest
writes, could not cover a merge of older parts.

So, on an embedded store:

* The parts a merge replaced stay on disk for ``SOURCES_KEPT_S`` (``old_parts_lifetime``, set with the store's
  durable settings in ``schema.DURABLE_SETTINGS``).
* ``PartGuard.check`` runs every ``CHECK_EVERY_S``, and a writer of the spool's records runs it after each insert,
  before it retires the records (``exporters.durable``). Each part that became active since the last check is
  compared with what the engine says it wrote (``bytes_on_disk``: the files, projections included, must hold at
  least that many bytes, and the part's ``checksums.txt``, ``columns.txt`` and ``count.txt`` may not be empty). A
  part that fails is checked by the engine itself (``CHECK TABLE ... PART``, which reads it); when the engine
  agrees it is broken, the table is detached and attached again, and its loader detaches the part as
  ``broken-on-start`` and makes the parts it merged active again. ``StoreHealth`` then names the part; a merge's is
  covered by active parts (nothing lost); an insert's goes to ``exporters.restore``, which puts its rows back from
  the records still in the spool (``otel_traces``) or makes them again from the spans (the tables the views fill).
  Until that has worked (a disk still full refuses it too), the writer keeps its records and the guard tries again.
* While free space is below the agent's reserve, no merge runs (``SYSTEM STOP MERGES``): no merge starts into a
  disk that is filling, and those running are cancelled. They start again when space is back.

The guarantee rests on the check running within ``SOURCES_KEPT_S`` of a merge, for which a check every second leaves
a wide margin, on an insert's records staying in the spool until its parts were checked, and, across a stop or a
crash, on the engine's loader, which finds a short part at the next start while its sources (the merged parts, the
records) are still on disk. Reading every new part instead of comparing sizes would cost what the merges cost
again; the sizes cost a ``stat`` a file.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path

from stagetrace.errors import first_line

logger = logging.getLogger("stagetrace.agent")

CHECK_EVERY_S = 1.0
# old_parts_lifetime of an embedded store's tables: how long a short part can be undone after its merge. The cost:
# the parts merged in the last two minutes stay on disk (the merges' output again, at most)
SOURCES_KEPT_S = 120

_ACTIVE_PARTS_SQL = """
SELECT table, name, path, bytes_on_disk, rows, min_time, max_time FROM system.parts
WHERE database = {db:String} AND active"""
_CHECK_PART_SQL = "CHECK TABLE {db:Identifier}.{table:Identifier} PART {part:String}"
_CHECK_SETTINGS = {"check_query_single_value_result": 0}
_DETACH_SQL = "DETACH TABLE {db:Identifier}.{table:Identifier}"
_ATTACH_SQL = "ATTACH TABLE {db:Identifier}.{table:Identifier}"
_STOP_MERGES_SQL = "SYSTEM STOP MERGES"
_START_MERGES_SQL = "SYSTEM START MERGES"


@dataclass(frozen=True)
class ShortPart:
    table: str
    name: str
    rows: int
    expected: int  # bytes the engine says the part's files hold
    found: int  # bytes they hold
    first: datetime | None = None  # its time range, from the engine's memory of it (whole seconds)
    last: datetime | None = None


# files every part has, written last, never empty in a healthy part (an empty column's .bin is: sparse serialization)
PART_FILES = ("checksums.txt", "columns.txt", "count.txt")


def written_short(path: str | os.PathLike, expected: int) -> int | None:
    """The bytes the files of a part's directory hold (its projections' included) when that is fewer than
    ``expected`` or one of ``PART_FILES`` is empty; None when the part holds what it should (or is gone: a merge
    replaced it)."""
    found = 0
    try:
        for folder, _, files in os.walk(path):
            for name in files:
                found += os.stat(os.path.join(folder, name)).st_size
        empty = any(os.stat(os.path.join(path, name)).st_size == 0 for name in PART_FILES)
    except OSError:
        return None
    return found if (empty or found < expected) else None


def _utc(value, slack_s: int = 0) -> datetime | None:
    """A part's min or max time as the engine keeps it (whole seconds, naive UTC; 1970 for none), as a UTC time;
    ``slack_s`` added, for a max that was rounded down."""
    if not isinstance(value, datetime) or value.year <= 1970:
        return None
    return value.replace(tzinfo=timezone.utc) + timedelta(seconds=slack_s)


class PartGuard:
    """Undoes short parts of ``store``'s tables (an embedded store) and holds merges while ``headroom`` is below
    its reserve (see the module docstring). ``after_reload`` is called once tables were loaded again (the agent's
    ``StoreHealth.check``, which names what the engine detached)."""

    def __init__(self, store, headroom=None, after_reload=None, settled=None):
        self.store = store
        self.headroom = headroom
        self.after_reload = after_reload  # called with the short parts, once their tables were loaded again
        # whether the rows of every part found short are back (the restorer's answer); while not, each round calls
        # after_reload again (a restore into a disk still full fails) and writers keep their records
        self.settled = settled or (lambda: True)
        # held by a writer from the insert of a group of records until they are retired (exporters.durable): a short
        # part is found, and its rows put back from those records, before they go
        self.lock = threading.RLock()
        self._seen: set[tuple[str, str]] = set()
        self._started = False
        self.merges_stopped = False
        self.undone: list[ShortPart] = []  # every short part found, in order
        self._failed = False

    def _active(self):
        rows = self.store.client.query(_ACTIVE_PARTS_SQL, parameters={"db": self.store.database}).result_rows
        return [
            (table, name, Path(path), int(size), int(count), _utc(low), _utc(high, 1))
            for table, name, path, size, count, low, high in rows
        ]

    def check(self) -> list[ShortPart]:
        """One round: merges held or released by free space, new parts compared with what they should hold, and
        the tables of the broken ones loaded again. The short parts found."""
        with self.lock:
            short = self._check()
            if not short and not self.settled() and self.after_reload is not None:
                self.after_reload([])  # the rows of a part found before are not back yet: try again
            return short

    def verify(self) -> bool:
        """A round now, for a writer about to retire the records of an insert: whether they may go (no part is
        short, or the rows of those that were are back)."""
        with self.lock:
            self.check()
            return self.settled()

    def _check(self) -> list[ShortPart]:
        try:
            self._merges()
            active = self._active()
        except Exception as exc:  # the store is busy or down: the next round asks again
            if not self._failed:
                logger.warning("store: cannot check new parts now: %s", first_line(exc))
            self._failed = True
            return []
        self._failed = False
        if not self._started:  # the engine's loader checked what was there at start
            self._started = True
            self._seen = {(table, name) for table, name, *_ in active}
            return []
        short = []
        for table, name, path, size, rows, first, last in active:
            if (table, name) in self._seen:
                continue
            self._seen.add((table, name))
            found = written_short(path, size)
            if found is not None and self._broken(table, name):
                short.append(ShortPart(table, name, rows, size, found, first, last))
        self._seen &= {(table, name) for table, name, *_ in active}  # forget the parts merged away
        if short:
            self._reload(short)
        return short

    def _broken(self, table: str, name: str) -> bool:
        """Whether the engine, reading the part, finds it broken (a part a merge replaced meanwhile is not)."""
        try:
            answer = self.store.client.query(
                _CHECK_PART_SQL,
                settings=_CHECK_SETTINGS,
                parameters={"db": self.store.database, "table": table, "part": name},
            ).result_rows
        except Exception as exc:
            return "NO_SUCH_DATA_PART" not in str(exc) and "No such data part" not in str(exc)
        return any(not int(row[1]) for row in answer)

    def _reload(self, short: list[ShortPart]) -> None:
        for table in dict.fromkeys(part.table for part in short):
            names = ", ".join(
                f"{p.name} ({p.found:,} of {p.expected:,} bytes, {p.rows:,} rows)" for p in short if p.table == table
            )
            logger.error(
                "store: table %s: the engine committed part %s short (a write it lost, the disk full?): "
                "loading the table again to put back the parts it was made from",
                table,
                names,
            )
            names_sql = {"db": self.store.database, "table": table}
            try:
                self.store.client.command(_DETACH_SQL, parameters=names_sql)
            except Exception as exc:
                logger.error(
                    "store: table %s: cannot detach it to load it again: %s; the next start loads it",
                    table,
                    first_line(exc),
                )
                continue
            for attempt in range(30):  # a table detached must come back: retried while the store refuses
                try:
                    self.store.client.command(_ATTACH_SQL, parameters=names_sql)
                    break
                except Exception as exc:
                    if attempt == 29:
                        logger.error("store: table %s: cannot attach it again: %s", table, first_line(exc))
                        raise
                    time.sleep(1.0)
        self.undone += short
        if self.after_reload is not None:
            self.after_reload(short)

    def _merges(self) -> None:
        """Merges stopped while free space is below the reserve, started again when it is back."""
        if self.headroom is None or self.headroom.off:
            return
        room = self.headroom.room()
        if not room and not self.merges_stopped:
            self.store.client.command(_STOP_MERGES_SQL)
            self.merges_stopped = True
            logger.warning("store: merges stopped while free space is below the reserve (--min-free-space)")
        elif room and self.merges_stopped:
            self.store.client.command(_START_MERGES_SQL)
            self.merges_stopped = False
            logger.info("store: merges started again")

    def close(self) -> None:
        """Merges started again if this guard stopped them (an engine outlives its guard in tests)."""
        if self.merges_stopped:
            try:
                self.store.client.command(_START_MERGES_SQL)
            except Exception:
                pass
            self.merges_stopped = False


__all__ = ["CHECK_EVERY_S", "PartGuard", "SOURCES_KEPT_S", "ShortPart", "written_short"]
