"""The stage-span API: spans, digests, content opt-in, and context across threads and processes."""

import json
import subprocess
import sys
import threading

import pytest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

import stagetrace
from stagetrace import lookup
from stagetrace.exporters.clickhouse import ClickHouseSpanExporter
from stagetrace.store import open_store


def _by_name(memory):
    return {s.name: s for s in memory.get_finished_spans()}


def test_request_and_stages_follow_the_span_conventions(spans):
    with stagetrace.request("r-1", input={"prompt": "p", "seed": 3}, attributes={"gen_ai.request.model": "m"}) as req:
        with stagetrace.stage("retrieval", input="p", attributes={"retrieval.top_k": 4}) as st:
            st.set_output(["d1", "d2"])
        req.set_output("out")
    got = _by_name(spans)
    root, stage = got["inference.request"], got["stage.retrieval"]
    assert root.kind is SpanKind.SERVER and root.parent is None
    assert root.attributes["stagetrace.request.id"] == "r-1"
    assert root.attributes["stagetrace.input.digest"] == stagetrace.digest({"seed": 3, "prompt": "p"})
    assert root.attributes["stagetrace.output.digest"] == stagetrace.digest("out")
    assert root.attributes["gen_ai.request.model"] == "m"
    assert stage.parent.span_id == root.context.span_id and stage.kind is SpanKind.INTERNAL
    assert stage.attributes["stagetrace.stage"] == "retrieval"
    assert stage.attributes["stagetrace.stage.input_digest"] == stagetrace.digest("p")
    assert stage.attributes["stagetrace.stage.output_digest"] == stagetrace.digest(["d1", "d2"])
    assert "stagetrace.input.content" not in root.attributes  # digests only, by default


def test_content_is_recorded_only_when_asked(spans):
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    stagetrace.configure(tracer_provider=provider, record_content=True)
    with stagetrace.request("r-2", input="the prompt") as req:
        req.set_output({"text": "hi"})
    root = _by_name(spans)["inference.request"]
    assert root.attributes["stagetrace.input.content"] == "the prompt"
    assert json.loads(root.attributes["stagetrace.output.content"]) == {"text": "hi"}


def test_spans_lie_on_the_clock_they_are_configured_with(spans):
    """A simulation or a replay gives its own clock: requests and stages start and end when it says, not when the
    process ran them (the demo's spans do, so that a loaded machine cannot move them)."""
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    now = [1_700_000_000_000_000_000]
    stagetrace.configure(tracer_provider=provider, clock=lambda: now[0])
    with stagetrace.request("r-clock") as req:
        now[0] += 1_000
        with stagetrace.stage("retrieval") as st:
            now[0] += 250_000
            st.set_output(["d1"])
        now[0] += 2_000
        req.set_output("out")
    got = _by_name(spans)
    base = 1_700_000_000_000_000_000
    assert (got["inference.request"].start_time, got["inference.request"].end_time) == (base, base + 253_000)
    assert (got["stage.retrieval"].start_time, got["stage.retrieval"].end_time) == (base + 1_000, base + 251_000)


def test_a_failing_stage_is_an_error_span_and_the_exception_propagates(spans):
    with pytest.raises(RuntimeError):
        with stagetrace.request("r-3"):
            with stagetrace.stage("decode"):
                raise RuntimeError("XID 79: GPU has fallen off the bus")
    got = _by_name(spans)
    for name in ("stage.decode", "inference.request"):
        assert got[name].status.status_code is StatusCode.ERROR
    assert "XID 79" in got["stage.decode"].status.description
    assert got["stage.decode"].events[0].name == "exception"


def test_attribute_values_otel_cannot_hold_are_kept_as_json(spans):
    with stagetrace.request("r-4", attributes={"cfg": {"a": 1}, "mixed": [1, "x"], "skip": None}) as req:
        req.set_attribute("ids", ("d1", "d2"))
    root = _by_name(spans)["inference.request"]
    assert json.loads(root.attributes["cfg"]) == {"a": 1}
    assert json.loads(root.attributes["mixed"]) == [1, "x"]
    assert tuple(root.attributes["ids"]) == ("d1", "d2") and "skip" not in root.attributes


def test_worker_threads_join_the_request(spans):
    with stagetrace.request("r-5") as req:

        def rank(r):
            with req.stage("allreduce", rank=r, attributes={"parallel.tp_size": 2}) as st:
                st.set_output(r)

        workers = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
    got = spans.get_finished_spans()
    root = next(s for s in got if s.name == "inference.request")
    ranks = [s for s in got if s.name == "stage.allreduce"]
    assert sorted(s.attributes["parallel.tp_rank"] for s in ranks) == [0, 1]
    assert all(s.parent.span_id == root.context.span_id and s.context.trace_id == root.context.trace_id for s in ranks)


def test_request_id_must_be_given():
    with pytest.raises(ValueError, match="request_id"):
        stagetrace.request("")


CHILD = """
import json, sys
import stagetrace
carrier, dsn = json.loads(sys.argv[1]), sys.argv[2]
stagetrace.configure(service_name="tp-rank-1", store=dsn, host_name="gpu-node-2")
with stagetrace.stage("allreduce", input=[1.0, 2.0], parent=carrier, rank=1) as st:
    st.set_output(3.0)
stagetrace.shutdown()
"""


def test_a_rank_in_another_process_adds_its_stage_to_the_request(store_dsn):
    """W3C traceparent across a real process boundary; both processes write the same embedded store in turn."""
    memory = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({"service.name": "frontend"}))
    provider.add_span_processor(SimpleSpanProcessor(memory))
    stagetrace.configure(tracer_provider=provider)
    with stagetrace.request("r-xproc") as req:
        child = subprocess.run(
            [sys.executable, "-c", CHILD, json.dumps(req.carrier()), store_dsn],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert child.returncode == 0, child.stderr
    exporter = ClickHouseSpanExporter(store=store_dsn)
    exporter.export(memory.get_finished_spans())
    exporter.shutdown()
    with open_store(store_dsn) as store:
        found = lookup.by_request_id(store, "r-xproc")
    assert [(s.stage, s.service) for s in found.spans] == [(None, "frontend"), ("allreduce", "tp-rank-1")]
    assert found.spans[1].parent_span_id == found.spans[0].span_id
    assert found.spans[1].resource["host.name"] == "gpu-node-2"
