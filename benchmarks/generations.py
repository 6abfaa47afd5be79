"""The Collector's two generations of span tables, as stagetrace creates them, side by side in one store.

``current``: what ``stagetrace schema`` creates now (the Collector's current ``otel_traces``: ``Timestamp`` in the
sort key, ``Duration`` in ``T64``, the span-name token index; the trace-ID table on ``AggregatingMergeTree``,
partitioned by week). ``previous``: the Collector's previous layout (``tests/fixtures/collector/previous.sql``,
which stagetrace created until schema 10), with stagetrace's index granularity, so that only the layout differs.
Both databases live in one embedded store and are filled in alternating chunks by the same in-engine generator
(``benchmarks.synthetic``: a root and five stage spans per request); then lookups by request ID and by trace ID,
each a fresh ID, alternate between the two, and bytes on disk per span are read after ``OPTIMIZE … FINAL``.
"""

from __future__ import annotations

import random
import re
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks import Figure, benchmark, synthetic
from benchmarks.lookup import _ms, _settle
from benchmarks.storage import PARTS_SQL
from stagetrace import lookup, schema
from stagetrace.store import open_store

PREVIOUS_DDL = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "collector" / "previous.sql"
SPAN_TABLES = ["otel_traces", "otel_traces_trace_id_ts"]


def _previous_statements(database: str) -> list[str]:
    text = PREVIOUS_DDL.read_text().replace("`stagetrace`", f"`{database}`")
    chunks = (chunk.strip() for chunk in re.split(r"^;;$", text, flags=re.M))
    statements = ["\n".join(line for line in chunk.splitlines() if not line.startswith("--")) for chunk in chunks]
    # the layout alone differs: stagetrace's lookup granularity on both sides (the Collector's own is 8192)
    granularity = f"index_granularity = {schema._LOOKUP_GRANULARITY}"
    return [
        s.replace("index_granularity = 8192", granularity) if "`otel_traces` (" in s else s for s in statements if s
    ]


@benchmark("generations")
def generations_benchmark(quick: bool) -> list[Figure]:
    requests, chunks, lookups = (20_000, 2, 20) if quick else (600_000, 6, 300)
    rng = random.Random(31)
    t0 = time.time_ns() - 7 * 86400 * 10**9  # a week back: the trace-ID table's weekly partitions take part
    with tempfile.TemporaryDirectory(prefix="stagetrace-bench-") as directory:
        with open_store(f"chdb://{directory}?database=previous", create_schema=False) as bare:
            bare.client.command("CREATE DATABASE previous")
            for statement in _previous_statements("previous"):
                bare.client.command(statement)
        stores = {name: open_store(f"chdb://{directory}?database={name}") for name in ("current", "previous")}
        try:
            filled = dict.fromkeys(stores, 0.0)
            per_chunk = requests // chunks
            for chunk in range(chunks):  # alternating, so that neither side has the quieter half of the run
                for name in ("current", "previous") if chunk % 2 == 0 else ("previous", "current"):
                    started = time.perf_counter()
                    synthetic.fill(
                        stores[name],
                        per_chunk,
                        t0 + chunk * 3600 * 10**9 * 24,
                        seconds=86400.0,
                        offset=chunk * per_chunk,
                    )
                    filled[name] += time.perf_counter() - started
            for store in stores.values():
                _settle(store)
            fresh = iter(rng.sample(range(per_chunk * chunks), 2 * lookups + 2))
            by_request = {name: [] for name in stores}
            by_trace = {name: [] for name in stores}
            for name, store in stores.items():  # warm: the first query opens the parts
                lookup.by_request_id(store, f"req-{next(fresh)}")
            for i in range(lookups):
                request_id = f"req-{next(fresh)}"
                order = ("current", "previous") if i % 2 == 0 else ("previous", "current")
                for name in order:
                    ms, trace = _ms(lookup.by_request_id, stores[name], request_id)
                    if len(trace.spans) != 6:
                        raise RuntimeError(f"{name}: lookup found {len(trace.spans)} spans, not 6")
                    by_request[name].append(ms)
                    ms, again = _ms(lookup.by_trace_id, stores[name], trace.trace_id)
                    if again.request_id != request_id:
                        raise RuntimeError(f"{name}: the trace ID lookup found another request")
                    by_trace[name].append(ms)
            size = {}
            for name, store in stores.items():
                for table in SPAN_TABLES:
                    store.client.command(f"OPTIMIZE TABLE {store.database}.`{table}` FINAL")
                rows = store.client.query(
                    PARTS_SQL, parameters={"db": store.database, "tables": SPAN_TABLES}
                ).result_rows
                size[name] = sum(disk for _, disk, _, _ in rows) / (per_chunk * chunks * 6)
        finally:
            for store in stores.values():
                store.close()
    spans = per_chunk * chunks * 6
    previous = "the Collector's previous layout, same granularity"
    return [
        Figure(
            f"generate {spans:,} spans in-engine (insert, views, trace-ID table), current layout",
            filled["current"],
            "s",
            previous,
            filled["previous"],
        ),
        Figure(
            "bytes on disk per span, otel_traces + trace-ID table, after merges, current layout",
            size["current"],
            "B",
            previous,
            size["previous"],
        ),
        Figure(
            f"lookup.by_request_id, median of {lookups} fresh IDs, current layout",
            statistics.median(by_request["current"]),
            "ms",
            previous,
            statistics.median(by_request["previous"]),
        ),
        Figure(
            f"lookup.by_trace_id, median of {lookups}, current layout",
            statistics.median(by_trace["current"]),
            "ms",
            previous,
            statistics.median(by_trace["previous"]),
        ),
    ]
