"""``stagetrace demo``: a stateless GPU inference pipeline in miniature, with injected faults and ground truth.

Several node processes (each with its tensor-parallel ranks as child processes) serve requests
that a stateless load balancer spreads over them; many requests repeat the same input, as real
traffic does. Every stage of every request is recorded with the stage-span API, the simulated
NICs and GPUs are scraped by the real collectors, and every fault that changed a stage's output is
recorded as ground truth in ``stagetrace_demo_truth``. The parent process owns the store.
"""

from __future__ import annotations

import multiprocessing as mp
import queue as queue_module
import shutil
import tempfile
from collections import Counter, defaultdict
from dataclasses import dataclass, field

import numpy as np

from stagetrace.demo import faults, world
from stagetrace.demo.pipeline import RequestSpec, node_main
from stagetrace.digest import digest
from stagetrace.exporters.clickhouse import COLUMNS, METRIC_COLUMNS, SUM_COLUMNS, SUM_TABLE
from stagetrace.store import Store

TRUTH_TABLE = "stagetrace_demo_truth"
SPAN_INSERT_ROWS = 5000
NODE_TIMEOUT_S = 300


class DemoError(Exception):
    """The demo could not run (bad arguments, a node process failed); the message says why."""


@dataclass
class Truth:
    request_id: str
    stage: str
    cause: str
    node: str


@dataclass
class DemoResult:
    requests: int
    spans: int
    metric_samples: int
    nodes: list[str]
    deviating: list[str]  # outputs that differ from the majority of requests with the same input
    truth: list[Truth]
    truncated_nodes: set[str] = field(default_factory=set)

    def to_json(self) -> dict:
        return {
            "requests": self.requests,
            "deviating": self.deviating,
            "truth": [{"request_id": t.request_id, "stage": t.stage, "cause": t.cause} for t in self.truth],
        }


def request_specs(requests: int, nodes: int, seed: int) -> dict[int, list[RequestSpec]]:
    """Every request, assigned to a node by a stateless load balancer; deterministic for the seed."""
    inputs = world.prompts(seed, max(4, requests // 20))
    rng = np.random.default_rng([seed, 4])
    chosen = rng.integers(len(inputs), size=requests)
    placed = rng.integers(nodes, size=requests)
    draws = rng.random(size=requests)
    plan = faults.plan(nodes)
    out: dict[int, list[RequestSpec]] = defaultdict(list)
    for i in range(requests):
        node = plan[int(placed[i])]
        position = i / requests
        request_rng = np.random.default_rng([seed, 5, i])
        batch = int(request_rng.integers(16, 49)) if node.in_burst(position) else int(request_rng.integers(1, 9))
        timeout = node.nic_timeouts is not None and node.nic_timeouts[0] <= position < node.nic_timeouts[1] and draws[i] < node.nic_timeouts[2]
        request_id = f"req-{digest([seed, i])[:12]}"
        out[node.index].append(RequestSpec(position, i, request_id, inputs[int(chosen[i])], batch, timeout))
    return out


def run(store: Store, requests: int = 1000, nodes: int = 4, seed: int = 7, progress=None) -> DemoResult:
    """Run the demo into ``store``; ``progress(done, total)`` is called as requests finish."""
    if requests < 20:
        raise DemoError(f"--requests {requests} is too few: use at least 20 so inputs repeat")
    if not 2 <= nodes <= 16:
        raise DemoError(f"--nodes {nodes}: use 2 to 16 nodes (the faults are spread over them)")
    plan = faults.plan(nodes)
    specs = request_specs(requests, nodes, seed)
    hardware_dir = tempfile.mkdtemp(prefix="stagetrace-demo-hw-")
    ctx = mp.get_context("fork")  # nodes inherit the imported modules; the store is opened only here
    messages = ctx.Queue(maxsize=2000)
    procs = [ctx.Process(target=node_main, args=(cfg, seed, specs[cfg.index], messages, hardware_dir),
                         name=cfg.host) for cfg in plan]  # fmt: skip
    try:
        for proc in procs:
            proc.start()
        results, spans, samples = _receive(store, messages, len(plan), requests, procs, progress)
    finally:
        for proc in procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
        shutil.rmtree(hardware_dir, ignore_errors=True)
    return _conclude(store, results, spans, samples, plan)


def _receive(store: Store, messages, node_count: int, total: int, procs, progress):
    results: list[tuple] = []
    span_rows: list[tuple] = []
    spans = samples = 0
    finished = 0
    while finished < node_count:
        try:
            kind, *payload = messages.get(timeout=NODE_TIMEOUT_S)
        except queue_module.Empty:
            raise DemoError(f"no word from the node processes for {NODE_TIMEOUT_S} s; giving up") from None
        if kind == "spans":
            span_rows.extend(payload[0])
            if len(span_rows) >= SPAN_INSERT_ROWS:
                spans += _insert_spans(store, span_rows)
        elif kind == "metrics":
            for table, rows in payload[0].items():
                if rows:
                    store.client.insert(table, rows, column_names=SUM_COLUMNS if table == SUM_TABLE else METRIC_COLUMNS,
                                        database=store.database)  # fmt: skip
                    samples += len(rows)
        elif kind == "result":
            results.append(payload[0])
            if progress:
                progress(len(results), total)
        elif kind == "done":
            finished += 1
            if payload[1]:
                raise DemoError(f"node {procs[payload[0]].name} failed: {payload[1]}")
    spans += _insert_spans(store, span_rows)
    return results, spans, samples


def _insert_spans(store: Store, rows: list[tuple]) -> int:
    if rows:
        store.client.insert("otel_traces", rows, column_names=COLUMNS, database=store.database)
    count = len(rows)
    rows.clear()
    return count


def _conclude(store: Store, results: list[tuple], spans: int, samples: int, plan) -> DemoResult:
    hosts = [cfg.host for cfg in plan]
    groups: dict[str, Counter] = defaultdict(Counter)
    for _, input_digest, output_digest, *_ in results:
        groups[input_digest][output_digest] += 1
    majority = {k: c.most_common(1)[0][0] for k, c in groups.items()}
    results.sort(key=lambda r: r[0])
    deviating = [r[0] for r in results if r[2] != majority[r[1]]]
    truth = [Truth(r[0], r[3], r[4], hosts[r[5]]) for r in results if r[3] is not None]
    truncated = {hosts[r[5]] for r in results if r[6]}
    store.client.command(
        f"CREATE TABLE IF NOT EXISTS {{db:Identifier}}.{TRUTH_TABLE} (RequestId String, Stage LowCardinality(String), "
        "Cause LowCardinality(String), Node LowCardinality(String)) ENGINE = ReplacingMergeTree ORDER BY RequestId",
        parameters={"db": store.database},
    )
    if truth:
        store.client.insert(TRUTH_TABLE, [(t.request_id, t.stage, t.cause, t.node) for t in truth],
                            column_names=("RequestId", "Stage", "Cause", "Node"), database=store.database)  # fmt: skip
    return DemoResult(len(results), spans, samples, hosts, deviating, truth, truncated)
