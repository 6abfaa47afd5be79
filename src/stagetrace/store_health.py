"""The store says when it is hurt: parts the engine detached as broken, found at start and while running.

ClickHouse moves a part it cannot trust out of its table, into ``detached/``: at start when a file of the
part is missing, truncated or its checksum does not match (``broken-on-start_<part>``), or while running
(``broken_<part>``, and, on a replicated table, ``unexpected_``/``covered-by-broken_``). The rows of such a
part are no longer read, and nothing else says so. ``StoreHealth`` asks ``system.detached_parts`` of the store's
database at start and every ``CHECK_EVERY_S`` (a listing of directories: cheap), logs one line per part it has
not reported yet, naming the table, the part, why, and where the part's files are readable here (an embedded
store) its rows (``count.txt``) and time range (the partition key's min-max index); and exposes
``stagetrace_store_broken_parts{table}`` on the agent's ``/metrics``, every table zero included so that an
alert sees the series from the start. A part found for the first time is handed to ``restore`` (the agent's
``exporters.restore.Restorer``), which puts its rows back from the spool's kept records and says how many.
"""

from __future__ import annotations

import logging
import struct
import threading
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from stagetrace.errors import first_line
from stagetrace.metrics import GAUGE, MetricSpec, Samples

logger = logging.getLogger("stagetrace.agent")

CHECK_EVERY_S = 60.0
BROKEN_PARTS = MetricSpec(
    "stagetrace_store_broken_parts",
    GAUGE,
    "Parts of the store's tables that the engine detached as broken: their rows are not read.",
    ("table",),
)
LOST_ROWS = MetricSpec(
    "stagetrace_store_lost_rows",
    GAUGE,
    "Rows of broken parts that neither the parts they were merged from nor the spool's kept records "
    "put back, while the part is under detached/ (a part whose row count is unreadable counts one).",
    ("table",),
)
LOST_FIRST = MetricSpec(
    "stagetrace_store_lost_rows_first_timestamp_seconds",
    GAUGE,
    "The earliest time of the rows stagetrace_store_lost_rows counts (0: unknown).",
    ("table",),
)
LOST_LAST = MetricSpec(
    "stagetrace_store_lost_rows_last_timestamp_seconds",
    GAUGE,
    "The latest time of the rows stagetrace_store_lost_rows counts (0: unknown).",
    ("table",),
)

# detached parts' reasons that mean damage (the others: detached by a person, or the engine's temporary states)
_DAMAGED = "(startsWith(reason, 'broken') OR reason IN ('unexpected', 'covered-by-broken', 'noquorum'))"
_PARTS_SQL = f"""
SELECT table, name, reason, bytes_on_disk, path
FROM system.detached_parts
WHERE database = {{db:String}} AND {_DAMAGED}
ORDER BY table, name"""
_TABLES_SQL = "SELECT name FROM system.tables WHERE database = {db:String} AND engine LIKE '%MergeTree' ORDER BY name"
_TIME_COLUMNS_SQL = """
SELECT table, name, type FROM system.columns
WHERE database = {db:String} AND is_in_partition_key AND match(type, '^(DateTime|Date)')"""


@dataclass(frozen=True)
class BrokenPart:
    table: str
    name: str  # the directory's name under detached/ (the reason prefixed)
    reason: str
    bytes: int
    path: str
    rows: int | None = None  # where the part's files are readable
    first: datetime | None = None  # its time range, from the partition key's min-max index
    last: datetime | None = None

    def line(self) -> str:
        what = [f"{self.rows:,} rows" if self.rows is not None else "rows unknown"]
        if self.first is not None and self.last is not None:
            what.append(f"{self.first:%Y-%m-%d %H:%M:%S} to {self.last:%Y-%m-%d %H:%M:%S} UTC")
        what.append(f"{self.bytes:,} bytes")
        return (
            f"store: table {self.table}: the engine detached part {self.name.removeprefix(self.reason + '_')} as "
            f"{self.reason} ({', '.join(what)}): its rows are no longer read; its files are in {self.path}"
        )


def _min_max(part: Path, column: str, type_: str) -> tuple[datetime, datetime] | None:
    """The min-max index of ``column`` (of type ``type_``) in a part's directory, as UTC datetimes."""
    try:
        data = (part / f"minmax_{column}.idx").read_bytes()
    except OSError:
        return None
    if type_.startswith("DateTime64"):
        digits = type_[len("DateTime64(") :].split(",")[0].rstrip(")")
        scale = 10 ** int(digits) if digits.isdigit() else 1000
        fmt, to_seconds = "<qq", lambda v: v / scale
    elif type_.startswith("DateTime"):
        fmt, to_seconds = "<II", float
    elif type_.startswith("Date32"):
        fmt, to_seconds = "<ii", lambda v: v * 86400.0
    else:  # Date
        fmt, to_seconds = "<HH", lambda v: v * 86400.0
    if len(data) != struct.calcsize(fmt):
        return None
    low, high = struct.unpack(fmt, data)
    try:
        return (
            datetime.fromtimestamp(to_seconds(low), timezone.utc),
            datetime.fromtimestamp(to_seconds(high), timezone.utc),
        )
    except (OverflowError, OSError, ValueError):
        return None


class StoreHealth:
    """Broken parts of ``store``'s tables, checked when due (see the module docstring); ``families`` for /metrics."""

    def __init__(self, store, every_s: float = CHECK_EVERY_S, restore=None):
        self.store = store
        self.restore = restore  # called with the parts found for the first time
        self.every_s = every_s
        self._lock = threading.Lock()
        self._checking = threading.Lock()  # the agent's loop and the part guard (after a reload) both check
        self._due = 0.0
        self._reported: set[tuple[str, str]] = set()
        self._counts: dict[str, int] = {}
        self._lost: dict[str, tuple[int, list[int], list[int]]] = {}  # table -> rows, first and last times (ns)
        self._tables: list[str] = []
        self._time_columns: dict[str, tuple[str, str]] = {}
        self._known: dict[tuple[str, str], object] = {}  # (table, part) -> part_guard.ShortPart
        self.failed = False  # the last check could not ask the store

    def due(self) -> bool:
        return time.monotonic() >= self._due

    def check(self, known=()) -> list[BrokenPart]:
        """Ask the store now: the broken parts detached, each logged once (the first time it is seen). ``known``:
        what the part guard knew of parts it had the engine detach (``part_guard.ShortPart``), for those whose own
        files no longer say their rows and time range."""
        with self._checking:
            self._known.update({(p.table, p.name): p for p in known})
            return self._check()

    def _check(self) -> list[BrokenPart]:
        self._due = time.monotonic() + self.every_s
        db = {"db": self.store.database}
        try:
            client = self.store.client
            if not self._tables:
                self._tables = [name for (name,) in client.query(_TABLES_SQL, parameters=db).result_rows]
                for table, column, type_ in client.query(_TIME_COLUMNS_SQL, parameters=db).result_rows:
                    self._time_columns.setdefault(table, (column, type_))
            rows = client.query(_PARTS_SQL, parameters=db).result_rows
        except Exception as exc:  # the store is down or busy: the next check asks again
            if not self.failed:
                logger.warning("cannot check the store for broken parts: %s", first_line(exc))
            self.failed = True
            return []
        self.failed = False
        parts = [self._describe(*row) for row in rows]
        counts = dict.fromkeys(self._tables, 0)
        found = []
        for part in parts:
            counts[part.table] = counts.get(part.table, 0) + 1
            if (part.table, part.name) not in self._reported:
                self._reported.add((part.table, part.name))
                logger.error("%s", part.line())
                found.append(part)
        if self.restore is not None and (found or getattr(self.restore, "waiting", None)):
            self.restore(found)  # with the parts whose restore failed before
        tally = getattr(self.restore, "lost", {})  # the restorer's, kept on disk across restarts
        lost: dict[str, tuple[int, list[int], list[int]]] = {}  # table -> rows, first and last times (ns)
        for part in parts:  # the rows lost with parts still there to look at
            rows, first, last = tally.get(f"{part.table}/{part.name}", (0, None, None))
            if rows:
                had, firsts, lasts = lost.get(part.table, (0, [], []))
                firsts, lasts = firsts + [first] * (first is not None), lasts + [last] * (last is not None)
                lost[part.table] = (had + rows, firsts, lasts)
        with self._lock:
            self._counts, self._lost = counts, lost
        return parts

    def _describe(self, table: str, name: str, reason: str, size: int, path: str) -> BrokenPart:
        part = BrokenPart(table, name, reason or "", int(size), path)
        location = self.store.location
        if not (location.embedded and location.path):
            return part  # a server's files are not readable here
        directory = Path(path if Path(path).is_absolute() else Path(location.path) / path)
        rows = None
        try:
            rows = int((directory / "count.txt").read_text().strip())
        except (OSError, ValueError):
            pass
        span = None
        if table in self._time_columns:
            span = _min_max(directory, *self._time_columns[table])
        first, last = span if span else (None, None)
        known = self._known.get((table, name.removeprefix((reason or "") + "_")))
        if known is not None:  # the engine's own count and range, from before the part was detached
            rows = known.rows if rows is None else rows
            first, last = (known.first, known.last) if span is None else (first, last)
        return BrokenPart(table, name, reason or "", int(size), str(directory), rows, first, last)

    def families(self, host: str):
        out = Samples()
        with self._lock:
            for table, n in sorted(self._counts.items()):
                out.add_series(BROKEN_PARTS, (table,), n)
                rows, firsts, lasts = self._lost.get(table, (0, [], []))
                out.add_series(LOST_ROWS, (table,), rows)
                out.add_series(LOST_FIRST, (table,), min(firsts, default=0) / 1e9)
                out.add_series(LOST_LAST, (table,), max(lasts, default=0) / 1e9)
        return out.families(host)


__all__ = ["BROKEN_PARTS", "BrokenPart", "CHECK_EVERY_S", "LOST_ROWS", "StoreHealth"]
