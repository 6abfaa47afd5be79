"""Pipelines already instrumented by their frameworks, read unchanged: real LlamaIndex, Haystack and LangChain apps
traced by their own instrumentors (OpenInference for LlamaIndex and Haystack, OpenLLMetry for LangChain), sending
with the official OTLP exporters over gRPC and HTTP to a running agent. No stagetrace code runs inside the apps
(``tests/apps/``); each is two "nodes" (processes with their own tracer provider and ``host.name``), one of which
serves from an index where one document was edited.

The class of case: a content change that reached one replica's index. What deviates is decided from the apps' own
answers (an edited node's answer that differs from the healthy node's answer to the same query), never from the
analysis; every such request must be listed by ``divergences`` with retrieval as its first divergent stage, and
the healthy node's requests must not diverge.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

APPS = Path(__file__).parent / "apps"
SYSFS = Path(__file__).parent / "fixtures" / "node" / "sys"
FRAMEWORKS = {
    "llamaindex_rag": ("llama_index.core", "openinference.instrumentation.llama_index"),
    "haystack_rag": ("haystack", "openinference.instrumentation.haystack"),
    "langchain_openllmetry_rag": ("langchain_core", "opentelemetry.instrumentation.langchain"),
}
EXPORTERS = ("opentelemetry.exporter.otlp.proto.grpc", "opentelemetry.exporter.otlp.proto.http")
ENV = {**os.environ, "STAGETRACE_HOST": "agent-node"}


def _need(*modules: str) -> None:
    missing = [m for m in modules if _absent(m)]
    if missing:
        message = f"not installed: {', '.join(missing)} (the test extra installs them)"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)


def _absent(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is None
    except ModuleNotFoundError:
        return True


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stagetrace(*args: str, store: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(
        [sys.executable, "-m", "stagetrace", *args, "--store", store],
        capture_output=True,
        text=True,
        env=ENV,
        timeout=180,
    )
    if check:
        assert done.returncode == 0, done.stderr
    return done


def start_agent(tmp_path: Path) -> tuple[subprocess.Popen, dict[str, str]]:
    ports = {"http": f"127.0.0.1:{free_port()}", "grpc": f"127.0.0.1:{free_port()}"}
    log = tmp_path / "agent.log"
    agent = subprocess.Popen(
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
            f"chdb://{tmp_path / 'store'}",
            "--listen",
            "127.0.0.1:0",
            "--otlp",
            ports["http"],
            "--otlp-grpc",
            ports["grpc"],
            "--query-listen",
            f"127.0.0.1:{free_port()}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=log.open("w"),
        env=ENV,
    )
    deadline = time.monotonic() + 60
    while not re.search(r"receiving OTLP/gRPC", log.read_text()) or "sharing the store" not in log.read_text():
        assert agent.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.2)
    return agent, ports


def run_node(app: str, host: str, protocol: str, endpoint: str, *, edited: bool = False, repeat: int = 1) -> list[dict]:
    args = [
        sys.executable,
        str(APPS / f"{app}.py"),
        "--host",
        host,
        "--protocol",
        protocol,
        "--endpoint",
        endpoint,
        "--repeat",
        str(repeat),
        *(["--edited"] if edited else []),
    ]
    done = subprocess.run(
        args,
        capture_output=True,
        text=True,
        cwd=APPS,
        timeout=300,
        env={k: v for k, v in os.environ.items() if not k.startswith("OTEL_")},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return [json.loads(line) for line in done.stdout.splitlines()]


def wait_for_trace(request_id: str, store: str) -> dict:
    """The trace once the agent has written it (it answers the exporter before its queue reaches the store)."""
    deadline = time.monotonic() + 60
    while True:
        done = stagetrace("trace", request_id, "--json", store=store, check=False)
        if done.returncode == 0:
            return json.loads(done.stdout)
        assert time.monotonic() < deadline, done.stderr
        time.sleep(0.5)


def expected_deviating(healthy: list[dict], edited: list[dict]) -> set[str]:
    answers = {r["query"]: r["answer"] for r in healthy}
    assert len({(r["query"], r["answer"]) for r in healthy}) == len(answers), "the healthy node must be deterministic"
    return {r["trace_id"] for r in edited if r["answer"] != answers[r["query"]]}


def copy_spans(source_dsn: str, target_dsn: str, tmp_path: Path) -> None:
    """Write the stored spans into another store's otel_traces with a plain INSERT, as the Collector's
    clickhouseexporter does: nothing of stagetrace's write path, only the store's own views derive the rest."""
    rows = tmp_path / "otel_traces.jsonl"
    dump = (
        "from stagetrace.store import open_store; import sys\n"
        "with open_store(sys.argv[1]) as s:\n"
        "    sys.stdout.buffer.write(s.client.raw_query('SELECT * FROM stagetrace.otel_traces FORMAT JSONEachRow'))"
    )
    with rows.open("wb") as out:
        subprocess.run([sys.executable, "-c", dump, source_dsn], stdout=out, check=True, timeout=120, env=ENV)
    load = (
        "from stagetrace.store import open_store; import sys\n"
        "with open_store(sys.argv[1]) as s:\n"
        "    s.client.raw_insert('stagetrace.otel_traces', insert_block=open(sys.argv[2], 'rb').read(), fmt='JSONEachRow')"
    )
    subprocess.run([sys.executable, "-c", load, target_dsn, str(rows)], check=True, timeout=120, env=ENV)


@pytest.mark.parametrize("app", sorted(FRAMEWORKS))
def test_an_edited_index_on_one_node_is_found_in_retrieval(app, tmp_path):
    _need(*FRAMEWORKS[app], *EXPORTERS)
    agent, ports = start_agent(tmp_path)
    store = f"chdb://{tmp_path / 'store'}"  # the agent holds it: the commands read through its query endpoint
    try:
        healthy = run_node(app, "node-a", "grpc", ports["grpc"], repeat=2)
        edited = run_node(app, "node-b", "http", ports["http"], edited=True)
        for request in (healthy[-1], edited[-1]):
            wait_for_trace(request["trace_id"], store)
        deviating = expected_deviating(healthy, edited)
        assert deviating, "the edited document must change some answers, or the test proves nothing"

        trace = wait_for_trace(edited[0]["trace_id"], store)
        stages = {s["stage"] for s in trace["spans"] if s["stage"]}
        assert {"retrieval", "context_assembly", "decode"} <= stages
        assert {s["host"] for s in trace["spans"]} == {"node-b"}

        found = json.loads(stagetrace("divergences", "--since", "1h", "--json", store=store).stdout)
        listed = {r["request_id"]: r for g in found["groups"] for r in g["deviating"]}
        assert set(listed) == deviating
        assert {r["first_divergent_stage"] for r in listed.values()} == {"retrieval"}

        explained = json.loads(stagetrace("explain", sorted(deviating)[0], "--json", store=store).stdout)
        assert explained["diverged"] is True
        assert explained["first_divergent_stage"] == "retrieval"
        assert not explained["stage_input_differed"]
        for request in healthy[:2]:
            assert (
                json.loads(stagetrace("explain", request["trace_id"], "--json", store=store).stdout)["diverged"]
                is False
            )
    finally:
        agent.send_signal(signal.SIGTERM)
        assert agent.wait(timeout=60) == 0

    # The same spans written straight into otel_traces, as the OpenTelemetry Collector writes them, read alike.
    collector_dsn = f"chdb://{tmp_path / 'collector-store'}"
    copy_spans(store, collector_dsn, tmp_path)
    for request_id in (sorted(deviating)[0], healthy[0]["trace_id"]):
        again = json.loads(stagetrace("explain", request_id, "--json", store=collector_dsn).stdout)
        first = json.loads(stagetrace("explain", request_id, "--json", store=store).stdout)
        for key in ("diverged", "first_divergent_stage", "input_digest", "output_digest"):
            assert again.get(key) == first.get(key), key
