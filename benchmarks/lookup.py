"""Trace lookup by request ID in a store of 10,000,000 spans, against a scan of the span attributes.

The store is synthetic (``benchmarks.synthetic``: 1,666,667 requests of six spans, generated in the
engine). Every timed lookup asks for a request ID not asked for before: ClickHouse's query condition
cache remembers which granules a filter matched, and a repeated filter looks about 100× faster than
it is. Indexed lookups (``lookup.by_request_id``: ``stagetrace_requests`` ordered by request ID, then
the trace's spans in its time window) and scans (``SpanAttributes['stagetrace.request.id'] = ID`` over
``otel_traces``, then the same span read) are interleaved; the scan runs both as a true scan
(``use_skip_indexes=0``) and through the Collector schema's bloom filter on ``mapValues(SpanAttributes)``. ``stagetrace trace --json`` is also timed
as a process of its own, interpreter start-up and opening the store included, once the benchmark has
closed the store (one process at a time may hold it), and again while ``stagetrace agent`` holds it
(read through its query endpoint). Timing starts once the background merges that the generation started
have finished.
"""

from __future__ import annotations

import random
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

from benchmarks import Figure, benchmark, compile_sources, synthetic
from benchmarks.storage import bytes_per_span
from stagetrace import lookup
from stagetrace.store import open_store

SCAN_SQL = """
SELECT TraceId, toUnixTimestamp64Nano(min(Timestamp)), toUnixTimestamp64Nano(max(Timestamp))
FROM {db:Identifier}.otel_traces
WHERE SpanAttributes['stagetrace.request.id'] = {rid:String}
GROUP BY TraceId
"""


def _scan(store, request_id: str, skip_indexes: bool) -> int:
    """The lookup a store without the request index needs: find the trace by its attribute, then read its spans.

    With ``skip_indexes`` the filter uses the Collector schema's bloom filter on ``mapValues(SpanAttributes)``;
    without, it reads the column for every span (a true scan).
    """
    rows = store.client.query(
        SCAN_SQL, parameters={"db": store.database, "rid": request_id}, settings={"use_skip_indexes": int(skip_indexes)}
    ).result_rows
    if not rows:
        raise lookup.NotFound(request_id)
    trace_id, start, end = rows[-1]
    return len(lookup._spans(store, trace_id, start - lookup.WINDOW_MARGIN_NS, end + lookup.WINDOW_MARGIN_NS))


def _settle(store, limit_s: float = 180.0) -> None:
    """Wait until the merges the generation started are done: lookups are timed on a store at rest."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        merges = store.client.query(
            "SELECT count() FROM system.merges WHERE database = {db:String}", parameters={"db": store.database}
        ).result_rows[0][0]
        if not merges:
            return
        time.sleep(1)


def _ms(function, *args) -> tuple[float, object]:
    started = time.perf_counter()
    result = function(*args)
    return (time.perf_counter() - started) * 1e3, result


def _p99(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]


@benchmark("lookup")
def lookup_benchmark(quick: bool) -> list[Figure]:
    requests, lookups, scans, processes, agent_processes = (
        (20_000, 30, 3, 1, 1) if quick else (1_666_667, 500, 15, 5, 11)
    )
    compile_sources()
    rng = random.Random(8)
    fresh = iter(rng.sample(range(requests), lookups + 2 * scans + processes + agent_processes + 1))
    indexed: list[float] = []
    scanned: dict[bool, list[float]] = {True: [], False: []}
    with tempfile.TemporaryDirectory(prefix="stagetrace-bench-") as directory:
        dsn = f"chdb://{directory}"
        with open_store(dsn) as store:
            started = time.perf_counter()
            spans = synthetic.fill(store, requests, time.time_ns() - 3600 * 10**9)
            generated = time.perf_counter() - started
            _settle(store)
            _ms(lookup.by_request_id, store, f"req-{next(fresh)}")  # warm-up: first query opens the parts
            every = max(1, lookups // scans)
            for i in range(lookups):
                ms, trace = _ms(lookup.by_request_id, store, f"req-{next(fresh)}")
                indexed.append(ms)
                if len(trace.spans) != 6:
                    raise RuntimeError(f"lookup found {len(trace.spans)} spans, not 6")
                if i % every == 0 and len(scanned[False]) < scans:
                    for skip_indexes in (False, True):
                        ms, found = _ms(_scan, store, f"req-{next(fresh)}", skip_indexes)
                        scanned[skip_indexes].append(ms)
                        if found != 6:
                            raise RuntimeError(f"scan found {found} spans, not 6")
        command = [sys.executable, "-m", "stagetrace", "trace", "--json", "--store", dsn]
        process: list[float] = []
        for _ in range(processes):
            request_id = f"req-{next(fresh)}"
            started = time.perf_counter()
            result = subprocess.run([*command, request_id], capture_output=True, text=True, check=False)
            process.append((time.perf_counter() - started) * 1e3)
            if result.returncode != 0 or request_id not in result.stdout:
                raise RuntimeError(f"stagetrace trace {request_id} failed: {result.stderr.strip()[-300:]}")
        through_agent = _through_agent(dsn, [f"req-{next(fresh)}" for _ in range(agent_processes)])
    scan_ms, bloom_ms = statistics.median(scanned[False]), statistics.median(scanned[True])
    scan = f"full scan of SpanAttributes['stagetrace.request.id'], median of {len(scanned[False])}"
    bloom = f"same filter through the bloom-filter skip index, median of {len(scanned[True])}"
    return [
        Figure(f"generate {requests:,} requests ({spans:,} spans) in-engine", generated, "s"),
        Figure(f"lookup.by_request_id, median of {lookups} fresh IDs", statistics.median(indexed), "ms", scan, scan_ms),
        Figure(f"lookup.by_request_id, p99 of {lookups} fresh IDs", _p99(indexed), "ms", scan, scan_ms),
        Figure("lookup.by_request_id, median (as above)", statistics.median(indexed), "ms", bloom, bloom_ms),
        Figure(
            f"`stagetrace trace --json` process, incl. start-up, median of {processes}",
            statistics.median(process),
            "ms",
            scan,
            scan_ms,
        ),
        Figure(
            f"`stagetrace trace --json` process while an agent holds the store, median of {agent_processes}",
            statistics.median(through_agent),
            "ms",
            "aim",
            250.0,
        ),
    ]


@contextmanager
def held_by_agent(dsn: str):
    """``stagetrace agent`` holding the embedded store ``dsn`` (no collectors, no OTLP), its query endpoint up."""
    agent = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "stagetrace",
            "agent",
            "--store",
            dsn,
            "--collectors",
            "",
            "--listen",
            "127.0.0.1:0",
            "--otlp",
            "none",
            "--otlp-grpc",
            "none",
            "--query-listen",
            "127.0.0.1:0",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        record = Path(dsn.removeprefix("chdb://")) / "agent.json"
        deadline = time.monotonic() + 120
        while not (record.exists() and "query" in record.read_text()):
            if agent.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the agent did not start: {agent.stderr.read().decode()[-300:]}")
            time.sleep(0.2)
        yield
    finally:
        agent.terminate()
        agent.wait(timeout=60)


def trace_process_ms(dsn: str, request_id: str, env: dict | None = None) -> float:
    """One ``stagetrace trace --json`` process, start-up included; fails unless it printed the request."""
    started = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "-m", "stagetrace", "trace", "--json", "--store", dsn, request_id],
        capture_output=True,
        text=True,
        check=False,
        env=env,
    )
    elapsed = (time.perf_counter() - started) * 1e3
    if result.returncode != 0 or request_id not in result.stdout:
        raise RuntimeError(f"stagetrace trace {request_id} failed: {result.stderr.strip()[-300:]}")
    return elapsed


def _through_agent(dsn: str, request_ids: list[str]) -> list[float]:
    """``trace --json`` processes while ``stagetrace agent`` holds the store: read through its query endpoint."""
    with held_by_agent(dsn):
        return [trace_process_ms(dsn, request_id) for request_id in request_ids]


CURVE_RATE = 500  # requests/s: the store grows as a fleet's would, its requests spread over hours
CURVE_CHUNK = 1_000_000  # requests per generating insert


@benchmark("lookup_curve")
def lookup_curve(quick: bool) -> list[Figure]:
    """Lookup by request ID and by trace ID as one store grows from 1M to 100M spans (quick: 60k to 600k), 200 fresh
    IDs at each size once merges have settled; then ``stagetrace trace`` through an agent holding the largest store.
    The growth from the smallest store to the largest is the figure: a lookup that reads by the tables' keys stays
    flat."""
    sizes = (60_000, 600_000) if quick else (1_000_000, 10_000_000, 100_000_000)
    lookups, agent_processes = (20, 1) if quick else (200, 11)
    compile_sources()
    rng = random.Random(38)
    figures: list[Figure] = []
    first: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="stagetrace-bench-") as directory:
        dsn = f"chdb://{directory}"
        filled, asked = 0, set()
        start_ns = time.time_ns() - int(sizes[-1] // 6 / CURVE_RATE * 1e9) - 3600 * 10**9
        with open_store(dsn) as store:
            for spans in sizes:
                while filled < spans // 6:
                    n = min(CURVE_CHUNK, spans // 6 - filled)
                    synthetic.fill(
                        store, n, start_ns + int(filled / CURVE_RATE * 1e9), seconds=n / CURVE_RATE, offset=filled
                    )
                    filled += n
                _settle(store, limit_s=900.0)
                spans_only, with_views = bytes_per_span(store)
                figures.append(Figure(f"bytes on disk per span at {spans:,} spans, otel_traces alone", spans_only, "B"))
                figures.append(
                    Figure(
                        f"bytes on disk per span at {spans:,} spans, with the tables its views fill", with_views, "B"
                    )
                )
                fresh = [i for i in rng.sample(range(filled), 2 * lookups + 1) if i not in asked]
                asked.update(fresh)
                lookup.by_request_id(store, f"req-{fresh[0]}")  # warm-up: the first query opens the parts
                by_id, traces = [], []
                for i in fresh[1 : lookups + 1]:
                    ms, trace = _ms(lookup.by_request_id, store, f"req-{i}")
                    if len(trace.spans) != 6:
                        raise RuntimeError(f"lookup found {len(trace.spans)} spans, not 6")
                    by_id.append(ms)
                for i in fresh[lookups + 1 :]:  # trace IDs of requests not looked up yet: no cached filter helps
                    traces.append(
                        store.client.query(
                            lookup.TRACES_OF_REQUEST_SQL, parameters={"db": store.database, "rid": f"req-{i}"}
                        ).result_rows[0][0]
                    )
                by_trace = [_ms(lookup.by_trace_id, store, t)[0] for t in traces]
                for name, timings in (("lookup.by_request_id", by_id), ("lookup.by_trace_id", by_trace)):
                    p50 = statistics.median(timings)
                    first.setdefault(name, p50)
                    smallest = f"{name} p50 at {sizes[0]:,} spans"
                    figures.append(
                        Figure(
                            f"{name} at {spans:,} spans, p50 of {len(timings)} fresh IDs",
                            p50,
                            "ms",
                            smallest if spans != sizes[0] else "aim",
                            first[name] if spans != sizes[0] else 50.0,
                        )
                    )
                    figures.append(Figure(f"{name} at {spans:,} spans, p99", _p99(timings), "ms", "aim", 100.0))
        through_agent = _through_agent(
            dsn, [f"req-{i}" for i in rng.sample(sorted(set(range(filled)) - asked), agent_processes)]
        )
    figures.append(
        Figure(
            f"`stagetrace trace --json` process through an agent holding {sizes[-1]:,} spans, median of "
            f"{agent_processes}",
            statistics.median(through_agent),
            "ms",
            "aim",
            250.0,
        )
    )
    return figures
