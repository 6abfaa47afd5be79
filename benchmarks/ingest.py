"""Fleet-shaped ingest: 32 simulated hosts into one ``stagetrace agent`` at the highest rate it sustains (issue 32).

The agent runs as its own process on an embedded store in a temporary directory (no collectors, OTLP/HTTP and
OTLP/gRPC on loopback, live analysis off, ``--no-low-priority``: the senders stand in for other machines, and a
niced agent would yield its cores to them). 32 hosts send to it, each with its own ``Resource`` (``host.name``,
``host.id``, the GPU and engine it serves with) and its own exporter: the official ``OTLPSpanExporter``, half over
HTTP and half over gRPC, one thread a host, the HTTP hosts in one process and the gRPC hosts in another. A host
sends as the SDK's ``BatchSpanProcessor`` would: a batch every 5 s, or sooner once 510 spans (85 requests of a
root and five stages in stagetrace's conventions: request ID, input and output digests, stage digests, a setting
and a GPU per stage) are waiting. Every span ID says which host and which batch it came from.

**The rate.** The offered rate is stepped up (×1.25 a step) until the agent's acknowledged backlog grows: the rows
in the write-ahead records of its spool (``<spool>/spans/<slot>/*.wal``, acknowledged but not yet in
``otel_traces``) rising through a step by more than 5% of what was offered, or the acknowledgements falling more
than 10% behind it. The hold then starts at the last step that held and lasts the run (``STAGETRACE_INGEST_SECONDS``,
default 600 s; quick mode: a few seconds and four hosts): a rate that holds for a step may not for minutes (parts
pile up, other work takes the cores), so every 30 s the offered rate steps down 10% where the backlog grew or
stands above one insert's rows and three seconds of traffic, else up 3%. The figures are the hold's, its offered
rate the mean over it, and the backlog's trend over its second half says whether it settled. At the end the senders
stop, the spool drains, the agent stops, and the store is read back by span ID: every acknowledged span stored
exactly once, or the benchmark fails.

**The machine is shared.** With two cores the senders' own CPU (the SDK's encoders, the exporters) competes with
the agent's; their cores are reported beside the agent's (from ``/proc/<pid>/stat``: user + system time of every
thread, the embedded engine's included).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from benchmarks import Figure, benchmark
from benchmarks.durability import _free_port
from benchmarks.footprint import _wait_for
from stagetrace.exporters.durable import MAX_GROUP_ROWS
from stagetrace.store import open_store

SERVICE = "fleet"
SPANS_PER_REQUEST = 6
BATCH_REQUESTS = 85  # 510 spans: the SDK's 512-span export batch, in whole requests
SCHEDULE_S = 5.0  # the SDK's BatchSpanProcessor schedule delay
STEP_GROWTH = 1.25
GROWING = 0.05  # the backlog rose by more than this share of the spans offered during a step
BEHIND = 0.10  # the acknowledgements fell this far behind the offered rate


def _ticks(pid: int) -> float:
    """CPU seconds (user + system, every thread) of process ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _status_mib(pid: int, key: str) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    return 0.0


def _backlog(spool: Path) -> tuple[int, int]:
    """Rows and bytes acknowledged but not yet stored: the receivers' write-ahead records in the spool's slots."""
    rows = size = 0
    try:
        slots = [e.path for e in os.scandir(spool / "spans") if e.is_dir() and e.name != "kept"]
    except FileNotFoundError:
        return 0, 0
    for slot in slots:
        try:
            entries = list(os.scandir(slot))
        except FileNotFoundError:
            continue
        for entry in entries:
            if entry.name.endswith((".wal", ".seg")):
                rows += int(entry.name.split(".")[2])
                try:
                    size += entry.stat().st_size
                except FileNotFoundError:
                    pass
    return rows, size


def _host_spans(host: int, batch: int, requests: int, resource, scope) -> list:
    """One batch of a host: ``requests`` requests of a root and five stage spans; IDs name the host and batch."""
    from opentelemetry.sdk.trace import ReadableSpan
    from opentelemetry.trace import SpanContext, SpanKind, TraceFlags

    import stagetrace.tracing as st

    spans, now = [], time.time_ns()
    flags = TraceFlags(TraceFlags.SAMPLED)
    for r in range(requests):
        trace_id = (host + 1) << 96 | batch << 32 | r + 1
        root_id = (host + 1) << 56 | batch << 16 | r * SPANS_PER_REQUEST + 1
        root = SpanContext(trace_id, root_id, False, flags)
        start = now - 200_000_000 + r * 1000
        tag = f"{host:02x}{batch:08x}{r:04x}"
        for k, stage in enumerate(st.PIPELINE_STAGES):
            spans.append(
                ReadableSpan(
                    f"stage.{stage}",
                    SpanContext(trace_id, root_id + k + 1, False, flags),
                    root,
                    resource,
                    {
                        st.STAGE: stage,
                        st.STAGE_INPUT_DIGEST: f"{tag}{k:02x}" * 2,
                        st.STAGE_OUTPUT_DIGEST: f"{tag}{k + 1:02x}" * 2,
                        f"setting.{stage}": "a",
                        "gpu.uuid": f"GPU-{host:02d}-{r % 8}",
                    },
                    kind=SpanKind.INTERNAL,
                    start_time=start + k * 30_000_000,
                    end_time=start + (k + 1) * 30_000_000,
                    instrumentation_scope=scope,
                )
            )
        spans.append(
            ReadableSpan(
                "inference.request",
                root,
                None,
                resource,
                {
                    st.REQUEST_ID: f"req-{tag}",
                    st.INPUT_DIGEST: f"{tag}in" * 2,
                    st.OUTPUT_DIGEST: f"{tag}ou" * 2,
                    "gen_ai.request.model": "m-70b",
                },
                kind=SpanKind.SERVER,
                start_time=start,
                end_time=start + 150_000_000,
                instrumentation_scope=scope,
            )
        )
    return spans


def _senders(protocol: str, endpoint: str, hosts: list[int], schedule_s: float, rate, stop, acked, results) -> None:
    """A process of hosts, each a thread with its own exporter, sending at ``rate.value`` spans/s a host: a batch
    every ``schedule_s``, or sooner when a whole batch is waiting."""
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace.export import SpanExportResult
    from opentelemetry.sdk.util.instrumentation import InstrumentationScope

    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        def exporter():
            return OTLPSpanExporter(endpoint=endpoint, insecure=True, timeout=30)
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        def exporter():
            return OTLPSpanExporter(endpoint=endpoint, timeout=30)

    scope = InstrumentationScope("stagetrace", "0")
    records: dict[int, list] = {}
    retried = _Retries()
    logging.getLogger("opentelemetry.exporter").addHandler(retried)

    def host_loop(host: int) -> None:
        resource = Resource.create(
            {
                "service.name": SERVICE,
                "host.name": f"gpu-node-{host:02d}",
                "host.id": f"{host:032x}",
                "gpu.model": "NVIDIA H200",
                "gpu.count": 8,
                "engine": "vllm",
                "engine.tensor_parallel_size": "8",
            }
        )
        out, sender = records.setdefault(host, []), exporter()
        due = time.monotonic() + random.random() * min(schedule_s, BATCH_REQUESTS * SPANS_PER_REQUEST / rate.value)
        batch = 0
        while not stop.wait(max(0.0, due - time.monotonic())):
            per_host = rate.value
            requests = max(1, min(BATCH_REQUESTS, round(per_host * schedule_s / SPANS_PER_REQUEST)))
            spans = _host_spans(host, batch, requests, resource, scope)
            sent = time.monotonic()
            ok = sender.export(spans) is SpanExportResult.SUCCESS
            latency = time.monotonic() - sent
            out.append((batch, len(spans), sent, latency, ok))
            if ok:
                with acked.get_lock():
                    acked.value += len(spans)
            batch += 1
            period = len(spans) / per_host
            due = max(due + period, time.monotonic() - period)  # behind by more than a batch: the rest is not offered
        sender.shutdown()

    threads = [threading.Thread(target=host_loop, args=(h,), daemon=True) for h in hosts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    results.put((protocol, records, retried.count))


class _Retries(logging.Handler):
    """Counts the exporters' retries (their "Transient error ..., retrying" warnings: 503, UNAVAILABLE)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        if "retrying" in str(record.msg):
            self.count += 1


class _Agent:
    """``stagetrace agent`` on the store ``dsn``, its spool in ``directory``, OTLP/HTTP and OTLP/gRPC on free loopback
    ports."""

    def __init__(self, directory: Path, dsn: str):
        directory.mkdir(parents=True, exist_ok=True)
        self.dsn, self.spool, self.log = dsn, directory / "spool", directory / "agent.log"
        self.http, self.grpc = _free_port(), _free_port()
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "stagetrace",
                "agent",
                "--store",
                dsn,
                "--listen",
                "127.0.0.1:0",
                "--otlp",
                f"127.0.0.1:{self.http}",
                "--otlp-grpc",
                f"127.0.0.1:{self.grpc}",
                "--query-listen",
                "none",
                "--collectors",
                "",
                "--analyse-every",
                "0",
                "--no-low-priority",
            ],
            stdout=subprocess.DEVNULL,
            stderr=self.log.open("w"),
            env={**os.environ, "STAGETRACE_HOST": "bench", "STAGETRACE_SPOOL_DIR": str(self.spool)},
        )
        deadline = time.monotonic() + 60
        while "receiving OTLP/gRPC" not in self.log.read_text():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.process.kill()
                raise RuntimeError(f"the agent did not start: {self.log.read_text()[-500:]}")
            time.sleep(0.1)

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        if self.process.wait(timeout=300) != 0:
            raise RuntimeError(f"the agent did not stop cleanly: {self.log.read_text()[-500:]}")


class _Sum:
    """The spans acknowledged so far, over every sender process."""

    def __init__(self, counters):
        self.counters = counters

    @property
    def value(self) -> int:
        return sum(c.value for c in self.counters)


class _Monitor:
    """Samples, every ``every`` seconds: the backlog, the agent's CPU time and RSS."""

    def __init__(self, agent: _Agent, acked, every: float):
        self.agent, self.acked, self.every = agent, acked, every
        self.samples: list[tuple[float, int, int, float, int]] = []  # (time, rows, bytes, agent CPU s, acked)
        self.peak_rss = 0.0

    def sample(self) -> tuple[float, int, int, float, int]:
        rows, size = _backlog(self.agent.spool)
        point = (time.monotonic(), rows, size, _ticks(self.agent.process.pid), self.acked.value)
        self.samples.append(point)
        self.peak_rss = max(self.peak_rss, _status_mib(self.agent.process.pid, "VmRSS"))
        return point

    def run_for(self, seconds: float) -> list[tuple[float, int, int, float, int]]:
        """Sample for ``seconds``; the samples of that span."""
        first, end = len(self.samples), time.monotonic() + seconds
        while time.monotonic() < end:
            self.sample()
            time.sleep(min(self.every, max(0.0, end - time.monotonic())))
        self.sample()
        return self.samples[first:]


def _slope(points: list[tuple[float, int]]) -> float:
    """Least-squares slope of (t, y)."""
    if len(points) < 2:
        return 0.0
    mt, my = statistics.fmean(p[0] for p in points), statistics.fmean(p[1] for p in points)
    den = sum((t - mt) ** 2 for t, _ in points)
    return sum((t - mt) * (y - my) for t, y in points) / den if den else 0.0


def _held(window: list[tuple[float, int, int, float, int]], offered: float) -> tuple[bool, float, float]:
    """Whether the agent kept up with ``offered`` spans/s over ``window`` (its first quarter skipped: the step's
    change settling); the backlog's growth and the acknowledged rate, both in spans/s."""
    settled = window[len(window) // 4 :]
    growth = _slope([(t, rows) for t, rows, *_ in settled])
    seconds = settled[-1][0] - settled[0][0]
    acked_rate = (settled[-1][4] - settled[0][4]) / seconds if seconds > 0 else 0.0
    return growth <= GROWING * offered and acked_rate >= (1 - BEHIND) * offered, growth, acked_rate


def _run(directory: Path, dsn: str, quick: bool, hold_s: float, store_pid: int | None = None) -> dict:
    """One agent on ``dsn`` under the fleet: the ramp, the hold, the drain and the reconciliation; the hold's figures.
    ``store_pid``: the process of a server store, whose CPU is measured apart from the agent's."""
    hosts = 4 if quick else 32
    # quick: batches every 0.5 s, so that a few-second step sees several of each host's
    step_s, start_rate, max_steps, schedule_s = (2.0, 300.0, 1, 0.5) if quick else (20.0, 2000.0, 12, SCHEDULE_S)
    context = multiprocessing.get_context("spawn")  # gRPC does not survive a fork
    agent = _Agent(directory, dsn)
    rate = context.Value("d", start_rate / hosts, lock=False)
    stop, results = context.Event(), context.Queue()
    acked = [context.Value("q", 0) for _ in range(2)]
    halves = {"http": list(range(0, hosts, 2)), "grpc": list(range(1, hosts, 2))}
    endpoints = {"http": f"http://127.0.0.1:{agent.http}/v1/traces", "grpc": f"127.0.0.1:{agent.grpc}"}
    processes = [
        context.Process(
            target=_senders, daemon=True, args=(p, endpoints[p], halves[p], schedule_s, rate, stop, acked[i], results)
        )
        for i, p in enumerate(("http", "grpc"))
    ]
    monitor = _Monitor(agent, _Sum(acked), 0.5)
    try:
        idle = monitor.run_for(1.0 if quick else 10.0)  # the agent with no sender: its fixed cost
        idle_cores = (idle[-1][3] - idle[0][3]) / (idle[-1][0] - idle[0][0])
        for p in processes:
            p.start()
        deadline = time.monotonic() + 120  # every sender process running (imports, first export) before the ramp
        while not all(a.value for a in acked):
            if time.monotonic() > deadline or not all(p.is_alive() for p in processes):
                raise RuntimeError("the senders did not start")
            time.sleep(0.1)
        started = time.monotonic()
        # the ramp: the offered rate up a step at a time until the backlog grows
        steps, sustained = [], None
        offered = start_rate
        for _ in range(max_steps):
            rate.value = offered / hosts
            held, growth, acked_rate = _held(monitor.run_for(step_s), offered)
            steps.append((offered, held, growth, acked_rate))
            if not held:
                break
            sustained = offered
            offered *= STEP_GROWTH
        if sustained is None:  # not even the first step held: the hold runs below what was acknowledged
            sustained = 0.8 * steps[0][3]
        ramp_s = time.monotonic() - started
        # the hold, from the last rate that held, for the run's length; first let the ramp's backlog drain. A rate
        # that holds for a step may not for minutes (the parts pile up, other work takes the cores), so every window
        # the rate steps down 10% where the backlog grew or stands above a few seconds of traffic, else up 3%
        rate.value = sustained / hosts
        monitor.run_for(1.0 if quick else 10.0)
        store_cpu = _ticks(store_pid) if store_pid else 0.0
        sender_cpu = [_ticks(p.pid) for p in processes]
        hold, offered, rates = [], sustained, []
        window_s = 1.0 if quick else 30.0
        for _ in range(max(1, round(hold_s / window_s))):
            rate.value = offered / hosts
            window = monitor.run_for(window_s)
            hold += window if not hold else window[1:]
            rates.append((window[0][0], window[-1][0], offered))
            growth = _slope([(t, rows) for t, rows, *_ in window])
            standing = window[-1][1] > MAX_GROUP_ROWS + 3 * offered
            offered *= 0.9 if growth > 0.01 * offered or standing else 1.03
        hold_start, hold_end = hold[0][0], hold[-1][0]
        sender_cores = sum(_ticks(p.pid) - c for p, c in zip(processes, sender_cpu)) / (hold_end - hold_start)
        store_cores = (_ticks(store_pid) - store_cpu) / (hold_end - hold_start) if store_pid else None
        stop.set()
        records: dict[int, list] = {}
        protocols: dict[int, str] = {}
        retries = 0
        for _ in processes:
            protocol, got, retried = results.get(timeout=120)
            retries += retried
            records.update(got)
            protocols.update(dict.fromkeys(got, protocol))
        for p in processes:
            p.join(timeout=60)
        # the spool drains into the store
        drain_start, deadline = time.monotonic(), time.monotonic() + 600
        while monitor.sample()[1] > 0 and time.monotonic() < deadline:
            time.sleep(0.2)
        drain_s = time.monotonic() - drain_start
        peak_rss = max(monitor.peak_rss, _status_mib(agent.process.pid, "VmHWM"))
        agent.stop()
    finally:
        stop.set()
        for p in processes:
            if p.is_alive():
                p.kill()
        if agent.process.poll() is None:
            agent.process.kill()
    with open_store(dsn, create_schema=False) as store:
        stored = {
            key: (count, unique)
            for key, count, unique in store.client.query(
                "SELECT substring(SpanId, 1, 10) AS batch, count(), uniqExact(SpanId) FROM {db:Identifier}.otel_traces "
                "WHERE ServiceName = {service:String} GROUP BY batch",
                parameters={"db": store.database, "service": SERVICE},
            ).result_rows
        }
    # reconcile: every acknowledged span stored once, none twice
    missing = not_acked = 0
    acknowledged_keys = set()
    for host, sent in records.items():
        for batch, n, _, _, ok in sent:
            key = f"{host + 1:02x}{batch:08x}"  # the span IDs' first five bytes (see _host_spans)
            count, unique = stored.get(key, (0, 0))
            if ok:
                acknowledged_keys.add(key)
                missing += n - unique
            elif unique:
                not_acked += unique
    doubled = sum(count - unique for count, unique in stored.values())
    foreign = sum(unique for key, (_, unique) in stored.items() if key not in acknowledged_keys) - not_acked
    if missing or doubled or foreign:
        raise RuntimeError(
            f"{dsn}: acknowledged spans missing from the store: {missing}; stored more than once: "
            f"{doubled}; stored but never sent: {foreign}"
        )
    in_hold = [r for sent in records.values() for r in sent if hold_start <= r[2] < hold_end]
    acked_hold = [n for _, n, _, _, ok in in_hold if ok]
    hold_seconds = hold_end - hold_start
    agent_cores = (hold[-1][3] - hold[0][3]) / hold_seconds
    late = [s for s in hold if s[0] >= hold_start + hold_seconds / 2]  # the second half: the controller settled
    stored_rate = (sum(acked_hold) - (hold[-1][1] - hold[0][1])) / hold_seconds
    return {
        "hosts": hosts,
        "http": len(halves["http"]),
        "grpc": len(halves["grpc"]),
        "hold_s": hold_seconds,
        "ramp": ", ".join(f"{o:,.0f}{'' if h else ' (grew)'}" for o, h, *_ in steps),
        "ramp_s": ramp_s,
        "sustained": sum((b - a) * o for a, b, o in rates) / sum(b - a for a, b, _ in rates),
        "first": sustained,
        "last": rates[-1][2],
        "late_growth": _slope([(t, rows) for t, rows, *_ in late]),
        "retries": retries,
        "acked": sum(acked_hold) / hold_seconds,
        "stored": stored_rate,
        "growth": _slope([(t, rows) for t, rows, *_ in hold]),
        "high_bytes": max(s[2] for s in hold),
        "high_rows": max(s[1] for s in hold),
        "batch": statistics.fmean(acked_hold) if acked_hold else 0.0,
        "latencies": sorted(r[3] for r in in_hold if r[4]),
        "by_protocol": {
            p: sorted(
                r[3]
                for h, sent in records.items()
                if protocols[h] == p
                for r in sent
                if hold_start <= r[2] < hold_end and r[4]
            )
            for p in ("http", "grpc")
        },
        "agent_cores": agent_cores,
        "idle_cores": idle_cores,
        "store_cores": store_cores,
        "sender_cores": sender_cores,
        "peak_rss": peak_rss,
        "drain_s": drain_s,
        "failed": sum(1 for sent in records.values() for r in sent if not r[4]),
        "checked": sum(unique for unique in (u for _, u in stored.values())),
    }


def _ms(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, int(q * len(values)))] * 1000 if values else float("nan")


def _figures(r: dict, store: str) -> list[Figure]:
    figures = [
        Figure(
            f"{store}: offered rate over the hold, {r['hosts']} hosts ({r['http']} OTLP/HTTP, {r['grpc']} OTLP/gRPC, "
            f"official exporters), {r['hold_s']:.0f} s from {r['first']:,.0f} to {r['last']:,.0f} spans/s; ramp "
            f"{r['ramp']} spans/s in {r['ramp_s']:.0f} s",
            r["sustained"],
            "spans/s",
        ),
        Figure(f"{store}: spans acknowledged over the hold", r["acked"], "spans/s"),
        Figure(f"{store}: spans stored over the hold (acknowledged less the backlog's growth)", r["stored"], "spans/s"),
        Figure(
            f"{store}: acknowledged backlog's trend over the hold (spool rows, least squares)", r["growth"], "spans/s"
        ),
        Figure(f"{store}: acknowledged backlog's trend over the hold's second half", r["late_growth"], "spans/s"),
        Figure(
            f"{store}: spool high-water mark over the hold (acknowledged, not yet stored)",
            r["high_bytes"] / 2**20,
            "MiB",
        ),
        Figure(f"{store}: spool high-water mark over the hold, in spans", r["high_rows"], "spans"),
        Figure(
            f"{store}: ack latency p50, one export of {r['batch']:.0f} spans on average", _ms(r["latencies"], 0.5), "ms"
        ),
        Figure(f"{store}: ack latency p99", _ms(r["latencies"], 0.99), "ms"),
        Figure(f"{store}: ack latency p99, OTLP/HTTP hosts", _ms(r["by_protocol"]["http"], 0.99), "ms"),
        Figure(f"{store}: ack latency p99, OTLP/gRPC hosts", _ms(r["by_protocol"]["grpc"], 0.99), "ms"),
        Figure(
            f"{store}: agent CPU over the hold (receivers, spool"
            + (", embedded store)" if r["store_cores"] is None else "; the store is apart)"),
            r["agent_cores"],
            "cores",
        ),
    ]
    figures.append(Figure(f"{store}: agent CPU before any sender (its fixed cost)", r["idle_cores"], "cores"))
    if r["store_cores"] is not None:
        figures.append(Figure(f"{store}: store process CPU over the hold", r["store_cores"], "cores"))
    store_side = r["agent_cores"] if r["store_cores"] is None else r["store_cores"]
    return figures + [
        Figure(f"{store}: agent peak RSS (VmHWM)", r["peak_rss"], "MiB"),
        Figure(f"{store}: senders' CPU over the hold (competing for the same cores)", r["sender_cores"], "cores"),
        Figure(
            f"{store}: stored spans per core of the " + ("agent" if r["store_cores"] is None else "store process"),
            r["stored"] / store_side if store_side else float("nan"),
            "spans/s",
        ),
        Figure(f"{store}: spool drain after the senders stopped", r["drain_s"], "s"),
        Figure(f"{store}: exports that failed (not acknowledged)", r["failed"], "batches"),
        Figure(
            f"{store}: exporter retries over the run (503, UNAVAILABLE: spool full or requests in flight)",
            r["retries"],
            "retries",
        ),
        Figure(f"{store}: spans read back by span ID, every acknowledged one once", r["checked"], "spans"),
    ]


@benchmark("ingest")
def ingest(quick: bool) -> list[Figure]:
    hold_s = 4.0 if quick else float(os.environ.get("STAGETRACE_INGEST_SECONDS", "600"))
    server_hold_s = 3.0 if quick else float(os.environ.get("STAGETRACE_INGEST_SERVER_SECONDS", "120"))
    with tempfile.TemporaryDirectory(prefix="stagetrace-ingest-") as tmp:
        embedded = _run(Path(tmp) / "embedded", f"chdb://{tmp}/embedded/store", quick, hold_s)
        # a server store: ClickHouse's HTTP interface, answered by the engine in a process of its own
        port = _free_port()
        server = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.clickhouse_http", f"{tmp}/server", str(port)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            _wait_for(f"http://127.0.0.1:{port}/ping", server)
            remote = _run(
                Path(tmp) / "remote", f"http://default:@127.0.0.1:{port}/stagetrace", quick, server_hold_s, server.pid
            )
        finally:
            server.terminate()
            server.wait(timeout=30)
    return _figures(embedded, "embedded store") + _figures(remote, "server store (HTTP)")
