"""OTLP logs into the Collector's ``otel_logs``, beside the trace they belong to.

A real `stagetrace agent` takes log records from the official OTLP log exporters (HTTP and gRPC) of an application
whose Python ``logging`` lines are bridged by the OpenTelemetry SDK inside a request's span: `stagetrace trace`
shows them with the request, bodies as they were sent. `--otlp-logs none` refuses them. Log records go through the
same durable write path as spans: through kills of the agent, every acknowledged record is stored exactly once.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import random
import signal
import sys
import threading
import time
import urllib.error
from datetime import datetime, timedelta, timezone
import urllib.request
from pathlib import Path

import grpc
from opentelemetry.exporter.otlp.proto.grpc._log_exporter import OTLPLogExporter as GrpcLogExporter
from opentelemetry.exporter.otlp.proto.http._log_exporter import OTLPLogExporter as HttpLogExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.logs.v1 import logs_service_pb2
from opentelemetry.sdk._logs import LoggerProvider, LoggingHandler
from opentelemetry.sdk._logs.export import InMemoryLogRecordExporter, LogRecordExportResult, SimpleLogRecordProcessor
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.trace import SpanKind

from stagetrace.dashboards import trace_lookup
from tests.grafana_macros import QueryContext, Variable, expand
from stagetrace.store import open_store

_spec = importlib.util.spec_from_file_location("stagetrace_tests_agents", Path(__file__).with_name("agents.py"))
agents = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = agents
_spec.loader.exec_module(agents)


def wait_for(what: str, condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.2)


def bridged_logger(provider: LoggerProvider, name: str) -> logging.Logger:
    """A Python logger whose lines the SDK turns into log records, with the current span's context."""
    logger = logging.getLogger(name)
    logger.propagate = False
    logger.setLevel(logging.INFO)
    logger.addHandler(LoggingHandler(level=logging.INFO, logger_provider=provider))
    return logger


def test_an_engines_log_lines_sit_beside_the_request_they_belong_to(tmp_path):
    agent = agents.Agent(tmp_path)
    try:
        resource = Resource.create({"service.name": "vllm", "host.name": "gpu-a"})
        tracer_provider = TracerProvider(resource=resource)
        tracer_provider.add_span_processor(
            SimpleSpanProcessor(OTLPSpanExporter(f"{agent.endpoints['otlp']}/v1/traces"))
        )
        logs_http, logs_grpc = LoggerProvider(resource=resource), LoggerProvider(resource=resource)
        logs_http.add_log_record_processor(
            SimpleLogRecordProcessor(HttpLogExporter(f"{agent.endpoints['otlp']}/v1/logs"))
        )
        logs_grpc.add_log_record_processor(
            SimpleLogRecordProcessor(GrpcLogExporter(endpoint=f"http://{agent.endpoints['otlp_grpc']}", insecure=True))
        )
        over_http, over_grpc = bridged_logger(logs_http, "engine.http"), bridged_logger(logs_grpc, "engine.grpc")
        tracer = tracer_provider.get_tracer("engine")
        with tracer.start_as_current_span(
            "llm_request", kind=SpanKind.SERVER, attributes={"gen_ai.request.id": "req-logged"}
        ):
            over_http.warning("preempted: KV cache full, 3 sequences swapped")
            with tracer.start_as_current_span("decode", attributes={"stagetrace.stage": "decode"}):
                over_grpc.error("CUDA graph replay fell back to eager mode")
        over_http.info("idle")  # outside any request: no trace
        tracer_provider.shutdown()
        logs_http.shutdown()
        logs_grpc.shutdown()

        def traced() -> dict:
            done = agents.stagetrace("trace", "req-logged", "--json", "--store", agent.dsn)
            return json.loads(done.stdout) if done.returncode == 0 else {}

        wait_for("the request and its two log lines", lambda: len(traced().get("logs", [])) == 2)
        doc = traced()
        by_body = {line["body"]: line for line in doc["logs"]}
        spans = {s["name"]: s["span_id"] for s in doc["spans"]}
        assert by_body["preempted: KV cache full, 3 sequences swapped"]["severity"] == "WARN"
        assert by_body["preempted: KV cache full, 3 sequences swapped"]["span_id"] == spans["llm_request"]
        assert by_body["CUDA graph replay fell back to eager mode"]["span_id"] == spans["decode"]
        assert {line["service"] for line in doc["logs"]} == {"vllm"}
        text = agents.stagetrace("trace", "req-logged", "--store", agent.dsn).stdout
        assert "2 log lines of the request" in text and "preempted: KV cache full" in text
    finally:
        agent.stop()
    with open_store(agent.dsn) as store:  # the line outside a request is kept too, with no trace
        rows = store.client.query("SELECT TraceId, Body FROM stagetrace.otel_logs ORDER BY Timestamp").result_rows
        assert ("", "idle") in rows and len(rows) == 3
        # the trace lookup dashboard's Log lines panel, expanded as the data source does
        store.client.database = store.database
        sql = expand(
            trace_lookup.LOGS_SQL,
            QueryContext(datetime.now(timezone.utc) - timedelta(hours=1), datetime.now(timezone.utc), interval_ms=1000),
            {"request_id": Variable("req-logged")},
        )
        panel = store.client.query(sql).result_rows
    assert [(r[1], r[2]) for r in panel] == [
        ("preempted: KV cache full, 3 sequences swapped", "warn"),
        ("CUDA graph replay fell back to eager mode", "error"),
    ]


def test_otlp_logs_none_refuses_them_over_both_protocols(tmp_path):
    agent = agents.Agent(tmp_path, "--otlp-logs", "none")
    try:
        request = urllib.request.Request(
            f"{agent.endpoints['otlp']}/v1/logs",
            data=b"",
            method="POST",
            headers={"Content-Type": "application/x-protobuf"},
        )
        try:
            urllib.request.urlopen(request, timeout=10)
            raise AssertionError("logs were accepted")
        except urllib.error.HTTPError as exc:
            assert exc.code == 404 and b"--otlp-logs none" in exc.read()
        with grpc.insecure_channel(agent.endpoints["otlp_grpc"]) as channel:
            export = channel.unary_unary(
                "/opentelemetry.proto.collector.logs.v1.LogsService/Export",
                request_serializer=lambda m: m.SerializeToString(),
                response_deserializer=logs_service_pb2.ExportLogsServiceResponse.FromString,
            )
            try:
                export(logs_service_pb2.ExportLogsServiceRequest(), timeout=10)
                raise AssertionError("logs were accepted")
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.UNIMPLEMENTED and "--otlp-logs none" in exc.details()
    finally:
        agent.stop()


AGENT_LINES_SQL = """
SELECT SeverityText, SeverityNumber, Body, ResourceAttributes['host.name'], LogAttributes['code.namespace']
FROM stagetrace.otel_logs WHERE ServiceName = 'stagetrace-agent' ORDER BY Timestamp"""


def test_the_agents_own_lines_go_to_otel_logs_when_asked_and_only_then(tmp_path):
    asked = agents.Agent(tmp_path / "asked", "--agent-logs", "store")
    log = asked.stop()
    with open_store(asked.dsn) as store:
        rows = store.client.query(AGENT_LINES_SQL).result_rows
    bodies = [r[2] for r in rows]
    serving = next(r for r in rows if r[2].startswith("serving "))
    assert serving[:2] == ("INFO", 9) and serving[4] == "stagetrace.agent" and serving[3]
    assert bodies[-1] == "stopping"  # the last line, logged as the agent closes, is written before the store closes
    assert all(body in log for body in bodies)  # the same lines as its standard error, no other
    default = agents.Agent(tmp_path / "default")
    default.stop()
    with open_store(default.dsn) as store:
        assert store.client.query(AGENT_LINES_SQL).result_rows == []


class LogSender(threading.Thread):
    """Sends batches of new log records through one official exporter until told to stop; a batch is sent again
    until the exporter says SUCCESS, and only then counts as acknowledged."""

    def __init__(self, exporter, name: str, stop: threading.Event):
        super().__init__(name=name, daemon=True)
        self.exporter, self.stop, self.name_ = exporter, stop, name
        self.memory = InMemoryLogRecordExporter()
        provider = LoggerProvider(resource=Resource.create({"service.name": name}))
        provider.add_log_record_processor(SimpleLogRecordProcessor(self.memory))
        self.logger = bridged_logger(provider, f"load.{name}")
        self.acknowledged: list[str] = []
        self.sequence = 0

    def run(self) -> None:
        while not self.stop.is_set():
            bodies = []
            for _ in range(20):
                self.sequence += 1
                bodies.append(f"{self.name_}-{self.sequence}")
                self.logger.warning(bodies[-1])
            batch = self.memory.get_finished_logs()
            self.memory.clear()
            while self.exporter.export(batch) is not LogRecordExportResult.SUCCESS:
                time.sleep(0.05)
            self.acknowledged += bodies


def test_every_log_record_acknowledged_through_kills_of_the_agent_is_stored_exactly_once(tmp_path):
    from tests import test_kill  # the spans' kill test: its agent on fixed ports, restarted after each kill

    agent = test_kill.Agent(tmp_path)
    agent.start()
    stop = threading.Event()
    senders = [
        LogSender(HttpLogExporter(endpoint=f"http://127.0.0.1:{agent.http}/v1/logs", timeout=5), "http", stop),
        LogSender(GrpcLogExporter(endpoint=f"http://127.0.0.1:{agent.grpc}", insecure=True, timeout=5), "grpc", stop),
    ]
    for sender in senders:
        sender.start()
    rng = random.Random(31)
    try:
        for _ in range(5):
            time.sleep(rng.uniform(0.3, 1.0))
            agent.process.send_signal(signal.SIGKILL)
            agent.process.wait(timeout=30)
            agent.start()
        time.sleep(1.0)
    finally:
        stop.set()
        for sender in senders:
            sender.join(timeout=60)
    wait_for("the spool to drain", lambda: not agents.spooled(agent.store), timeout=60)
    agent.stop()
    with open_store(f"chdb://{agent.store}") as store:
        counts = dict(store.client.query("SELECT Body, count() FROM stagetrace.otel_logs GROUP BY Body").result_rows)
    acknowledged = [body for sender in senders for body in sender.acknowledged]
    assert all(len(sender.acknowledged) >= 40 for sender in senders), [len(s.acknowledged) for s in senders]
    assert {body: counts.get(body) for body in acknowledged} == dict.fromkeys(acknowledged, 1)
    assert set(counts.values()) == {1}
