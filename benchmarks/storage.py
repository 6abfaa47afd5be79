"""Storage: bytes on disk per span in ``otel_traces`` and per metric sample, after merges.

Spans: a synthetic store (``benchmarks.synthetic``: a root and five stage spans per request, digests as
32-hex strings, the conventions' attributes), then ``OPTIMIZE TABLE ... FINAL``; the figure is
``sum(bytes_on_disk) / sum(rows)`` over the table's active parts in ``system.parts`` (columns, marks,
primary key and skip indexes). The tables that materialized views fill from ``otel_traces`` (request
index, trace-ID table, stages) are shown per span too: they are what lookups and analysis cost on disk.

Metric samples: the fixture node's collectors (gpu, mps, rdma, ethtool) sampled once, written through
``ClickHouseMetricWriter`` once a second of simulated time; counters of traffic grow by a random amount
each second and gauges move by up to 1%, so the columns compress like a live node's rather than like
one constant repeated. Figure: bytes on disk of ``otel_metrics_gauge`` + ``otel_metrics_sum`` per row.
"""

from __future__ import annotations

import copy
import random
import re
import tempfile
import time
import zlib
from pathlib import Path

from stagetrace.collectors import build_node
from stagetrace.collectors.base import Options
from stagetrace.exporters.clickhouse import GAUGE_TABLE, SUM_TABLE, ClickHouseMetricWriter

from benchmarks import Figure, benchmark, synthetic
from stagetrace.store import open_store

FIXTURE = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "node"
_TRAFFIC = ("bytes", "packets", "frames", "data", "pkts", "energy", "_ops")

PARTS_SQL = """
SELECT table, sum(bytes_on_disk), sum(data_uncompressed_bytes), sum(rows)
FROM system.parts
WHERE active AND database = {db:String} AND table IN {tables:Array(String)}
GROUP BY table
"""


def _parts(store, tables: list[str], optimize: bool = True) -> dict[str, tuple[int, int, int]]:
    for table in tables if optimize else ():
        store.client.command(f"OPTIMIZE TABLE {store.database}.`{table}` FINAL")
    rows = store.client.query(PARTS_SQL, parameters={"db": store.database, "tables": tables}).result_rows
    return {table: (disk, raw, count) for table, disk, raw, count in rows}


def _view_tables(store) -> list[str]:
    """The tables materialized views fill from ``otel_traces`` (request index, trace-ID table, stages, ...).

    A view may write to a Null table that only passes rows on to views of its own (the content route);
    such a table stores nothing, so the walk goes through it to the tables that do.
    """
    rows = store.client.query(
        "SELECT name, engine, dependencies_table, create_table_query FROM system.tables WHERE database = {db:String}",
        parameters={"db": store.database},
    ).result_rows
    tables = {name: (engine, dependents) for name, engine, dependents, _ in rows}
    queries = {name: query for name, _, _, query in rows}
    stored, sources, seen = set(), ["otel_traces"], set()
    while sources:
        for view in tables.get(sources.pop(), ("", []))[1]:
            match = re.search(r"\bTO\s+[`\w]+\.`?(\w+)`?", queries.get(view, ""))
            if not match or match.group(1) in seen:
                continue
            seen.add(match.group(1))
            if tables.get(match.group(1), ("",))[0] == "Null":
                sources.append(match.group(1))
            else:
                stored.add(match.group(1))
    return sorted(stored)


def bytes_per_span(store) -> tuple[float, float]:
    """Bytes on disk per span of ``otel_traces`` alone and with the tables its views fill, in the active parts as
    they stand (no ``OPTIMIZE``: at 100M spans a final merge would take longer than the measurement it serves)."""
    parts = _parts(store, ["otel_traces", *_view_tables(store)], optimize=False)
    spans = parts["otel_traces"][2]
    return parts["otel_traces"][0] / spans, sum(disk for disk, _, _ in parts.values()) / spans


def _moving(families, second: int, rng: random.Random):
    """The snapshot as it would read ``second`` seconds later on a busy node."""
    out = []
    for family in families:
        moved = copy.copy(family)
        samples = []
        for s in family.samples:
            if family.type == "counter" and any(word in s.name for word in _TRAFFIC):
                rate = zlib.crc32(repr(sorted(s.labels.items())).encode() + s.name.encode()) % 10**6
                value = s.value + second * rate + rng.randrange(1000)
            elif family.type == "gauge" and s.value not in (0, 1):
                value = round(s.value * (1 + rng.uniform(-0.01, 0.01)), 3)
            else:  # error counters, states and info metrics stay put
                value = s.value
            samples.append(s._replace(value=value))
        moved.samples = samples
        out.append(moved)
    return out


@benchmark("storage")
def storage(quick: bool) -> list[Figure]:
    requests, seconds = (10_000, 20) if quick else (300_000, 300)
    with (
        tempfile.TemporaryDirectory(prefix="stagetrace-bench-") as directory,
        open_store(f"chdb://{directory}") as store,
    ):
        spans = synthetic.fill(store, requests, time.time_ns() - 3600 * 10**9)
        views = _view_tables(store)
        traces = _parts(store, ["otel_traces", *views])
        disk, raw, rows = traces["otel_traces"]
        if rows != spans:
            raise RuntimeError(f"otel_traces holds {rows} rows, not {spans}")

        options = Options(
            host="bench",
            sysfs=FIXTURE / "sys",
            nvml_fixture=FIXTURE / "nvml",
            mps_fixture=FIXTURE / "mps",
            ethtool_fixture=FIXTURE / "ethtool" / "statistics.json",
        )
        node = build_node("gpu,mps,rdma,ethtool", options)
        try:
            snapshot = list(node.collect())
        finally:
            node.close()
        writer = ClickHouseMetricWriter(store, host="bench", create_schema=False)
        rng = random.Random(7)
        t0 = time.time_ns() - seconds * 10**9
        for second in range(seconds):
            if not writer.write(_moving(snapshot, second, rng), t0 + second * 10**9):
                raise RuntimeError("the metric writer could not write")
        metrics = _parts(store, [GAUGE_TABLE, SUM_TABLE])
    m_disk = sum(v[0] for v in metrics.values())
    m_raw = sum(v[1] for v in metrics.values())
    m_rows = sum(v[2] for v in metrics.values())
    return [
        Figure(
            f"otel_traces bytes on disk per span, {spans:,} synthetic spans, after OPTIMIZE FINAL", disk / rows, "B"
        ),
        Figure("otel_traces uncompressed bytes per span", raw / rows, "B"),
        *(
            Figure(f"{table} (filled by a view from otel_traces) bytes on disk per span", traces[table][0] / rows, "B")
            for table in views
            if table in traces
        ),
        Figure(
            f"metric bytes on disk per sample, {m_rows:,} samples ({m_rows // seconds:,} a second for {seconds} s)",
            m_disk / m_rows,
            "B",
        ),
        Figure("metric uncompressed bytes per sample", m_raw / m_rows, "B"),
    ]
