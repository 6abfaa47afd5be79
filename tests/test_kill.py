"""No acknowledged span lost, none stored twice: real processes, real ``kill -9``, the official OTLP exporters.

The agent (``stagetrace agent`` as a user runs it) is killed at random moments under steady OTLP/HTTP and
OTLP/gRPC load and started again on the same store and ports; an application process exporting with
``ClickHouseSpanExporter`` is killed the same way; the quickstart runs while the agent holds its store.
Every span a sender was told was taken (``SUCCESS`` from an exporter) must be stored exactly once.
"""

import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SpanExportResult
from tests.agents import spooled
from tests.test_agent import ENV, SYSFS, free_port, wait_for

from stagetrace.store import open_store

ROOT = Path(__file__).resolve().parents[1]
KILLS = 20


class Agent:
    """``stagetrace agent`` on fixed loopback ports, so senders keep their endpoints across restarts."""

    def __init__(self, tmp_path: Path, query: bool = False):
        self.tmp_path = tmp_path
        self.store = tmp_path / "store"
        self.http, self.grpc = free_port(), free_port()
        self.query = f"127.0.0.1:{free_port()}" if query else "none"
        self.process: subprocess.Popen | None = None
        self.starts = 0

    def start(self) -> None:
        self.starts += 1
        log = self.tmp_path / f"agent-{self.starts}.log"
        self.process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "stagetrace",
                "agent",
                "--collectors",
                "rdma",
                "--sysfs",
                str(SYSFS),
                "--store",
                f"chdb://{self.store}",
                "--listen",
                "127.0.0.1:0",
                "--interval",
                "1s",
                "--otlp",
                f"127.0.0.1:{self.http}",
                "--otlp-grpc",
                f"127.0.0.1:{self.grpc}",
                "--query-listen",
                self.query,
            ],
            stdout=subprocess.DEVNULL,
            stderr=log.open("w"),
            env=ENV,
        )
        wait_for(
            "the agent's OTLP/gRPC line",
            lambda: "receiving OTLP/gRPC" in log.read_text(),
            timeout=60,
            process=self.process,
        )

    def kill(self) -> None:
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=30)

    def stop(self) -> str:
        self.process.send_signal(signal.SIGTERM)
        assert self.process.wait(timeout=60) == 0
        return (self.tmp_path / f"agent-{self.starts}.log").read_text()


def span_counts(dsn: str) -> dict[str, int]:
    with open_store(dsn) as store:
        return dict(
            store.client.query("SELECT SpanId, count() FROM stagetrace.otel_traces GROUP BY SpanId").result_rows
        )


class Sender(threading.Thread):
    """Sends batches of new spans through one official exporter until told to stop; a batch is sent again until
    the exporter says SUCCESS (the SDK itself gives up after its timeout), and only then counts as acknowledged."""

    def __init__(self, exporter, name: str, stop: threading.Event):
        super().__init__(name=name, daemon=True)
        self.exporter, self.stop = exporter, stop
        self.tracer = TracerProvider(resource=Resource.create({"service.name": name})).get_tracer("load")
        self.acknowledged: list[str] = []
        self.attempts = 0

    def run(self) -> None:
        while not self.stop.is_set():
            batch = []
            for _ in range(20):
                span = self.tracer.start_span("load")
                span.end()
                batch.append(span)
            while self.exporter.export(batch) is not SpanExportResult.SUCCESS:
                self.attempts += 1
                time.sleep(0.05)
            self.acknowledged += [f"{s.context.span_id:016x}" for s in batch]


def test_every_span_acknowledged_through_twenty_kills_of_the_agent_is_stored_exactly_once(tmp_path, caplog):
    agent = Agent(tmp_path)
    agent.start()
    stop = threading.Event()
    senders = [
        Sender(HttpExporter(endpoint=f"http://127.0.0.1:{agent.http}/v1/traces", timeout=5), "http", stop),
        Sender(GrpcExporter(endpoint=f"http://127.0.0.1:{agent.grpc}", insecure=True, timeout=5), "grpc", stop),
    ]
    for sender in senders:
        sender.start()
    rng = random.Random(15)
    try:
        for _ in range(KILLS):
            time.sleep(rng.uniform(0.2, 1.2))  # a random moment of steady load
            agent.kill()
            agent.start()
        time.sleep(1.0)
    finally:
        stop.set()
        for sender in senders:
            sender.join(timeout=60)
    wait_for("the spool to drain", lambda: not spooled(agent.store), timeout=60)
    log = agent.stop()
    assert "Traceback" not in log, log
    counts = span_counts(f"chdb://{agent.store}")
    acknowledged = [span_id for sender in senders for span_id in sender.acknowledged]
    assert all(len(sender.acknowledged) > 200 for sender in senders), [len(s.acknowledged) for s in senders]
    # the kills were felt: an export failed, or the exporters' own retries met a refused or closed connection
    retried = [
        r for r in caplog.records if r.name.startswith("opentelemetry.exporter") and "Transient error" in r.getMessage()
    ]
    assert sum(sender.attempts for sender in senders) + len(retried) > 0
    assert {span_id: counts.get(span_id) for span_id in acknowledged} == dict.fromkeys(acknowledged, 1)
    assert set(counts.values()) == {1}  # not even a span sent but never acknowledged is stored twice


_APP = """
import sys
from opentelemetry.sdk.trace import TracerProvider
from stagetrace.exporters.clickhouse import ClickHouseSpanExporter

exporter = ClickHouseSpanExporter(store=sys.argv[1])
tracer = TracerProvider().get_tracer("app")
while True:
    batch = []
    for _ in range(50):
        span = tracer.start_span("app")
        span.end()
        batch.append(span)
    if exporter.export(batch).name == "SUCCESS":
        print(" ".join(f"{s.context.span_id:016x}" for s in batch), flush=True)
"""


def test_every_span_an_application_process_was_told_success_for_survives_kill_9(tmp_path):
    dsn = f"chdb://{tmp_path / 'store'}"
    acknowledged: list[str] = []
    rng = random.Random(3)
    for _ in range(5):
        app = subprocess.Popen(
            [sys.executable, "-c", _APP, dsn], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT
        )
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.extend(app.stdout), daemon=True)
        reader.start()
        wait_for("the first acknowledged batch", lambda: lines, timeout=60, process=app)
        time.sleep(rng.uniform(0.1, 0.8))
        app.send_signal(signal.SIGKILL)
        app.wait(timeout=30)
        reader.join(timeout=10)
        acknowledged += [span_id for line in lines if line.endswith("\n") for span_id in line.split()]
    counts = span_counts(dsn)
    assert len(acknowledged) > 500
    assert {span_id: counts.get(span_id) for span_id in acknowledged} == dict.fromkeys(acknowledged, 1)
    assert set(counts.values()) == {1}


def test_the_quickstart_against_a_store_the_agent_holds_lands_every_span(tmp_path):
    agent = Agent(tmp_path, query=True)
    agent.start()
    env = {**ENV, "STAGETRACE_STORE": f"chdb://{agent.store}"}
    try:
        run = subprocess.run(
            [sys.executable, ROOT / "examples" / "quickstart.py"],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
            cwd=tmp_path,
        )
        assert run.returncode == 0, run.stderr
        assert "could not" not in run.stderr and "handed to the agent" in run.stderr, run.stderr

        def found():
            looked_up = subprocess.run(
                [sys.executable, "-m", "stagetrace", "trace", "quickstart-0003", "--json"],
                capture_output=True,
                text=True,
                env=env,
                timeout=60,
            )
            return looked_up.returncode == 0 and json.loads(looked_up.stdout)

        doc = wait_for("the quickstart's last request through the agent", found, timeout=30)
        assert [s["stage"] for s in doc["spans"]] == [
            None,
            "retrieval",
            "cache",
            "context_assembly",
            "allreduce",
            "allreduce",
            "decode",
        ]
    finally:
        agent.stop()
    counts = span_counts(f"chdb://{agent.store}")
    assert sum(counts.values()) == 21 and set(counts.values()) == {1}  # 3 requests × 7 spans, each once
    assert not spooled(agent.store) and not os.listdir(Path(f"{agent.store}.spool") / "spans" / "inbox")


def test_an_agent_restarted_after_kill_9_starts_cleanly(tmp_path):
    """A restart after kill -9 finds the store lock, the agent record and the spool of the dead process."""
    agent = Agent(tmp_path)
    agent.start()
    agent.kill()
    agent.start()
    log = agent.stop()
    assert "Traceback" not in log and re.search(r"receiving OTLP/HTTP", log), log
