"""The agent protects the node it runs on: limits on its query endpoint, and bounds on its OTLP receiver.

Real ``stagetrace agent`` processes (tests/test_hub.py's ``Agent``) holding real embedded stores, queried
through ``clickhouse_connect.get_client`` and raw HTTP; the agent's CPU is read from ``/proc/<pid>/stat``.
The runaway query is the one that ran for 20+ minutes before: ``count()`` over 10^11 ``sipHash64``s.
"""

from __future__ import annotations

import http.client
import os
import signal
import threading
import time
import urllib.error
import urllib.parse
import urllib.request

import clickhouse_connect
import pytest
from clickhouse_connect.driver.exceptions import DatabaseError

from tests.test_hub import Agent, send_request, trace_json

RUNAWAY = "SELECT count() FROM numbers(100000000000) WHERE sipHash64(number) = 1"
TICKS = os.sysconf("SC_CLK_TCK")


@pytest.fixture(scope="module")
def limited(tmp_path_factory):
    """An agent whose queries may run 2 s and use 64 MiB."""
    running = Agent(tmp_path_factory.mktemp("limited"), "--query-timeout", "2s", "--query-max-memory", "64MiB")
    yield running
    running.stop()


@pytest.fixture
def patient(tmp_path):
    """An agent whose queries may run 10 minutes, two in flight at once: only disconnects and SIGTERM end them."""
    running = Agent(tmp_path, "--query-timeout", "10m", "--query-max-concurrent", "2")
    yield running
    if running.process.poll() is None:
        running.stop()


def client_for(agent: Agent):
    return clickhouse_connect.get_client(
        host="127.0.0.1", port=agent.query_port, connect_timeout=5, send_receive_timeout=60
    )


def cpu_seconds(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime, stime


def cpu_share(pid: int, seconds: float = 1.0) -> float:
    """Cores the process used over the next ``seconds``."""
    before = cpu_seconds(pid)
    time.sleep(seconds)
    return (cpu_seconds(pid) - before) / seconds


def start_query(agent: Agent, sql: str = RUNAWAY) -> http.client.HTTPConnection:
    connection = http.client.HTTPConnection("127.0.0.1", agent.query_port, timeout=600)
    connection.request("POST", "/", body=sql.encode())
    return connection


def test_a_runaway_query_stops_at_the_time_limit_with_clickhouse_s_error(limited):
    started = time.monotonic()
    with pytest.raises(DatabaseError, match=r"Code: 159\..*TIMEOUT_EXCEEDED"):
        client_for(limited).command(RUNAWAY)
    assert time.monotonic() - started < 10


def test_a_query_over_the_memory_limit_fails_with_clickhouse_s_error(limited):
    with pytest.raises(DatabaseError, match=r"Code: 241\..*MEMORY_LIMIT_EXCEEDED"):
        client_for(limited).command("SELECT length(groupArray(toString(number))) FROM numbers(50000000)")


def test_the_client_cannot_raise_a_limit(limited):
    # a setting as a URL parameter (clickhouse-connect would not even send it: the session says it is readonly)
    query = urllib.parse.urlencode({"query": RUNAWAY, "max_execution_time": "1000"})
    started = time.monotonic()
    with pytest.raises(urllib.error.HTTPError) as stopped:
        urllib.request.urlopen(f"{limited.endpoints['query']}/?{query}", timeout=60)
    assert b"TIMEOUT_EXCEEDED" in stopped.value.read() and time.monotonic() - started < 10
    # a SETTINGS clause is refused by the engine's readonly session
    with pytest.raises(DatabaseError, match=r"Code: 164\..*READONLY"):
        client_for(limited).command(f"{RUNAWAY} SETTINGS max_execution_time = 1000")


def test_a_client_that_disconnects_frees_the_agent_s_cpu_within_a_second(patient):
    connection = start_query(patient)
    time.sleep(1.5)
    assert cpu_share(patient.process.pid) > 0.5  # the query burns CPU while its client waits
    connection.sock.shutdown(2)
    connection.close()
    time.sleep(1.0)
    assert cpu_share(patient.process.pid) < 0.2  # cancelled: the agent is idle again


def test_the_concurrent_query_cap_answers_503_while_metrics_and_otlp_keep_answering(patient):
    running = [start_query(patient) for _ in range(2)]
    time.sleep(1.0)
    query = urllib.parse.urlencode({"query": "SELECT 1"})
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(f"{patient.endpoints['query']}/?{query}", timeout=10)
    assert refused.value.code == 503 and refused.value.headers["Retry-After"] == "1"
    assert refused.value.headers["X-ClickHouse-Exception-Code"] == "202"
    assert b"TOO_MANY_SIMULTANEOUS_QUERIES" in refused.value.read()
    started = time.monotonic()
    with urllib.request.urlopen(f"{patient.endpoints['metrics']}/metrics", timeout=10) as response:
        assert response.status == 200 and b"stagetrace_collector_success" in response.read()
    send_request(patient.endpoints["otlp"], "during-runaway")  # answered 200 (raises otherwise)
    assert time.monotonic() - started < 5
    for connection in running:
        connection.sock.shutdown(2)
        connection.close()
    # the disconnected queries end within a second (the test above), not at once: until then the cap still answers 503
    deadline = time.monotonic() + 5
    while True:
        try:
            urllib.request.urlopen(f"{patient.endpoints['query']}/?{query}", timeout=10).close()
            break
        except urllib.error.HTTPError as busy:
            assert busy.code == 503 and time.monotonic() < deadline
            time.sleep(0.1)
    assert trace_json("during-runaway", patient.dsn)["request_id"] == "during-runaway"


def test_sigterm_during_a_running_query_stops_the_agent_within_its_grace_period(patient):
    connection = start_query(patient)
    time.sleep(1.5)
    started = time.monotonic()
    patient.process.send_signal(signal.SIGTERM)
    assert patient.process.wait(timeout=15) == 0
    assert time.monotonic() - started < 15
    assert "Traceback" not in patient.log.read_text()
    connection.close()


def test_an_otlp_flood_is_bounded_every_request_answered_200_or_503_and_every_200_stored(limited):
    """40 senders at once against at most 8 requests in flight: each answer is 200 or 503 with Retry-After, the
    agent stays up, and what was answered 200 is stored."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    answers: dict[str, int] = {}

    def send(n: int) -> None:
        request = ExportTraceServiceRequest()
        scope = request.resource_spans.add().scope_spans.add()
        for k in range(2000):  # about 100 KB a request
            span = scope.spans.add(
                name=f"flood-{n}", trace_id=(n + 1).to_bytes(16, "big"), span_id=(n * 2000 + k + 1).to_bytes(8, "big")
            )
            span.attributes.add(key="payload", value={"string_value": "x" * 32})
        post = urllib.request.Request(
            f"{limited.endpoints['otlp']}/v1/traces",
            data=request.SerializeToString(),
            headers={"Content-Type": "application/x-protobuf"},
            method="POST",
        )
        try:
            with urllib.request.urlopen(post, timeout=60) as response:
                answers[f"flood-{n}"] = response.status
        except urllib.error.HTTPError as exc:
            answers[f"flood-{n}"] = exc.code
            assert exc.code != 503 or exc.headers["Retry-After"]

    senders = [threading.Thread(target=send, args=(n,)) for n in range(40)]
    for thread in senders:
        thread.start()
    for thread in senders:
        thread.join(timeout=120)
    assert len(answers) == 40 and set(answers.values()) <= {200, 503}, answers
    assert limited.process.poll() is None
    stored = [name for name, status in answers.items() if status == 200]
    client = client_for(limited)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        found = client.command(
            "SELECT uniqExact(SpanName) FROM stagetrace.otel_traces WHERE startsWith(SpanName, 'flood-')"
        )
        if found >= len(stored):
            break
        time.sleep(0.5)
    assert found == len(stored) and stored


def test_with_an_embedded_store_the_agent_and_its_engine_threads_run_at_low_priority(limited):
    pid = limited.process.pid
    nices = {}
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            name = open(f"/proc/{pid}/task/{task}/comm").read().strip()
            stat = open(f"/proc/{pid}/task/{task}/stat").read()
        except FileNotFoundError:  # the engine's short-lived worker threads may end between listing and reading
            continue
        nices[f"{name}/{task}"] = int(stat.rsplit(")", 1)[1].split()[16])
    # every thread, Python's and the engine's, but the engine's MemoryWorker: ClickHouse raises its priority
    # itself (as root it can), so that memory accounting stays current
    lowered = {thread: nice for thread, nice in nices.items() if not thread.startswith("MemoryWorker/")}
    assert len(lowered) > 5 and min(lowered.values()) >= 10, nices
    assert "running at low priority: nice 10" in limited.log.read_text()
