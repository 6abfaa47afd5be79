"""OpenTelemetry span exporter into ClickHouse's ``otel_traces``, with the Collector's column layout, and the
agent's metric writer into ``otel_metrics_gauge`` / ``otel_metrics_sum``::

    provider.add_span_processor(BatchSpanProcessor(ClickHouseSpanExporter(store="chdb:///var/lib/st")))

Both write through the one durable write path (``exporters.durable``). ``export`` returns ``SUCCESS`` only
once the spans are in the store or fsynced into the spool, from which they reach the store exactly once,
also through a kill and a restart (the next writer of the store replays what a dead one spooled); it
returns ``FAILURE`` when they are in neither (no spool, or the disk refused them) and after ``shutdown``.
Rows the store refuses for their values are dropped one by one and counted; the rest of their batch is
stored. One insert costs about the same up to a few thousand rows, so give the ``BatchSpanProcessor``
large batches (``stagetrace.configure`` uses 4,096). ``force_flush`` returns True when nothing waits in the
spool; ``shutdown`` tries the spool once more and closes the store if the exporter opened it.

The rows themselves, and their columns, are built in ``exporters.rows``; this module only writes them.

Settings are arguments with environment fallbacks: ``STAGETRACE_STORE``, ``STAGETRACE_SPOOL_DIR`` and
``STAGETRACE_SPOOL_MAX_BYTES`` (see ``exporters.spool``).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from stagetrace.exporters import spool
from stagetrace.exporters.durable import DurableWriter

# The rows are built in ``rows``; its names stay importable from here, where they were first.
from stagetrace.exporters.rows import (
    AGENT_SERVICE,
    COLUMNS,
    GAUGE_TABLE,
    METRIC_COLUMNS,
    METRIC_SCOPE,
    SUM_COLUMNS,
    SUM_TABLE,
    Resources,
    attribute_map,
    attribute_text,
    node_metric_rows,
    span_row,
)
from stagetrace.store import Location, Store, open_store

logger = logging.getLogger(__name__)


def _store_arg(store: str | Location | Store | None, create_schema: bool) -> tuple[Store, bool]:
    """The store to write to and whether the writer opened it (and so closes it)."""
    if isinstance(store, Store):
        if create_schema:
            store.ensure_schema()
        return store, False
    return open_store(store, create_schema=create_schema), True


class ClickHouseSpanExporter(SpanExporter):
    """Span exporter into ``otel_traces`` (see the module docstring for the contract)."""

    def __init__(
        self,
        store: str | Location | Store | None = None,
        *,
        create_schema: bool = True,
        spool_dir: str | os.PathLike | bool | None = None,
        spool_max_bytes: int | None = None,
    ):
        self._store, self._owns_store = _store_arg(store, create_schema)
        self._resources = Resources()
        self._writer = DurableWriter(self._store, "spans", spool_dir=spool_dir, spool_max_bytes=spool_max_bytes)
        self._shutdown = False
        self._refused = 0  # spans answered FAILURE: neither stored nor spooled

    @property
    def store(self) -> Store:
        return self._store

    @property
    def spool(self) -> spool.Spool | None:
        return self._writer.spool

    @property
    def dropped_spans(self) -> int:
        """Spans dropped: refused by the store for their values, or that the spool had no room for."""
        return self._writer.dropped_rows

    @property
    def refused_spans(self) -> int:
        """Spans answered ``FAILURE`` (the SDK counts them as dropped)."""
        return self._refused

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if self._shutdown:
            logger.warning("ClickHouseSpanExporter is shut down; not taking %d spans", len(spans))
            return SpanExportResult.FAILURE
        resources = self._resources
        rows = [span_row(span, resources) for span in spans]
        if self._writer.write("otel_traces", COLUMNS, rows):
            return SpanExportResult.SUCCESS
        self._refused += len(rows)
        logger.error(
            "%d spans could not be stored in %s nor spooled: not taken", len(rows), self._store.location.redacted()
        )
        return SpanExportResult.FAILURE

    def force_flush(self, timeout_millis: int = 30_000) -> bool:
        """True when every span taken is in the store (none waits in the spool)."""
        return self._writer.flush(timeout_millis / 1000)

    def shutdown(self, timeout_millis: int = 30_000) -> None:
        if self._shutdown:
            return
        self._shutdown = True
        self._writer.flush(timeout_millis / 1000)
        self._writer.close()
        if self._owns_store:
            self._store.close()


class ClickHouseMetricWriter:
    """Writes samples into ``otel_metrics_gauge`` and ``otel_metrics_sum``, one insert per table per write, or,
    with ``insert_every_s``, per table at most that often (and whenever ``insert_rows`` rows are held): an insert
    costs the engine about the same for 1,000 rows as for 10,000, so an agent sampling every second inserts
    every ten. The first write inserts at once; ``close`` inserts what is held.

    Through the durable write path: rows the store does not take go to the spool, and later samples of that
    table behind them, replayed in order when it takes inserts again. Without a spool (in-memory store, or
    ``spool_dir=False``, or free space below the agent's reserve, ``headroom``) they are held in memory and go
    first on the next ``write``; beyond ``max_held_rows`` the oldest are dropped and counted. ``close`` writes
    what it can, then closes the store if the writer opened it.
    """

    def __init__(
        self,
        store: str | Location | Store | None = None,
        *,
        host: str,
        max_held_rows: int = 100_000,
        create_schema: bool = True,
        spool_dir: str | os.PathLike | bool | None = None,
        spool_max_bytes: int | None = None,
        insert_every_s: float = 0.0,
        insert_rows: int = 10_000,
        headroom=None,
    ):
        self._store, self._owns_store = _store_arg(store, create_schema)
        self.insert_every_s = insert_every_s
        self.insert_rows = insert_rows
        self._inserted_at: float | None = None
        self._storing = True  # whether the last insert was taken
        self._writer = DurableWriter(
            self._store, "metrics", spool_dir=spool_dir, spool_max_bytes=spool_max_bytes, headroom=headroom
        )
        self.host = host
        self.max_held_rows = max_held_rows
        self._dropped = 0
        self._held: dict[str, list[tuple]] = {GAUGE_TABLE: [], SUM_TABLE: []}
        self._started_ns = time.time_ns()  # counters are cumulative from the writer's first sample

    @property
    def store(self) -> Store:
        return self._store

    @property
    def spool(self) -> spool.Spool | None:
        return self._writer.spool

    @property
    def dropped_rows(self) -> int:
        return self._dropped + self._writer.dropped_rows

    @property
    def held_rows(self) -> int:
        """Rows not in the store yet: held in memory or in the spool."""
        return sum(map(len, self._held.values())) + self._writer.spooled_rows()

    def write(self, collected, time_ns: int | None = None) -> bool:
        """Add one sample of what a node collected (families or ``Samples``, as ``rows.node_metric_rows`` takes) and insert
        everything held when an insert is due. False while the store is failing: the last insert's outcome. Between
        inserts the samples are held in memory only (a ``kill -9`` loses at most ``insert_every_s`` of them)."""
        for table, rows in node_metric_rows(collected, self.host, time_ns or time.time_ns(), self._started_ns).items():
            self._held[table].extend(rows)
        now = time.monotonic()
        due = self._inserted_at is None or now - self._inserted_at >= self.insert_every_s
        if not due and max(map(len, self._held.values())) < self.insert_rows:
            return self._storing
        self._inserted_at = now
        self._storing = self.flush()
        return self._storing

    def flush(self) -> bool:
        """Insert everything held; False when rows still wait (in memory or in the spool)."""
        for table, rows in self._held.items():
            if rows and self._writer.write(table, SUM_COLUMNS if table == SUM_TABLE else METRIC_COLUMNS, rows):
                rows.clear()
            excess = len(rows) - self.max_held_rows
            if excess > 0:
                del rows[:excess]
                self._dropped += excess
                spool.DROPPED.add("metric_samples", excess, "buffer_full")
                logger.error(
                    "dropped the %d oldest metric samples held for %s, which keeps failing",
                    excess,
                    self._store.location.redacted(),
                )
        return self._writer.flush() and not any(self._held.values())

    def close(self) -> bool:
        """Insert what is held and close the store if the writer opened it; False when samples were lost."""
        self.flush()
        lost = sum(map(len, self._held.values()))
        if lost:
            logger.error("closing: %d metric samples could not be written to %s", lost, self._store.location.redacted())
        self._writer.close()
        if self._owns_store:
            self._store.close()
        return not lost


__all__ = [
    "ClickHouseSpanExporter",
    "COLUMNS",
    "span_row",
    "attribute_map",
    "attribute_text",
    "AGENT_SERVICE",
    "METRIC_SCOPE",
    "ClickHouseMetricWriter",
    "METRIC_COLUMNS",
    "SUM_COLUMNS",
    "GAUGE_TABLE",
    "SUM_TABLE",
]
