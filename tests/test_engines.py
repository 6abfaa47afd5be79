"""Engines' own traces, recorded from their released tracing code (tests/fixtures/sglang/README.md,
tests/fixtures/vllm/README.md, tests/fixtures/dynamo/README.md), sent over OTLP/HTTP into a running receiver and read from the real store (issue 53)."""

from __future__ import annotations

import base64
import io
import json
import urllib.request
from pathlib import Path

import pytest
from google.protobuf import json_format
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from stagetrace import conventions
from stagetrace.exporters.otlp import OtlpReceiver

# every span these tests store is also the corpus of the views' rows (tests/views_reference.py)
pytestmark = pytest.mark.views_row_for_row

SGLANG = Path(__file__).parent / "fixtures" / "sglang"
VLLM = Path(__file__).parent / "fixtures" / "vllm"
RID = "3f9a1c2e8b7d4e6fa0b1c2d3e4f5a6b7"


@pytest.fixture
def receiver(store):
    r = OtlpReceiver(store, "127.0.0.1:0")
    yield r
    r.close()


def send(receiver, scenario: str, engine: Path = SGLANG) -> None:
    """Post each export request the engine's exporter sent, as it sent it (protobuf over HTTP)."""
    for message in json.loads((engine / f"{scenario}.json").read_text()):
        post(receiver, json_format.ParseDict(message, ExportTraceServiceRequest()))
    receiver.writer.flush()


def post(receiver, message: ExportTraceServiceRequest) -> None:
    request = urllib.request.Request(
        f"{receiver.url}/v1/traces",
        data=message.SerializeToString(),
        method="POST",
        headers={"Content-Type": "application/x-protobuf"},
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        assert response.status == 200


def stages(store) -> list[tuple]:
    return store.client.query(
        "SELECT SpanName, Stage, Rank, ServiceName FROM stagetrace.stagetrace_stages ORDER BY SpanName, Rank"
    ).result_rows


def test_sglang_tp2_stages_are_per_rank(store, receiver):
    """With TP=2 SGLang records tp_rank only on each scheduler thread's span: each stage span below it is its rank's,
    so the decode stage is two keys (rank 0, rank 1), not one holding both ranks' spans."""
    send(receiver, "unified-tp2")
    rows = stages(store)
    assert [(n, s, r) for n, s, r, _ in rows if n in ("prefill_forward", "decode_forward", "decode_loop")] == [
        ("decode_forward", "decode", "0"),
        ("decode_forward", "decode", "1"),
        ("decode_loop", "decode", "0"),
        ("decode_loop", "decode", "1"),
        ("prefill_forward", "decode", "0"),
        ("prefill_forward", "decode", "1"),
    ]
    # the tokenizer thread has no rank: its stage keeps none
    assert [r for n, _, r, _ in rows if n == "tokenize"] == [""]
    # the spans as stored carry the inherited rank under stagetrace's name, and SGLang's own attributes unchanged
    stored = dict(
        store.client.query(
            "SELECT SpanName, SpanAttributes FROM stagetrace.otel_traces WHERE "
            "position(SpanName, '[TP 1]') > 0 OR SpanName = 'tokenize'"
        ).result_rows
    )
    assert stored["tokenize"] == {}
    assert [a["tp_rank"] for n, a in stored.items() if n != "tokenize"] == ["1"]


def test_sglang_sampled_request_without_an_exported_seed_is_not_called_nondeterministic(store, receiver):
    """SGLang exports temperature 0.7 but never the seed: the seed is unknown, so the request is not excused as
    sampling nondeterminism on temperature alone (the fixture's request may have been sent with seed=42)."""
    send(receiver, "unified-tp2")
    rows = store.client.query("SELECT RequestId, Nondeterministic FROM stagetrace.stagetrace_requests").result_rows
    assert rows == [(RID, "")]
    # and what explain and divergences say of it, from the root as stored
    from stagetrace import lookup
    from stagetrace.analysis.explain import unknown_seed

    assert unknown_seed(lookup.by_request_id(store, RID)) == (
        "gen_ai.request.temperature 0.7, and SGLang does not record the seed"
    )


def test_a_disaggregated_request_is_found_by_its_id_with_its_prefill_and_its_decode(store, receiver):
    """SGLang's prefill and decode servers each open a root with the request's rid, in two traces (no traced
    router): looked up by that rid, the request is both halves, the prefill's forward pass and KV transfer beside the
    decode's, while the mooncake sender's root (no request) is no third half. Beside it another service's request
    whose ID is the same rid, retried: its earlier try is not shown (the latest of a retried request stands)."""
    from stagetrace import lookup

    send(receiver, "prefill")
    send(receiver, "decode")
    trace = lookup.by_request_id(store, RID)
    names = {span.name for span in trace.spans}
    assert {"prefill_forward", "prefill_transfer_kv_cache", "decode_forward", "decode_transferred"} <= names, names
    roots = {span.name.split(" Req ")[0] for span in trace.spans if not span.parent_span_id and " Req " in span.name}
    assert {"prefill", "decode"} <= roots, roots
    assert len(trace.spans) == len({(s.span_id, s.start_ns) for s in trace.spans})  # each span once
    # each half's spans keep their own tree: a parent is never shown below its child
    position = {span.span_id: n for n, span in enumerate(trace.spans)}
    assert all(position[s.parent_span_id] < position[s.span_id] for s in trace.spans if s.parent_span_id in position)
    # the neighbour: an ordinary request retried under one ID shows its latest try only
    retried = "neighbour-retried"
    for attempt in range(2):
        message = ExportTraceServiceRequest()
        scope = message.resource_spans.add().scope_spans.add()
        span = scope.spans.add(
            name=f"attempt-{attempt}",
            trace_id=(attempt + 7).to_bytes(16, "big"),
            span_id=(attempt + 7).to_bytes(8, "big"),
            start_time_unix_nano=10**18 + attempt * 10**9,
            end_time_unix_nano=10**18 + attempt * 10**9 + 1000,
        )
        span.attributes.add(key="stagetrace.request.id", value={"string_value": retried})
        post(receiver, message)
    receiver.writer.flush()
    assert [s.name for s in lookup.by_request_id(store, retried).spans] == ["attempt-1"]


def test_the_kv_transfer_of_a_disaggregated_request_is_its_cache_stage(store, receiver):
    """The KV cache moved from the prefill server to the decode server (SGLang's bootstrap and transfer spans, and
    mooncake's) is the cache stage of each half; the forward passes stay decode, the threads and roots no stage."""
    send(receiver, "prefill")
    send(receiver, "decode")
    by_name = {name: stage for name, stage, _, _ in stages(store)}
    assert {
        n: by_name.get(n)
        for n in (
            "prefill_bootstrap",
            "prefill_transfer_kv_cache",
            "decode_bootstrap",
            "decode_transferred",
            "mooncake_transfer_kv",
        )
    } == dict.fromkeys(
        (
            "prefill_bootstrap",
            "prefill_transfer_kv_cache",
            "decode_bootstrap",
            "decode_transferred",
            "mooncake_transfer_kv",
        ),
        "cache",
    )
    assert by_name["prefill_forward"] == by_name["decode_forward"] == "decode"
    assert not any(" Req " in name or "Scheduler" in name for name in by_name), by_name


# -- vLLM 0.33.0 (tests/fixtures/vllm/README.md): ``vllm serve`` with three requests behind an application that sent
# traceparent and one sent straight to it; the ``LLM`` class with one request
VLLM_REQUESTS = {"chatcmpl-53a1", "chatcmpl-53a2", "chatcmpl-53a3", "chatcmpl-53b1", "53c1"}
VLLM_START_UP = {
    "API server setup",
    "Overall Loading",
    "AsyncMPClient init",
    "EngineCoreProc init",
    "Executor init",
    "Worker init",
    "Load model",
    "SyncMPClient init",
}


def vllm_requests() -> dict[str, dict]:
    """The fixture's llm_request spans by request ID: trace and parent IDs (hex), start and end (ns)."""
    out = {}
    for scenario in ("serve", "offline"):
        for message in json.loads((VLLM / f"{scenario}.json").read_text()):
            parsed = json_format.ParseDict(message, ExportTraceServiceRequest())
            for span in (s for r in parsed.resource_spans for ss in r.scope_spans for s in ss.spans):
                attributes = {a.key: a.value.string_value for a in span.attributes}
                if span.name == "llm_request":
                    out[attributes["gen_ai.request.id"]] = {
                        "trace_id": span.trace_id,
                        "parent_span_id": span.parent_span_id,
                        "start": span.start_time_unix_nano,
                        "end": span.end_time_unix_nano,
                    }
    return out


def app_roots(receiver, service: str, roots) -> None:
    """An application's root spans (``(trace ID, span ID, start, end, attributes)``), as an app in front of an
    engine sends them: hand-built here, the engine's spans below them being the recorded ones."""
    message = ExportTraceServiceRequest()
    resource = message.resource_spans.add()
    resource.resource.attributes.add(key="service.name", value={"string_value": service})
    scope = resource.scope_spans.add()
    for trace_id, span_id, start, end, attributes in roots:
        span = scope.spans.add(
            name="chat", trace_id=trace_id, span_id=span_id, start_time_unix_nano=start, end_time_unix_nano=end
        )
        for key, value in attributes.items():
            span.attributes.add(key=key, value={"string_value": value})
    post(receiver, message)
    receiver.writer.flush()


def test_vllm_requests_are_found_by_their_id_and_its_start_up_roots_are_not_requests(store, receiver):
    """vLLM's llm_request is a request (found by gen_ai.request.id, as the root of its trace or below an app's span
    that sent traceparent) and its decode stage; its start-up spans, whichever is their root (``Overall Loading``
    under ``vllm serve``, ``SyncMPClient init`` under the ``LLM`` class), are kept as spans and never listed. Beside
    them SGLang's request in the same store is listed as before, its stages unchanged."""
    from stagetrace import lookup

    send(receiver, "serve", VLLM)
    send(receiver, "offline", VLLM)
    send(receiver, "unified-tp2")
    listed = dict(store.client.query("SELECT RequestId, ServiceName FROM stagetrace.stagetrace_requests").result_rows)
    assert listed == {**dict.fromkeys(VLLM_REQUESTS, "vllm"), RID: "sglang"}, listed
    kept = set(store.client.query("SELECT DISTINCT SpanName FROM stagetrace.otel_traces").result_columns[0])
    assert VLLM_START_UP <= kept
    for request_id in VLLM_REQUESTS:
        trace = lookup.by_request_id(store, request_id)
        assert [(s.name, s.stage) for s in trace.spans] == [("llm_request", "decode")], request_id
    assert {(n, s) for n, s, _, svc in stages(store) if svc == "vllm"} == {("llm_request", "decode")}
    assert {n for n, s, _, svc in stages(store) if svc == "sglang" and s == "decode"} == {
        "prefill_forward",
        "chunked_prefill",
        "decode_forward",
        "decode_loop",
    }
    # the Python twin says the same of every stored span
    rows = store.client.query("SELECT SpanName, SpanAttributes FROM stagetrace.otel_traces").result_rows
    assert {n for n, a in rows if conventions.is_not_request(n, a)} & VLLM_START_UP == VLLM_START_UP
    assert not any(conventions.is_not_request(n, a) for n, a in rows if n == "llm_request" or " Req " in n)


def test_a_vllm_request_s_model_is_the_one_its_operator_declared_on_the_resource(store, receiver):
    """vLLM 0.33.0's llm_request names no model; its operator declared the one it serves on the resource
    (OTEL_RESOURCE_ATTRIBUTES=gen_ai.request.model=...), which the peer key reads where the span names none. Beside
    it SGLang's request names its model on its span, and an app's request names one on its span and another on its
    resource: the span's own wins."""
    send(receiver, "serve", VLLM)
    send(receiver, "unified-tp2")
    app_roots(
        receiver,
        "other-app",
        [
            (
                b"\x0b" * 16,
                b"\x0c" * 8,
                10**18,
                10**18 + 1000,
                {"stagetrace.request.id": "app-1", "gen_ai.request.model": "on-the-span"},
            )
        ],
    )
    message = ExportTraceServiceRequest()  # the same app's resource declaring another model
    resource = message.resource_spans.add()
    resource.resource.attributes.add(key="gen_ai.request.model", value={"string_value": "on-the-resource"})
    span = resource.scope_spans.add().spans.add(
        name="chat",
        trace_id=b"\x0d" * 16,
        span_id=b"\x0e" * 8,
        start_time_unix_nano=10**18,
        end_time_unix_nano=10**18 + 1,
    )
    span.attributes.add(key="stagetrace.request.id", value={"string_value": "app-2"})
    span.attributes.add(key="gen_ai.request.model", value={"string_value": "on-the-span"})
    post(receiver, message)
    receiver.writer.flush()
    models = dict(store.client.query("SELECT RequestId, Model FROM stagetrace.stagetrace_requests").result_rows)
    assert {r: m for r, m in models.items() if r.startswith("chatcmpl-")} == dict.fromkeys(
        ("chatcmpl-53a1", "chatcmpl-53a2", "chatcmpl-53a3", "chatcmpl-53b1"), "Qwen/Qwen3-0.6B"
    )
    assert models[RID] == "Qwen/Qwen3-0.6B" and models["app-1"] == models["app-2"] == "on-the-span"
    # the Python twin reads each stored root as the view did
    rows = store.client.query(
        "SELECT SpanAttributes, ResourceAttributes, SpanAttributes['gen_ai.request.id'] "
        "FROM stagetrace.otel_traces WHERE SpanName = 'llm_request'"
    ).result_rows
    assert {conventions.model_of(a, r) for a, r, _ in rows} == {"Qwen/Qwen3-0.6B"}
    assert {conventions.model_of(a) for a, r, _ in rows} == {""}


def test_a_vllm_request_sampled_with_an_unknown_seed_is_compared_and_said_to_have_an_unknown_seed(store, receiver):
    """Three requests with one prompt behind an app, sent to vLLM at temperature 0.7, one answering otherwise. vLLM
    never records the seed, so they may have been seeded: the odd one is compared with the other two and deviates,
    and ``explain`` and ``divergences`` say its seed is unknown in words, never excusing it as sampling. The
    neighbour: another service's three requests at temperature 0.7 whose producer records seeds and recorded none,
    one answering otherwise: sampling by design, not compared, and no "seed unknown" said of them."""
    from rich.console import Console

    from stagetrace import render
    from stagetrace.analysis import divergences
    from stagetrace.analysis.explain import Explainer

    send(receiver, "serve", VLLM)
    found = vllm_requests()
    digest = "1f" * 16
    app_roots(
        receiver,
        "rag-app",
        [
            (
                found[r]["trace_id"],
                found[r]["parent_span_id"],
                found[r]["start"] - 10**6,
                found[r]["end"] + 10**6,
                {"stagetrace.input.digest": digest, "stagetrace.output.digest": output},
            )
            for r, output in (("chatcmpl-53a1", "aa" * 16), ("chatcmpl-53a2", "aa" * 16), ("chatcmpl-53a3", "bb" * 16))
        ],
    )
    start = found["chatcmpl-53a1"]["start"]
    app_roots(
        receiver,
        "chat-app",
        [
            (
                bytes([0xC0, n]) * 8,
                bytes([0xC1, n]) * 4,
                start + n * 10**6,
                start + n * 10**6 + 10**5,
                {
                    "stagetrace.request.id": f"chat-{n}",
                    "stagetrace.input.digest": digest,
                    "gen_ai.request.temperature": "0.7",
                    "stagetrace.output.digest": ("cc" if n < 2 else "dd") * 16,
                },
            )
            for n in range(3)
        ],
    )

    report = Explainer(store).explain("chatcmpl-53a3").to_json()
    assert report["diverged"] and not report["nondeterministic"], report["summary"]
    assert report["baseline"]["request_id"] in ("chatcmpl-53a1", "chatcmpl-53a2")
    assert report["seed_unknown"] == "gen_ai.request.temperature 0.7, and the engine does not record the seed"
    piped = io.StringIO()
    render.explanation(render.Output(Console(file=piped)), report)
    assert "seed unknown: gen_ai.request.temperature 0.7" in piped.getvalue()
    neighbour = Explainer(store).explain("chat-2").to_json()
    assert neighbour["nondeterministic"] and neighbour["seed_unknown"] is None
    # a greedy vLLM request has nothing a seed would change
    assert Explainer(store).explain("chatcmpl-53b1").to_json()["seed_unknown"] is None

    found = divergences.compute(store, 3600 * 10**9, until_ns=start + 60 * 10**9)
    divergences.record(store, found)
    result = found.to_json()
    deviating = {i["request_id"]: i for g in result["groups"] for i in g["deviating"]}
    assert set(deviating) == {"chatcmpl-53a3"}, deviating
    assert deviating["chatcmpl-53a3"]["seed_unknown"] == report["seed_unknown"]
    assert result["nondeterministic_by_service"] == {"chat-app": 3} and result["seed_unknown"] == 1
    piped = io.StringIO()
    render.divergence_groups(render.Output(Console(file=piped)), found, "1h")
    text = piped.getvalue()
    assert "1 with the seed unknown" in text and "3 sampled without a seed, not compared" in text, text
    assert "seed unknown: chatcmpl-53a3: gen_ai.request.temperature 0.7" in text


def test_sglang_pipeline_stages_keep_their_tp_ranks_apart_and_the_dp_replica_reaches_the_stages(store, receiver):
    """SGLang 0.5.23's schedulers record pp_rank (and dp_rank under data parallelism) beside tp_rank on their thread
    span. With PP=2 each pipeline stage has TP ranks 0 and 1: the stage key's rank is the TP rank on pipeline stage 0
    and ``<tp>@pp<pp>`` on stage 1, four keys, not two holding two GPUs' spans each; the DP replica that served the
    request (1 of 2) reaches each stage span as ``parallel.dp_rank``. Beside it the TP=2 server without pipeline
    parallelism keeps its ranks 0 and 1."""
    send(receiver, "dp2-pp2-tp2")
    send(receiver, "unified-tp2")
    rows = stages(store)
    assert sorted(r for n, _, r, svc in rows if n == "decode_forward" and svc == "sglang-pp") == [
        "0",
        "0@pp1",
        "1",
        "1@pp1",
    ]
    assert sorted(r for n, _, r, svc in rows if n == "decode_forward" and svc == "sglang") == ["0", "1"]
    stored = store.client.query(
        "SELECT SpanName, Rank, Attributes['parallel.dp_rank'], ServiceName FROM stagetrace.stagetrace_stages"
    ).result_rows
    assert {dp for n, _, dp, svc in stored if svc == "sglang-pp" and n != "tokenize"} == {"1"}
    assert [dp for n, _, dp, svc in stored if n == "tokenize"] == ["", ""]  # the tokenizer thread has no replica
    # the twin reads each stored span's rank as the view did; ranks order by pipeline stage, then TP rank
    spans = store.client.query(
        "SELECT SpanAttributes FROM stagetrace.otel_traces WHERE SpanName = 'decode_forward' "
        "AND ServiceName = 'sglang-pp'"
    ).result_columns[0]
    ranks = sorted((conventions.rank_of(a) for a in spans), key=conventions.rank_order)
    assert ranks == ["0", "1", "0@pp1", "1@pp1"]
    # the request is one request, its rank a stage's key and not a cause: dp rank names where it ran
    assert conventions.is_identity(conventions.DP_RANK) and not conventions.is_comparable(conventions.PP_RANK)


# -- NVIDIA Dynamo 1.6.1 (tests/fixtures/dynamo/README.md): its real frontend in front of its mocker worker (a GPU is
# what a real engine would need; the mocker is Dynamo's own GPU-less worker), at its default log level and at debug
DYNAMO = Path(__file__).parent / "fixtures" / "dynamo"
DYNAMO_SCENARIOS = ("serve", "serve-debug")
# what record.py sent as headers, per scenario: the client's request IDs, and the app's trace of the fourth request
CLIENT_IDS = ("client-53d1", "client-53d2")
UUID_IDS = ("53d0e5a1-0000-4000-8000-000000000004", "53d0e5a1-0000-4000-8000-000000000005")
APP_TRACES = ("53d00000000000000000000000005a04", "53d00000000000000000000000005a05")


def dynamo_roots(scenario: str) -> list[dict]:
    """The frontend's request roots as Dynamo recorded them, in the order record.py sent the requests."""
    roots = []
    for message in json.loads((DYNAMO / f"{scenario}.json").read_text()):
        for resource in message["resourceSpans"]:
            for span in (s for scope in resource["scopeSpans"] for s in scope["spans"]):
                attributes = {a["key"]: next(iter(a["value"].values())) for a in span.get("attributes", [])}
                if span["name"] == "http-request" and attributes.get("target") == "request_span":
                    roots.append(
                        {
                            "trace_id": base64.b64decode(span["traceId"]).hex(),
                            "start": int(span["startTimeUnixNano"]),
                            **attributes,
                        }
                    )
    return sorted(roots, key=lambda r: r["start"])


def test_dynamo_requests_are_found_by_their_id_with_the_worker_s_decode_stage(store, receiver):
    """Each request the frontend served is one request, found by the client's x-request-id where it sent one, else
    by Dynamo's request_id, or by the response's ``chatcmpl-``/``cmpl-`` id: the frontend's http-request over its
    router.route_request over the worker's handle_payload (another service, another process), whose handling is the
    decode stage. At both log levels; beside them vLLM's requests in the same store, one of whose IDs starts with
    ``chatcmpl-`` too, are found by their own IDs as before."""
    from stagetrace import lookup

    send(receiver, "serve", VLLM)
    send(receiver, "offline", VLLM)
    for scenario in DYNAMO_SCENARIOS:
        send(receiver, scenario, DYNAMO)
    listed = store.client.query("SELECT RequestId, ServiceName, Model FROM stagetrace.stagetrace_requests").result_rows
    assert {r for r, s, _ in listed if s == "vllm"} == set(VLLM_REQUESTS)
    expected = {}
    for n, scenario in enumerate(DYNAMO_SCENARIOS):
        roots = dynamo_roots(scenario)
        assert len(roots) == 5, scenario  # record.py's five requests
        assert roots[0]["x_request_id"] == CLIENT_IDS[n] and roots[3]["x_request_id"] == UUID_IDS[n]
        # the model the client asked for, where Dynamo's root names it (1.6.1: chat completions, not completions)
        expected |= {r.get("x_request_id") or r["request_id"]: r.get("model", "") for r in roots}
    dynamo = sorted((r, m) for r, s, m in listed if s == "dynamo-frontend")
    assert dynamo == sorted(expected.items()) and len(dynamo) == 10, dynamo
    assert {m for _, m in dynamo} == {"tiny-chat", ""}
    # the Python twin reads each stored Dynamo root's model as the view did
    rows = store.client.query(
        "SELECT SpanName, SpanAttributes, ResourceAttributes FROM stagetrace.otel_traces "
        "WHERE ServiceName = 'dynamo-frontend' AND ParentSpanId = ''"
    ).result_rows
    assert {conventions.model_of(a, r, n) for n, a, r in rows} == {"tiny-chat", ""}
    assert sorted(conventions.model_of(a, r, n) for n, a, r in rows if conventions.is_dynamo_request(n, a)) == sorted(
        m for r, m in dynamo if r not in UUID_IDS
    )  # the roots below an app's span have a parent

    for scenario in DYNAMO_SCENARIOS:
        for root in dynamo_roots(scenario):
            request_id = root.get("x_request_id") or root["request_id"]
            trace = lookup.by_request_id(store, request_id)
            assert trace.trace_id == root["trace_id"], request_id
            names = [(s.name, s.service, s.stage) for s in trace.spans]
            assert ("http-request", "dynamo-frontend", None) in names
            assert ("router.route_request", "dynamo-frontend", None) in names
            assert [n for n in names if n[2]] == [("handle_payload", "dynamo-worker", "decode")], names
            # the worker's span hangs below the frontend's route span, in the trace's order
            position = {s.span_id: n for n, s in enumerate(trace.spans)}
            assert all(
                position[s.parent_span_id] < position[s.span_id] for s in trace.spans if s.parent_span_id in position
            )
            # where the client named it, by that name only; else the response's id names it too, Dynamo's
            # request_id behind its prefix
            prefix = "cmpl-" if root["uri"] == "/v1/completions" else "chatcmpl-"
            if "x_request_id" in root:
                with pytest.raises(lookup.NotFound):
                    lookup.by_request_id(store, prefix + root["request_id"])
            else:
                assert lookup.by_request_id(store, prefix + root["request_id"]).trace_id == root["trace_id"]
    # the request sent inside an app's trace (traceparent) is found in that trace, its app span not stored
    assert [lookup.by_request_id(store, r).trace_id for r in UUID_IDS] == list(APP_TRACES)
    # vLLM's IDs that start with chatcmpl- are its own, found as they are
    assert all(lookup.by_request_id(store, r).service == "vllm" for r in VLLM_REQUESTS)
    with pytest.raises(lookup.NotFound):
        lookup.by_request_id(store, "chatcmpl-" + "0" * 8)


def test_dynamo_system_roots_are_kept_as_spans_and_never_listed(store, receiver):
    """At DYN_LOG=debug Dynamo also traces its frontend's system endpoints (the ``GET /v1/models`` record.py polled
    while the worker registered) as an ``http-request`` root with target ``system_span``: kept as a span, never a
    request. The Python twin says the same of every stored span; the requests' roots are requests."""
    send(receiver, "serve-debug", DYNAMO)
    rows = store.client.query("SELECT SpanName, SpanAttributes, TraceId FROM stagetrace.otel_traces").result_rows
    system = {t for n, a, t in rows if a.get("target") == "system_span"}
    assert system and all(n == "http-request" for n, a, _ in rows if a.get("target") == "system_span")
    listed = set(store.client.query("SELECT TraceId FROM stagetrace.stagetrace_requests").result_columns[0])
    assert not system & listed and len(listed) == 5
    assert all(conventions.is_not_request(n, a) for n, a, t in rows if t in system)
    assert not any(conventions.is_not_request(n, a) for n, a, t in rows if t in listed)


def test_a_seeded_dynamo_request_is_not_called_nondeterministic_and_its_sampling_is_said_unknown(store, receiver):
    """Dynamo 1.6.1 records neither the temperature nor the seed: the request sent with seed 42 at temperature 0.7
    (the third) is not called nondeterministic, and explain says its sampling is unknown rather than excusing it.
    The request sent inside an app's trace whose span records the seed it asked for has a known seed, said of
    nothing. The neighbour: another service's request at temperature 0.7 that records no seed where its producer
    would have is sampling by design, and nothing is said of its seed."""
    from stagetrace.analysis.explain import Explainer

    send(receiver, "serve", DYNAMO)
    seeded = dynamo_roots("serve")[2]["request_id"]
    start = dynamo_roots("serve")[2]["start"]
    app_roots(
        receiver,
        "chat-app",
        [
            (
                b"\xc0" * 16,
                b"\xc1" * 8,
                start,
                start + 10**6,
                {"stagetrace.request.id": "chat-1", "gen_ai.request.temperature": "0.7"},
            )
        ],
    )
    behind = dynamo_roots("serve")[3]  # the app's span record.py named in its traceparent, as the app records it
    app_roots(
        receiver,
        "rag-app",
        [
            (
                bytes.fromhex(APP_TRACES[0]),
                (0xA4).to_bytes(8, "big"),
                behind["start"] - 10**6,
                behind["start"] + 10**9,
                {"llm.invocation_parameters": '{"temperature": 0.7, "seed": 42}'},
            )
        ],
    )
    marked = dict(
        store.client.query("SELECT RequestId, Nondeterministic FROM stagetrace.stagetrace_requests").result_rows
    )
    assert marked.pop("chat-1") == "gen_ai.request.temperature 0.7 without a seed"
    assert set(marked.values()) == {""} and seeded in marked
    assert Explainer(store).explain(UUID_IDS[0]).to_json()["seed_unknown"] is None
    report = Explainer(store).explain(seeded).to_json()
    assert not report["nondeterministic"]
    assert report["seed_unknown"] == "Dynamo records neither the temperature nor the seed"
    neighbour = Explainer(store).explain("chat-1").to_json()
    assert neighbour["nondeterministic"] and neighbour["seed_unknown"] is None
