"""Rows the store lost, put back from the spool's kept records, each once.

Two faults leave acknowledged rows that the engine's deduplication token cannot be trusted with:

* **A part the engine detaches as broken** (a data file truncated while the agent was down, a disk error, a power
  cut during a merge): its rows are no longer read. If other active parts cover its block range (a merge whose
  sources the engine put back), nothing is lost. Otherwise its rows are restored from the records the spool keeps
  after storing them (``exporters.spool``, ``kept/``): those whose time lies in the part's range and whose key
  the table no longer holds, attached as a part so that the views do not derive again what their own tables kept
  (the request index, stages and trace extents lost no part). The part's own files are not read: ClickHouse
  checks every file of a part against its checksums, and a truncated part cannot be attached (tried: ``ATTACH
  PART`` of a compact part whose ``data.bin`` lost its second half, copied into a scratch table of the same
  structure, fails with code 228, "data.bin has unexpected size: 1969 instead of 3939"), so its readable granules
  would have to be decoded by hand, for rows the kept records restore whole.
* **A group of records sealed by an earlier process**: it may be stored already, and the engine's memory of its
  token lost (its deduplication log is not fsynced with the part: a filesystem whose journal aborted, as when the
  kernel remounts it read-only on an error, stored such a group twice, measured). Only the rows the table lacks
  are inserted (``missing``).

Both identify a row by its key (``KEYS``): ``otel_traces`` by trace and span ID, which a sender never reuses. A
table without a key is left to the token alone, and its broken parts are reported, not restored.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path

from stagetrace.errors import first_line
from stagetrace.exporters import spool
from stagetrace.exporters.inserts import insert_rows
from stagetrace.exporters.records import decoder
from stagetrace.schema import DURABLE_SETTINGS, read_sql
from stagetrace.store import Store

logger = logging.getLogger("stagetrace.agent")

# table -> (its time column, the columns that identify a row)
KEYS = {"otel_traces": ("Timestamp", ("TraceId", "SpanId"))}
# table -> the kind of kept record whose rows go into it (``exporters.records``)
SOURCES = {"otel_traces": "otlp_traces"}
# tables the views fill from otel_traces -> (their time column, the columns that identify a row); None: a table
# whose rows a second insert leaves as they are (the trace index keeps each trace's min and max)
DERIVED = {
    "stagetrace_requests": ("Start", ("TraceId", "SpanId")),
    "stagetrace_stages": ("Start", ("TraceId", "SpanId")),
    "stagetrace_models": ("Start", ("TraceId", "SpanId")),
    "otel_traces_trace_id_ts": None,
}
_SPANS_IN_RANGE = """(SELECT * FROM `{db}`.`otel_traces`
 WHERE Timestamp BETWEEN fromUnixTimestamp64Nano({{first:Int64}}) AND fromUnixTimestamp64Nano({{last:Int64}}))"""
_ALL_SPANS = "`{db}`.`otel_traces`"
_REBUILD_SQL = """INSERT INTO `{db}`.`{table}` SELECT * FROM ({select}) AS derived
WHERE ({key_a}, {key_b}) NOT IN (SELECT {key_a}, {key_b} FROM `{db}`.`{table}` {within})"""
_WITHIN = (
    """WHERE {time} BETWEEN fromUnixTimestamp64Nano({{first:Int64}}) AND fromUnixTimestamp64Nano({{last:Int64}})"""
)
_COUNT_SQL = "SELECT count() FROM {db:Identifier}.{table:Identifier}"
CHECK_ROWS = 8192  # keys asked about in one query
# under kept/: the parts restored already, one "<table>/<part>" a line, followed where rows were lost by how many and
# their time range in ns ("<table>/<part> <lost> <first> <last>"): the loss stays on /metrics across restarts
RESTORED = "restored"

_PRESENT_SQL = """
SELECT {key_a:Identifier}, {key_b:Identifier} FROM {db:Identifier}.{table:Identifier}
WHERE {time:Identifier} BETWEEN fromUnixTimestamp64Nano({first:Int64}) AND fromUnixTimestamp64Nano({last:Int64})
  AND ({key_a:Identifier}, {key_b:Identifier}) IN {keys:Array(Tuple(String, String))}"""
_ACTIVE_BLOCKS_SQL = """
SELECT partition_id, min_block_number, max_block_number FROM system.parts
WHERE database = {db:String} AND table = {table:String} AND active"""
_DETACHED_BLOCKS_SQL = """
SELECT name, partition_id, min_block_number, max_block_number FROM system.detached_parts
WHERE database = {db:String} AND table = {table:String}"""

# the scratch table a restore fills: the table's columns, indices and keys, as a plain MergeTree (a replicated
# table's copy would share its replication path), so that its partitions can be attached to the table
SCRATCH_PREFIX = "_stagetrace_restore_"
_LAYOUT_SQL = """
SELECT primary_key, sorting_key, partition_key FROM system.tables WHERE database = {db:String} AND name = {table:String}"""
# names written in where the parser takes no parameter (after AS and FROM): the store's and this module's own
_SCRATCH_SQL = """
CREATE TABLE `{db}`.`{scratch}` AS `{db}`.`{table}`
ENGINE = MergeTree PARTITION BY {partition} PRIMARY KEY ({primary}) ORDER BY ({sorting})
SETTINGS {durable}"""
_DROP_SCRATCH_SQL = "DROP TABLE IF EXISTS {db:Identifier}.{scratch:Identifier}"
_SCRATCH_PARTITIONS_SQL = """
SELECT DISTINCT partition_id FROM system.parts WHERE database = {db:String} AND table = {scratch:String} AND active"""
_ATTACH_SQL = """
ALTER TABLE `{db}`.`{table}` ATTACH PARTITION ID {{partition:String}} FROM `{db}`.`{scratch}`"""


_EPOCH = datetime(1970, 1, 1, tzinfo=timezone.utc)


def _ns(value) -> int:
    if isinstance(value, datetime):  # in integers: a float of the seconds rounds the last digits either way
        return (value.astimezone(timezone.utc) - _EPOCH) // timedelta(microseconds=1) * 1000
    return int(value)


def missing(store: Store, table: str, columns, rows: list) -> list:
    """The rows of ``rows`` whose key ``table`` does not hold (and each key once); all of them for a table
    without a key. Raises what the store raises: the caller retries."""
    if table not in KEYS or not rows:
        return rows
    time_column, (key_a, key_b) = KEYS[table]
    at, ia, ib = (list(columns).index(c) for c in (time_column, key_a, key_b))
    fresh, seen = [], set()
    for start in range(0, len(rows), CHECK_ROWS):
        chunk = rows[start : start + CHECK_ROWS]
        times = [_ns(row[at]) for row in chunk]
        keys = [(row[ia], row[ib]) for row in chunk]
        present = set(
            store.client.query(
                _PRESENT_SQL,
                parameters={
                    "db": store.database,
                    "table": table,
                    "time": time_column,
                    "key_a": key_a,
                    "key_b": key_b,
                    "first": min(times),
                    "last": max(times),
                    "keys": keys,
                },
            ).result_rows
        )
        for row, key in zip(chunk, keys):
            if key not in present and key not in seen:
                seen.add(key)
                fresh.append(row)
    return fresh


@dataclass
class Outcome:
    table: str
    parts: list[str]
    rows: int | None  # what the parts held, when every count is readable
    restored: int
    covered: list[str]  # parts whose blocks active parts cover: nothing to restore
    kept_since: datetime | None  # the oldest kept record
    first: datetime | None = None  # the lost parts' time range, where their min-max index reads
    last: datetime | None = None

    rebuilt: bool = False  # a table the views fill: its rows made again from otel_traces

    @property
    def lost(self) -> int:
        """Rows not put back, at least: a part whose row count is unreadable counts one (something is lost)."""
        if not self.parts or self.rebuilt:
            return 0
        if self.rows is None:
            return len(self.parts)
        return max(0, self.rows - self.restored)

    def when(self) -> str:
        if self.first is None or self.last is None:
            return "time range unknown"
        return f"{self.first:%Y-%m-%d %H:%M:%S} to {self.last:%Y-%m-%d %H:%M:%S} UTC"

    def line(self) -> str:
        where = f"store: table {self.table}"
        if not self.parts:
            which = f"parts {', '.join(self.covered)} are" if len(self.covered) > 1 else f"part {self.covered[0]} is"
            return (
                f"{where}: {which} covered by active parts (a merge the engine undid): their rows are read from "
                "them, nothing to restore"
            )
        names = ", ".join(self.parts)
        if self.rebuilt:
            return (
                f"{where}: rebuilt {self.restored:,} rows of part {names} ({self.when()}) from otel_traces, as its "
                "views derive them"
            )
        if self.table not in KEYS:
            count = f"{self.rows:,} rows" if self.rows is not None else "an unknown number of rows"
            return (
                f"{where}: lost {count} ({self.when()}) of part {names}: its rows are not restored, only those of "
                f"{', '.join(KEYS)} are (by their keys)"
            )
        if self.rows is not None and self.restored >= self.rows:
            return f"{where}: restored all {self.restored:,} rows of part {names} from the spool's kept records"
        since = (
            f"the kept records begin at {self.kept_since:%Y-%m-%d %H:%M:%S} UTC"
            if self.kept_since
            else "the spool keeps no records"
        )
        lost = (
            f"lost {self.rows - self.restored:,} of its {self.rows:,} rows ({self.when()})"
            if self.rows is not None
            else f"lost an unknown number of rows ({self.when()}): the part's row count is unreadable"
        )
        return (
            f"{where}: restored {self.restored:,} rows of part {names} from the spool's kept records; {lost}: "
            f"{since} (STAGETRACE_SPOOL_KEEP_BYTES), and rows not received over OTLP are not kept"
        )


def _names(parts) -> list[str]:
    """The parts' names as the engine made them, without the reason it detached them for."""
    return [p.name.removeprefix(p.reason + "_") for p in parts]


class Restorer:
    """Restores the rows of broken parts of ``store``'s tables from the records kept under ``kept_base`` (the
    receivers' spool, ``<spool>/spans``)."""

    def __init__(self, store: Store, kept_base: Path | None):
        self.store = store
        self.kept_base = Path(kept_base) if kept_base is not None else None
        self._done: set[str] = set()
        self.waiting: dict[str, list] = {}  # table -> broken parts whose restore failed (a disk still full), retried
        self.lost: dict[str, tuple[int, int | None, int | None]] = {}  # "<table>/<part>" -> rows, first, last (ns)
        self._load_done()

    def _load_done(self) -> None:
        try:
            lines = (self.kept_base / "kept" / RESTORED).read_text().splitlines() if self.kept_base else []
        except OSError:
            lines = []
        for line in lines:
            self._read(line)

    def _read(self, line: str) -> None:
        """One line of the ``restored`` list: a part done, and the rows lost with it where any were."""
        name, *tally = line.split()
        self._done.add(name)
        if len(tally) == 3:
            rows, first, last = tally
            self.lost[name] = (int(rows), None if first == "-" else int(first), None if last == "-" else int(last))

    def __call__(self, parts) -> list[Outcome]:
        """Restore the rows of these newly found broken parts (``store_health.BrokenPart``), a line per table said."""
        outcomes = []
        by_table: dict[str, list] = {}
        for part in [*parts, *(p for waiting in self.waiting.values() for p in waiting)]:
            if f"{part.table}/{part.name}" not in self._done and part not in by_table.get(part.table, []):
                by_table.setdefault(part.table, []).append(part)
        for table, broken in sorted(by_table.items()):
            try:
                outcome = self._restore(table, broken)
            except Exception as exc:  # the store refused (the disk still full): tried again at the next check
                if table not in self.waiting:
                    logger.error(
                        "store: table %s: cannot restore the rows of part %s now, will retry: %s",
                        table,
                        ", ".join(p.name for p in broken),
                        first_line(exc),
                    )
                self.waiting[table] = broken
                continue
            self.waiting.pop(table, None)
            # remembered whatever came of it: block numbers above the active parts' are reused by later inserts,
            # so whether a part is covered is only known when it is first found (at start, before any insert)
            names = [f"{table}/{p.name}" for p in broken]
            tally = None
            if outcome is not None and outcome.lost:  # kept for /metrics (StoreHealth), with the table's first part
                first, last = (str(_ns(t)) if t is not None else "-" for t in (outcome.first, outcome.last))
                tally = f"{outcome.lost} {first} {last}"
            self._remember(names, tally)
            if outcome is None:
                continue
            logger.log(logging.ERROR if outcome.lost else logging.INFO, "%s", outcome.line())
            outcomes.append(outcome)
        return outcomes

    def _remember(self, names: list[str], tally: str | None = None) -> None:
        lines = [f"{name} {tally}" if tally and n == 0 else name for n, name in enumerate(names)]
        for line in lines:
            self._read(line)
        if self.kept_base is None:
            return
        try:
            (self.kept_base / "kept").mkdir(parents=True, exist_ok=True, mode=0o700)
            with (self.kept_base / "kept" / RESTORED).open("a") as out:
                out.write("".join(f"{line}\n" for line in lines))
        except OSError:
            pass  # restored again at the next start: the key check stores nothing twice

    def _covered(self, table: str, broken) -> set[str]:
        db = {"db": self.store.database, "table": table}
        active: dict[str, list[tuple[int, int]]] = {}
        for partition, low, high in self.store.client.query(_ACTIVE_BLOCKS_SQL, parameters=db).result_rows:
            active.setdefault(partition, []).append((low, high))
        blocks = {
            name: (partition, low, high)
            for name, partition, low, high in self.store.client.query(_DETACHED_BLOCKS_SQL, parameters=db).result_rows
        }
        covered = set()
        for part in broken:
            if part.name not in blocks:
                continue
            partition, low, high = blocks[part.name]
            need = low
            for a, b in sorted(active.get(partition, [])):
                if a <= need <= b:
                    need = b + 1
            if need > high:
                covered.add(part.name)
        return covered

    def _put_back(self, table: str, rows: list, columns) -> None:
        """Insert ``rows`` into ``table`` without firing its materialized views: their own tables (requests, stages,
        trace extents) kept their parts, so the rows they derived are there already. The rows go into a scratch
        table of the same layout, whose partitions are then attached to ``table`` (a part copy, which fires no view)."""
        names = {"db": self.store.database, "table": table, "scratch": f"{SCRATCH_PREFIX}{table}"}
        primary, sorting, partition = self.store.client.query(_LAYOUT_SQL, parameters=names).result_rows[0]
        self.store.client.command(_DROP_SCRATCH_SQL, parameters=names)  # left by a restore a crash cut short
        self.store.client.command(
            _SCRATCH_SQL.format(
                **names, partition=partition, primary=primary, sorting=sorting, durable=DURABLE_SETTINGS
            )
        )  # its parts become the table's
        try:
            for start in range(0, len(rows), CHECK_ROWS):
                insert_rows(self.store, names["scratch"], rows[start : start + CHECK_ROWS], columns)
            for (partition_id,) in self.store.client.query(_SCRATCH_PARTITIONS_SQL, parameters=names).result_rows:
                self.store.client.command(_ATTACH_SQL.format(**names), parameters={"partition": partition_id})
        finally:
            self.store.client.command(_DROP_SCRATCH_SQL, parameters=names)

    def _restore(self, table: str, broken) -> Outcome | None:
        covered = self._covered(table, broken)
        lost = [p for p in broken if p.name not in covered]
        names, put_back = _names(lost), _names(p for p in broken if p.name in covered)
        if not lost:
            return Outcome(table, [], 0, 0, _names(broken), None)
        rows_held = None if any(p.rows is None for p in lost) else sum(p.rows for p in lost)
        ranges = [(p.first, p.last) for p in lost]
        bounded = all(first is not None and last is not None for first, last in ranges)
        first = min(f for f, _ in ranges) if bounded else None
        last = max(t for _, t in ranges) if bounded else None
        if table in DERIVED:
            rebuilt = self._rebuild(table, first, last)
            return Outcome(table, names, rows_held, rebuilt, put_back, None, first, last, rebuilt=True)
        if table not in KEYS:
            return Outcome(table, names, rows_held, 0, put_back, None, first, last)
        ranges_ns = [(_ns(first), _ns(last)) for first, last in ranges] if bounded else []
        # the records kept after they were stored, and those written ahead and not yet retired: a part the engine
        # committed short is found before its insert's records are retired (part_guard)
        kept = spool.kept_records(self.kept_base) + spool.pending_records(self.kept_base) if self.kept_base else []
        kept = [segment for segment in kept if segment.table == SOURCES[table]]
        since = None
        candidates, columns = [], None
        time_column = KEYS[table][0]
        for segment in kept:
            try:
                decoded = decoder(segment.table)(segment.path.read_bytes())
            except Exception:  # a kept record that no longer reads restores nothing: the count below says so
                continue
            if table not in decoded:
                continue
            columns, rows = decoded[table]
            at = list(columns).index(time_column)
            for row in rows:
                t = _ns(row[at])
                if since is None or t < since:
                    since = t
                if not bounded or any(first <= t <= last for first, last in ranges_ns):
                    candidates.append(row)
        restored = 0
        if candidates:
            fresh = missing(self.store, table, columns, candidates)
            self._put_back(table, fresh, columns)
            restored = len(fresh)
        kept_since = datetime.fromtimestamp(since / 1e9, timezone.utc) if since is not None else None
        return Outcome(table, names, rows_held, restored, put_back, kept_since, first, last)

    def _rebuild(self, table: str, first: datetime | None, last: datetime | None) -> int:
        """Make again from otel_traces the rows of ``table`` (a table the views fill) in the time range (all of it
        when unknown) that it no longer holds, by the views' own queries; the rows it gained."""
        from stagetrace.schema import VIEWS

        db = self.store.database
        bounded = first is not None and last is not None
        # a second's slack either side: a part's min-max index may be in whole seconds, and its times read back
        # rounded to the microsecond (a first row 0.5 µs before its part's "first" was left out); the key check
        # stores nothing twice
        params = {"first": _ns(first) - 1_000_000_000, "last": _ns(last) + 1_000_000_000} if bounded else {}
        # the spans as the views read them: a Collector's JSON attributes as Maps (stagetrace.attributes)
        spans = (_SPANS_IN_RANGE if bounded else _ALL_SPANS).format(db=db)
        source = read_sql(spans, "otel_traces", self.store.layouts())
        count = {"db": db, "table": table}
        before = int(self.store.client.command(_COUNT_SQL, parameters=count))
        for view in (v for v in VIEWS if v.target == table):
            select = view.select.format(source=source)
            if DERIVED[table] is None:  # a second insert changes nothing
                self.store.client.command(f"INSERT INTO `{db}`.`{table}` {select}", parameters=params)
                continue
            time_column, (key_a, key_b) = DERIVED[table]
            within = _WITHIN.format(time=time_column) if bounded else ""
            self.store.client.command(
                _REBUILD_SQL.format(db=db, table=table, select=select, key_a=key_a, key_b=key_b, within=within),
                parameters=params,
            )
        return int(self.store.client.command(_COUNT_SQL, parameters=count)) - before


__all__ = ["DERIVED", "KEYS", "Outcome", "Restorer", "missing"]
