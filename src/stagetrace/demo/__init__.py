"""``stagetrace demo``: a stateless GPU inference pipeline in miniature, with injected faults and ground truth.

Several node processes (each with its tensor-parallel ranks as child processes) serve requests
that a stateless load balancer spreads over them; many requests repeat the same input, as real
traffic does. Every stage of every request is recorded with the stage-span API, the simulated
NICs and GPUs are scraped by the real collectors, and every fault that changed a stage's output is
recorded as ground truth in ``stagetrace_demo_truth``. Two kinds of difference are recorded there
too but are no deviation: a request whose host ran another context template (or index) than most
hosts while the rollout wave passed (``expected``), and the requests of the tenant that samples
without a seed (``nondeterministic``). The parent process owns the store.

Every timestamp the pipeline writes is on a simulated clock (``pipeline.SimClock``): request ``i`` arrives
``SIM_SECONDS_PER_REQUEST`` after request ``i - 1``, and the run ends when the demo started (the fabric's half
hour ends where it begins). What the analysis reads from the spans (when a host switched to a rolled-out value,
where a wave ends) is then the same for the same seed however loaded the machine is, and so are the truth and
the deviating outputs; only the outputs sampled without a seed differ from run to run, by design.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import queue as queue_module
import shutil
import signal
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field

import numpy as np

from stagetrace.demo import fabric, faults, world
from stagetrace.demo.pipeline import SERVICE_NAME, STEP_NS, RequestSpec, Result, node_main
from stagetrace.digest import digest
from stagetrace.exporters.inserts import insert_rows
from stagetrace.exporters.rows import COLUMNS, METRIC_COLUMNS, SUM_COLUMNS, SUM_TABLE
from stagetrace.store import Store

TRUTH_TABLE = "stagetrace_demo_truth"
SPAN_INSERT_ROWS = 5000
NODE_TIMEOUT_S = 300
REPEATS = 40  # requests per distinct input, on average: enough that each side of a rollout holds a clear majority


class DemoError(Exception):
    """The demo could not run (bad arguments, a node process failed); the message says why."""


@dataclass
class Truth:
    request_id: str
    stage: str
    cause: str
    node: str
    expected: bool = False  # the change is the fleet's move (a rollout wave), not a fault
    nondeterministic: bool = False  # the output differs by design (sampling without a seed)

    @property
    def deviation(self) -> bool:
        return not (self.expected or self.nondeterministic)


@dataclass
class DemoResult:
    requests: int
    spans: int
    metric_samples: int
    nodes: list[str]
    deviating: list[str]  # outputs that differ from the majority of comparable requests (see _conclude)
    truth: list[Truth]
    truncated_nodes: set[str] = field(default_factory=set)
    fabric_spans: int = 0  # the fabric and weights scenario's (demo.fabric)
    fabric_samples: int = 0

    def to_json(self) -> dict:
        return {
            "requests": self.requests,
            "deviating": self.deviating,
            "truth": [
                {
                    "request_id": t.request_id,
                    "stage": t.stage,
                    "cause": t.cause,
                    "expected": t.expected,
                    "nondeterministic": t.nondeterministic,
                }
                for t in self.truth
            ],
        }


def request_specs(requests: int, nodes: int, seed: int, salt: int = 0) -> dict[int, list[RequestSpec]]:
    """Every request, assigned to a node by a stateless load balancer; deterministic for the seed. ``salt``
    (an appended run) changes only the request IDs, so that they differ from those of earlier runs."""
    inputs = world.prompts(seed, max(4, requests // REPEATS))
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
        timeout = (
            node.nic_timeouts is not None
            and node.nic_timeouts[0] <= position < node.nic_timeouts[1]
            and draws[i] < node.nic_timeouts[2]
        )
        seq_error = node.in_seq_error_window(position) and draws[i] < node.remote_seq_errors[2]
        request_id = f"req-{digest([seed, i, salt] if salt else [seed, i])[:12]}"
        out[node.index].append(RequestSpec(position, i, request_id, inputs[int(chosen[i])], batch, timeout, seq_error))
    return out


# Every span and metric sample a run writes carries its run's ID as a resource attribute (``stagetrace.`` keys are
# never compared as causes): what --fresh and the removal of an interrupted run delete, and nothing else, so that the
# requests of other services in the same store stay. The runs table says which runs completed.
RUN_KEY = "stagetrace.demo.run"
RUNS_TABLE = "stagetrace_demo_runs"
SERVICES = (SERVICE_NAME, fabric.TP_SERVICE, fabric.TRAIN_SERVICE, fabric.ROLLOUT_SERVICE)
# the hosts the demo's samples name; only for a store an older demo wrote without run IDs (see _remove_untagged)
_DEMO_HOST = r"^(gpu|tp|train|rollout)-node-[0-9]+$"
# what a demo run writes: the spans and samples, the views' tables filled from the spans, and its own tables
_TRACE_TABLES = ("otel_traces_trace_id_ts", "stagetrace_requests", "stagetrace_stages", "stagetrace_divergences")
_SAMPLE_TABLES = ("otel_metrics_gauge", "otel_metrics_sum")
_OWN_TABLES = (TRUTH_TABLE, fabric.TRUTH_TABLE, RUNS_TABLE)
FRESH_REMOVES = "the demo's own spans, samples and ground truth; other services' data stays"


def run(
    store: Store,
    requests: int = 1000,
    nodes: int = 4,
    seed: int = 7,
    progress=None,
    earlier: str = "refuse",
    notice=None,
    began=None,
) -> DemoResult:
    """Run the demo into ``store``; ``progress(done, total)`` is called as requests finish, ``notice(line)`` with
    what was removed before the run, ``began()`` once the run is recorded as running (from then on an interrupted
    run leaves rows, marked as such).

    A store that already holds a completed demo run is refused (``earlier="refuse"``): the runs would mix, the same
    seed would give the same request IDs, and the counts of this run, ``divergences`` and the truth table would
    disagree. ``"fresh"`` removes the demo's own data first (only it: other services' requests stay); ``"append"``
    adds this run beside the earlier, with request IDs of its own. A run that did not complete (interrupted, or
    failed) is no run to keep: its data is removed first, whatever ``earlier`` says.

    Interrupted (KeyboardInterrupt, or any other exception), the run stops its processes at once and marks itself
    interrupted in ``stagetrace_demo_runs`` before the exception goes on: one insert, so the process exits at once.
    """
    if requests < 20:
        raise DemoError(f"--requests {requests} is too few: use at least 20 so inputs repeat")
    if not 2 <= nodes <= 16:
        raise DemoError(f"--nodes {nodes}: use 2 to 16 nodes (the faults are spread over them)")
    notice = notice or (lambda line: None)
    runs = _runs(store)
    unfinished = [r for r, state, _ in runs if state != "complete"]
    completed = [started for _, state, started in runs if state == "complete"]
    untagged = not runs and _exists(store, TRUTH_TABLE)  # an older demo's run, written without run IDs
    salt = 0
    if earlier == "fresh" and (runs or untagged):
        _remove_untagged(store) if untagged else _remove(store, None)
        notice(f"removed the earlier demo runs ({FRESH_REMOVES})")
    else:
        if (completed or untagged) and earlier == "refuse":
            when = f" of {max(completed)} UTC" if completed else ""
            raise DemoError(
                f"the store {store.location.redacted()} already holds a demo run{when}: add --fresh to "
                f"remove it first ({FRESH_REMOVES}), or --append to add this run beside it"
            )
        if completed or untagged:
            salt = time.time_ns()
        if unfinished:
            _remove(store, unfinished)
            notice(
                f"removed the data of {len(unfinished)} earlier demo run{'s' if len(unfinished) > 1 else ''} "
                "that did not complete"
            )
    run_id = digest([seed, time.time_ns()])[:16]
    specs = request_specs(requests, nodes, seed, salt)
    plan = faults.observed(faults.plan(nodes), {node: [s.position for s in served] for node, served in specs.items()})
    start_ns = _timeline_end(store, salt != 0) - requests * STEP_NS  # request 0's arrival on the simulated clock
    hardware_dir = tempfile.mkdtemp(prefix="stagetrace-demo-hw-")
    ctx = mp.get_context("fork")  # nodes inherit the imported modules; the store is opened only here
    messages = ctx.Queue(maxsize=2000)
    procs = [
        ctx.Process(
            target=_quiet,
            args=(node_main, cfg, seed, specs[cfg.index], messages, hardware_dir, start_ns),
            name=cfg.host,
        )
        for cfg in plan
    ]
    # the fabric half hour, which ends where the pipeline's requests begin, plays in a process of its own meanwhile
    fabric_end, fabric_rows = ctx.Pipe(duplex=False)
    procs.append(ctx.Process(target=_quiet, args=(_fabric_main, start_ns, seed + salt, fabric_rows), name="fabric"))
    tag = _Tagger(run_id)
    try:
        _mark(store, run_id, "running")
        if began:
            began()
        _start(procs)
        fabric_rows.close()
        results, spans, samples = _receive(store, messages, len(plan), requests, procs, progress, tag)
        fabric_spans, fabric_samples = _store_fabric(store, fabric_end, tag)
        for proc in procs:
            proc.join(timeout=5)
        result = _conclude(store, results, spans, samples, plan, run_id)
        _mark(store, run_id, "complete")
    except BaseException as exc:
        _stop(procs)
        try:
            _mark(store, run_id, "interrupted" if isinstance(exc, KeyboardInterrupt) else "failed")
        except Exception:  # the store itself failed: the run stays "running", which the next run removes all the same
            pass
        raise
    finally:
        _stop(procs)
        shutil.rmtree(hardware_dir, ignore_errors=True)
    result.fabric_spans, result.fabric_samples = fabric_spans, fabric_samples
    return result


def _quiet(target, *args) -> None:
    """A child process's start: Ctrl-C goes to the whole process group, and only the parent acts on it (it stops the
    children), so a child ignores it instead of dying with a traceback of its own. SIGINT is blocked while the
    parent starts its children (``_start``); a child ignores it before it unblocks it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    target(*args)


def _start(procs) -> None:
    """Start the children with SIGINT blocked, so that none starts with the parent's handler; a Ctrl-C meanwhile is
    held, and reaches the parent once they have started."""
    held = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        for proc in procs:
            proc.start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)


def _stop(procs) -> None:
    """End the children that still run: at once (SIGTERM, which they do not catch, then SIGKILL), never waiting for
    work an interrupted run will not use. Their TP ranks see their pipes close and end too (``tp``)."""
    running = [p for p in procs if p.pid is not None and p.exitcode is None]
    for proc in running:
        proc.terminate()
    deadline = time.monotonic() + 0.5
    for proc in running:
        proc.join(timeout=max(0.0, deadline - time.monotonic()))
        if proc.exitcode is None:
            proc.kill()
            proc.join(timeout=0.5)


class _Tagger:
    """Adds the run's ID to each row's resource attributes as the parent inserts it (the children need not know it)."""

    def __init__(self, run_id: str):
        self.run_id = run_id
        self._span_at = COLUMNS.index("ResourceAttributes")
        self._sample_at = METRIC_COLUMNS.index("ResourceAttributes")

    def spans(self, rows: list[tuple]) -> list[tuple]:
        return [self._tagged(row, self._span_at) for row in rows]

    def samples(self, rows: list[tuple]) -> list[tuple]:
        return [self._tagged(row, self._sample_at) for row in rows]

    def _tagged(self, row: tuple, at: int) -> tuple:
        return (*row[:at], {**row[at], RUN_KEY: self.run_id}, *row[at + 1 :])


def _exists(store: Store, table: str) -> bool:
    return bool(
        store.client.command(
            "SELECT count() FROM system.tables WHERE database = {db:String} AND name = {t:String}",
            parameters={"db": store.database, "t": table},
        )
    )


def _runs(store: Store) -> list[tuple[str, str, str]]:
    """(run ID, state, when it started, UTC) of every run the store records: running, complete, interrupted, failed."""
    if not _exists(store, RUNS_TABLE):
        return []
    return [
        tuple(row)
        for row in store.client.query(
            "SELECT Run, argMax(State, Updated), formatDateTime(min(Started), '%Y-%m-%d %H:%i', 'UTC') "
            "FROM {db:Identifier}.{t:Identifier} GROUP BY Run",
            parameters={"db": store.database, "t": RUNS_TABLE},
        ).result_rows
    ]


def _mark(store: Store, run_id: str, state: str) -> None:
    """A row per change of a run's state; the newest says where the run is, the first when it started."""
    store.client.command(
        "CREATE TABLE IF NOT EXISTS {db:Identifier}.{t:Identifier} (Run String, Started DateTime64(3), "
        "State LowCardinality(String), Updated DateTime64(3)) ENGINE = MergeTree ORDER BY (Run, Updated)",
        parameters={"db": store.database, "t": RUNS_TABLE},
    )
    store.client.command(
        "INSERT INTO {db:Identifier}.{t:Identifier} VALUES ({run:String}, now64(3), {state:String}, now64(3))",
        parameters={"db": store.database, "t": RUNS_TABLE, "run": run_id, "state": state},
    )


def _delete(store: Store, table: str, where: str, parameters: dict) -> None:
    # a mutation, waited for: the lightweight DELETE refuses tables with projections (stagetrace_requests)
    engine = store.client.command(
        "SELECT any(engine) FROM system.tables WHERE database = {db:String} AND name = {t:String}",
        parameters={"db": store.database, "t": table},
    )
    if not engine:
        return
    if (
        engine == "Distributed"
    ):  # a cluster's: a mutation runs on each shard's table, ON CLUSTER, which is no demo's job
        raise DemoError(
            f"the store {store.location.redacted()} is a cluster's: the demo does not remove rows from "
            "its shards; use a store of its own for the demo"
        )
    store.client.command(
        f"ALTER TABLE {{db:Identifier}}.{{table:Identifier}} DELETE WHERE {where}",
        parameters={"db": store.database, "table": table, **parameters},
        settings={"mutations_sync": 2},
    )


def _remove(store: Store, runs: list[str] | None) -> None:
    """Delete the rows of these runs (None: of every run), by the run ID on their resource; the views' tables by the
    trace IDs of those spans, so first. Nothing of another service is touched."""
    tagged = (
        f"ResourceAttributes[{RUN_KEY!r}] != ''"
        if runs is None
        else f"ResourceAttributes[{RUN_KEY!r}] IN {{runs:Array(String)}}"
    )
    parameters = {} if runs is None else {"runs": runs}
    traces = f"TraceId IN (SELECT TraceId FROM {{db:Identifier}}.otel_traces WHERE {tagged})"
    for table in _TRACE_TABLES:
        _delete(store, table, traces, parameters)
    for table in ("otel_traces", *_SAMPLE_TABLES):
        _delete(store, table, tagged, parameters)
    own = "1" if runs is None else "Run IN {runs:Array(String)}"
    for table in _OWN_TABLES:
        if table == RUNS_TABLE or runs is None or _has_column(store, table, "Run"):
            _delete(store, table, own, parameters)


def _has_column(store: Store, table: str, column: str) -> bool:
    return bool(
        store.client.command(
            "SELECT count() FROM system.columns WHERE database = {db:String} AND table = {t:String} AND name = {c:String}",
            parameters={"db": store.database, "t": table, "c": column},
        )
    )


def _others(store: Store, where_spans: str = "1", where_samples: str = "1") -> list[str]:
    """What else the store holds than the demo's rows: ``service (N traces)`` and ``host (N samples)``."""
    found = [
        f"{service or '(no service)'} ({n} trace{'s' if n != 1 else ''})"
        for service, n in store.client.query(
            f"SELECT ServiceName, uniqExact(TraceId) FROM {{db:Identifier}}.otel_traces WHERE {where_spans} "
            "GROUP BY 1 ORDER BY 1",
            parameters={"db": store.database},
        ).result_rows
    ]
    for table in _SAMPLE_TABLES:
        found += [
            f"host {host or '(none)'} ({n} {table} samples)"
            for host, n in store.client.query(
                f"SELECT ResourceAttributes['host.name'], count() FROM {{db:Identifier}}.{table} WHERE {where_samples} "
                "GROUP BY 1 ORDER BY 1",
                parameters={"db": store.database},
            ).result_rows
        ]
    if _exists(store, "otel_logs"):
        logs = int(
            store.client.command("SELECT count() FROM {db:Identifier}.otel_logs", parameters={"db": store.database})
        )
        found += [f"{logs} log lines"] if logs else []
    return found


def _remove_untagged(store: Store) -> None:
    """--fresh on a store an older demo wrote, whose rows carry no run ID: only the demo's service names and host
    names would tell its rows from others', and another service may use those names too. Safe only when the store
    holds nothing else: then it is emptied, as the older demo did; otherwise refused, naming what else it holds."""
    services = ", ".join(repr(s) for s in SERVICES)
    foreign = _others(
        store, f"ServiceName NOT IN ({services})", f"NOT match(ResourceAttributes['host.name'], {_DEMO_HOST!r})"
    )
    if foreign:
        shown = ", ".join(foreign[:6]) + (f" and {len(foreign) - 6} more" if len(foreign) > 6 else "")
        raise DemoError(
            f"the store {store.location.redacted()} holds an older demo run, whose rows do not say which "
            f"run wrote them, beside other data: {shown}. --fresh would not know which to remove; use "
            "another --store for the demo"
        )
    for table in ("otel_traces", *_TRACE_TABLES, *_SAMPLE_TABLES, *_OWN_TABLES):
        store.client.command(
            "TRUNCATE TABLE IF EXISTS {db:Identifier}.{table:Identifier}",
            parameters={"db": store.database, "table": table},
        )


def _timeline_end(store: Store, appended: bool) -> int:
    """Where the run's simulated clock ends: now, so that every request lies in the past (``divergences`` reads up
    to now) and the latest lie in its default hour. An appended run ends before the earliest request already in
    the store instead: laid over it, the hosts would seem to switch values back and forth, and no rollout would
    show."""
    now = time.time_ns()
    if not appended:
        return now
    earliest = store.client.command(
        "SELECT toUnixTimestamp64Nano(min(Timestamp)) FROM {db:Identifier}.otel_traces WHERE ServiceName = {s:String}",
        parameters={"db": store.database, "s": SERVICE_NAME},
    )
    return min(now, int(earliest) - STEP_NS) if int(earliest or 0) > 0 else now


def _fabric_main(end_ns: int, seed: int, conn) -> None:
    try:
        conn.send(("done", fabric.play(end_ns, seed)))
    except BaseException as exc:  # the parent reports it
        conn.send(("failed", f"{type(exc).__name__}: {exc}"))
    finally:
        conn.close()


def _store_fabric(store: Store, conn, tag: _Tagger) -> tuple[int, int]:
    """The fabric and weights half hour before the run (``demo.fabric``) and its ground truth, written."""
    try:
        kind, payload = conn.recv() if conn.poll(NODE_TIMEOUT_S) else ("failed", f"no answer in {NODE_TIMEOUT_S} s")
    except EOFError:
        kind, payload = "failed", "it exited without an answer"
    if kind != "done":
        raise DemoError(f"the fabric scenario failed: {payload}")
    spans, metrics, truth, t0 = payload
    written = _insert_spans(store, tag.spans(spans))
    samples = sum(_insert_metrics(store, table, tag.samples(rows)) for table, rows in metrics.items())
    fabric.write_truth(store, truth, t0, tag.run_id)
    return written, samples


def _receive(store: Store, messages, node_count: int, total: int, procs, progress, tag: _Tagger):
    results: list[Result] = []
    span_rows: list[tuple] = []
    metric_rows: dict[str, list[tuple]] = defaultdict(
        list
    )  # inserted in batches too: an insert costs more than its rows
    spans = samples = 0
    finished = 0
    while finished < node_count:
        try:
            kind, *payload = messages.get(timeout=NODE_TIMEOUT_S)
        except queue_module.Empty:
            raise DemoError(f"no word from the node processes for {NODE_TIMEOUT_S} s; giving up") from None
        if kind == "spans":
            span_rows.extend(tag.spans(payload[0]))
            if len(span_rows) >= SPAN_INSERT_ROWS:
                spans += _insert_spans(store, span_rows)
        elif kind == "metrics":
            for table, rows in payload[0].items():
                metric_rows[table].extend(tag.samples(rows))
                if len(metric_rows[table]) >= SPAN_INSERT_ROWS:
                    samples += _insert_metrics(store, table, metric_rows[table])
        elif kind == "result":
            results.append(payload[0])
            if progress:
                progress(len(results), total)
        elif kind == "done":
            finished += 1
            if payload[1]:
                raise DemoError(f"node {procs[payload[0]].name} failed: {payload[1]}")
    spans += _insert_spans(store, span_rows)
    for table, rows in metric_rows.items():
        samples += _insert_metrics(store, table, rows)
    return results, spans, samples


def _insert_metrics(store: Store, table: str, rows: list[tuple]) -> int:
    if rows:  # times in seconds where the Collector's current tables keep seconds
        insert_rows(store, table, rows, SUM_COLUMNS if table == SUM_TABLE else METRIC_COLUMNS)
    count = len(rows)
    rows.clear()
    return count


def _insert_spans(store: Store, rows: list[tuple]) -> int:
    if rows:
        store.client.insert("otel_traces", rows, column_names=COLUMNS, database=store.database)
    count = len(rows)
    rows.clear()
    return count


# stage → (the rolled-out setting recorded as the cause, its new value)
_ROLLOUTS = {
    "retrieval": ("retrieval.index.version", world.NEW_INDEX),
    "context_assembly": ("context.template.version", faults.NEW_TEMPLATE),
}


def _wave_ends(results: list[Result]) -> dict[str, float]:
    """Per rolled-out setting, the end of its wave in ns of the run's clock, as the spans show it: the fleet moved
    with the first request on the new value of the host that made it most hosts, and the wave lasts as long
    again after that as the fleet took to move (``analysis.rollouts``)."""
    ends = {}
    hosts = {r.node for r in results}
    for stage, (_, new) in _ROLLOUTS.items():
        firsts = dict.fromkeys(hosts, math.inf)
        for r in results:
            value, started, _ = r.rollouts[stage]
            if value == new:
                firsts[r.node] = min(firsts[r.node], started)
        ordered = sorted(firsts.values())
        first, fleet = ordered[0], ordered[len(ordered) // 2]
        ends[stage] = fleet + (fleet - first) if fleet < math.inf else math.inf
    return ends


def _majority(outputs: Counter) -> str | None:
    """The most common output, or None where another output is as common: a tie has no majority, and no request of
    it deviates. (``most_common`` would pick the tied output counted first, and results arrive from the node
    processes in whatever order they finish: the same seed gave other deviating outputs from run to run.)"""
    top = outputs.most_common(2)
    return None if len(top) == 2 and top[0][1] == top[1][1] else top[0][0]


def _conclude(store: Store, results: list[Result], spans: int, samples: int, plan, run_id: str) -> DemoResult:
    """Deviating outputs and the ground truth; the truth table is written.

    A request whose host was behind the fleet on a rolled-out setting is an expected change within the
    wave and a fault after it; the wave's end is read from the spans' start times, as the analysis reads it
    (they lie on the run's simulated clock, so the same seed gives the same wave and the same truth).
    A request's comparable requests are those with the same input served while the fleet ran the same
    index and template (a rollout changes outputs, and is no deviation). Deviating are the requests
    whose output differs from the majority of theirs (where one output is more common than any other),
    except the expected changes of a rollout wave; requests that sample without a seed are compared with
    none. Truth rows are listed deviations
    first, then expected changes, then the nondeterministic requests, each by request ID.
    """
    hosts = [cfg.host for cfg in plan]
    ends = _wave_ends(results)
    for r in results:
        if r.stage in _ROLLOUTS and r.cause == _ROLLOUTS[r.stage][0] and r.rollouts[r.stage][2]:
            r.expected = r.rollouts[r.stage][1] <= ends[r.stage]  # behind the fleet: within the wave, or lagging it
    groups: dict[tuple, Counter] = defaultdict(Counter)
    for r in results:
        if not (r.expected or r.nondeterministic):
            groups[(r.input_digest, r.epoch)][r.output_digest] += 1
    majority = {k: _majority(c) for k, c in groups.items()}
    results.sort(key=lambda r: r.request_id)
    deviating = [
        r.request_id
        for r in results
        if not (r.expected or r.nondeterministic) and majority[(r.input_digest, r.epoch)] not in (None, r.output_digest)
    ]
    truth = [
        Truth(r.request_id, r.stage, r.cause, hosts[r.node], r.expected, r.nondeterministic)
        for r in results
        if r.stage is not None
    ]
    truth.sort(key=lambda t: (t.nondeterministic, t.expected))  # stable: by request ID within each kind
    truncated = {hosts[r.node] for r in results if r.truncated}
    store.client.command(
        f"CREATE TABLE IF NOT EXISTS {{db:Identifier}}.{TRUTH_TABLE} (RequestId String, Stage LowCardinality(String), "
        "Cause LowCardinality(String), Node LowCardinality(String), Expected UInt8, Nondeterministic UInt8, Run String) "
        "ENGINE = ReplacingMergeTree ORDER BY RequestId",
        parameters={"db": store.database},
    )
    store.client.command(  # a truth table an earlier demo made into the same store lacks the new columns
        f"ALTER TABLE {{db:Identifier}}.{TRUTH_TABLE} ADD COLUMN IF NOT EXISTS Expected UInt8, "
        "ADD COLUMN IF NOT EXISTS Nondeterministic UInt8, ADD COLUMN IF NOT EXISTS Run String",
        parameters={"db": store.database},
    )
    if truth:
        store.client.insert(
            TRUTH_TABLE,
            [(t.request_id, t.stage, t.cause, t.node, int(t.expected), int(t.nondeterministic), run_id) for t in truth],
            column_names=("RequestId", "Stage", "Cause", "Node", "Expected", "Nondeterministic", "Run"),
            database=store.database,
        )
    return DemoResult(len(results), spans, samples, hosts, deviating, truth, truncated)
