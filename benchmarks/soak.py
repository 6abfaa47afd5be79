"""Soak: a ``stagetrace agent`` under steady OTLP span load while it collects the fixture node, loopback only.

The agent runs as its own process (every collector on the committed fixture node, samples written every
second, OTLP on 127.0.0.1), a sender posts protobuf batches of spans at a fixed rate over keep-alive HTTP,
and the agent's RSS is read from ``/proc/<pid>/status`` every second. Memory is flat when the RSS of the
last quarter of the run is not above the second quarter by more than the engine's caches settle to.
Afterwards the spans in the store are counted: every span the agent answered 200 for must be there.
``STAGETRACE_SOAK_SECONDS`` lengthens the full run (default 120 s; quick mode: 8 s).
"""

from __future__ import annotations

import http.client
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue

from benchmarks import Figure, benchmark
from benchmarks.collection import _flags, _whole_node
from stagetrace.store import open_store

SPANS_PER_BATCH = 200
STAGES = ("retrieval", "cache", "context_assembly", "allreduce", "decode")


def _batch(number: int) -> bytes:
    """One OTLP request: ``SPANS_PER_BATCH`` stage spans with fresh IDs and the attributes a pipeline sends."""
    request = ExportTraceServiceRequest()
    resource_spans = request.resource_spans.add()
    resource_spans.resource.attributes.extend(
        [
            KeyValue(key="service.name", value=AnyValue(string_value="soak")),
            KeyValue(key="host.name", value=AnyValue(string_value="bench")),
        ]
    )
    spans = resource_spans.scope_spans.add().spans
    now = time.time_ns()
    for i in range(SPANS_PER_BATCH):
        span = spans.add(
            trace_id=os.urandom(16),
            span_id=os.urandom(8),
            name="stage",
            kind=1,
            start_time_unix_nano=now,
            end_time_unix_nano=now + 1_000_000,
        )
        span.attributes.extend(
            [
                KeyValue(key="stagetrace.request.id", value=AnyValue(string_value=f"soak-{number}-{i}")),
                KeyValue(key="stagetrace.stage", value=AnyValue(string_value=STAGES[i % len(STAGES)])),
                KeyValue(key="stagetrace.stage.output_digest", value=AnyValue(string_value=os.urandom(16).hex())),
                KeyValue(key="decode.tokens", value=AnyValue(int_value=i)),
            ]
        )
    return request.SerializeToString()


def _rss_mib(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmRSS:\s+(\d+) kB", status)[1]) / 1024


class _Sender(threading.Thread):
    """Posts one batch every ``period_s`` until stopped; counts the spans answered 200 and the 503s."""

    def __init__(self, host: str, port: int, period_s: float):
        super().__init__(daemon=True)
        self.host, self.port, self.period_s = host, port, period_s
        self.stop = threading.Event()
        self.accepted = self.refused = self.failed = 0

    def run(self) -> None:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=30)
        due, number = time.monotonic(), 0
        while not self.stop.is_set():
            body = _batch(number)
            number += 1
            try:
                conn.request("POST", "/v1/traces", body, {"Content-Type": "application/x-protobuf"})
                response = conn.getresponse()
                response.read()
            except OSError:
                self.failed += 1
                conn.close()
                conn = http.client.HTTPConnection(self.host, self.port, timeout=30)
                continue
            if response.status == 200:
                self.accepted += SPANS_PER_BATCH
            else:
                self.refused += 1
            due += self.period_s
            self.stop.wait(max(0.0, due - time.monotonic()))
        conn.close()


def _mean_rss(samples: list[tuple[float, float]], start: float, end: float) -> float:
    """Mean RSS over [start, end) seconds: single samples swing with the engine's merges, means do not."""
    window = [rss for t, rss in samples if start <= t < end]
    return statistics.fmean(window) if window else samples[-1][1]


@benchmark("soak")
def soak(quick: bool) -> list[Figure]:
    duration_s = 8.0 if quick else float(os.environ.get("STAGETRACE_SOAK_SECONDS", "120"))  # longer soaks on demand
    spans_per_s = 1000 if quick else 2000
    names, options = _whole_node()
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "agent.log"
        dsn = f"chdb://{tmp}/store"
        agent = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "stagetrace",
                "agent",
                "--store",
                dsn,
                "--listen",
                "127.0.0.1:0",
                "--interval",
                "1s",
                "--otlp",
                "127.0.0.1:0",
                "--otlp-grpc",
                "127.0.0.1:0",
                "--query-listen",
                "none",
                "--collectors",
                ",".join(names),
                *_flags(options),
            ],
            stdout=subprocess.DEVNULL,
            stderr=log.open("w"),
            env={**os.environ, "STAGETRACE_HOST": "bench", "STAGETRACE_SPOOL_DIR": str(Path(tmp) / "spool")},
        )
        try:
            deadline = time.monotonic() + 60
            while not (found := re.search(r"receiving OTLP/HTTP at http://([\d.]+):(\d+)/", log.read_text())):
                if agent.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the agent did not start: {log.read_text()[-500:]}")
                time.sleep(0.1)
            sender = _Sender(found[1], int(found[2]), SPANS_PER_BATCH / spans_per_s)
            started = time.monotonic()
            sender.start()
            samples = []
            while (elapsed := time.monotonic() - started) < duration_s:
                samples.append((elapsed, _rss_mib(agent.pid)))
                time.sleep(1.0)
            sender.stop.set()
            sender.join(timeout=30)
        finally:
            agent.send_signal(signal.SIGTERM)
            status = agent.wait(timeout=120)
        if status != 0:
            raise RuntimeError(f"the agent exited {status}: {log.read_text()[-500:]}")
        with open_store(dsn) as store:
            stored = int(store.client.command("SELECT count() FROM stagetrace.otel_traces WHERE ServiceName = 'soak'"))
            sampled = int(store.client.command("SELECT count() FROM stagetrace.otel_metrics_gauge"))
    # the second quarter (past start-up and the first inserts) against the last one
    early = _mean_rss(samples, duration_s / 4, duration_s / 2)
    third = _mean_rss(samples, duration_s / 2, duration_s * 3 / 4)
    late = _mean_rss(samples, duration_s * 3 / 4, duration_s + 1)
    if stored < sender.accepted:
        raise RuntimeError(f"{sender.accepted} spans were accepted but only {stored} are in the store")
    return [
        Figure(
            f"agent mean RSS, 2nd quarter (OTLP {spans_per_s} spans/s + all collectors every 1 s, {duration_s:g} s)",
            early,
            "MiB",
        ),
        Figure("agent mean RSS, 3rd quarter", third, "MiB"),
        Figure("agent mean RSS, last quarter", late, "MiB"),
        Figure("agent RSS growth, last quarter over 2nd quarter", late - early, "MiB"),
        Figure("agent peak RSS", max(r for _, r in samples), "MiB"),
        Figure("spans accepted (200) and found in the store", stored, "spans"),
        Figure("OTLP requests refused (503) or failed", sender.refused + sender.failed, "requests"),
        Figure("metric gauge samples written by the agent", sampled, "rows"),
    ]
