"""The conventions of producers in the field, read by the store's views: stages, request roots and IDs, digests
derived from content, content kept out of stagetrace's tables.

Span shapes are those each producer emits, with names and attributes from their sources
(docs/design.md#instrumentation-already-in-the-field); they are made with the plain OpenTelemetry SDK and
written to a real embedded store, whose materialized views do the reading.
"""

from __future__ import annotations

import pytest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.trace import SpanKind, set_span_in_context

from stagetrace import conventions, lookup
from stagetrace.exporters.clickhouse import ClickHouseSpanExporter

# every span these tests store is also the corpus of the views' rows (tests/views_reference.py)
pytestmark = pytest.mark.views_row_for_row

T0 = 1_764_000_000_000_000_000


@pytest.fixture
def tracer(store):
    exporter = ClickHouseSpanExporter(store=store)
    provider = TracerProvider(resource=Resource.create({"service.name": "field", "host.name": "gpu-7"}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("field")
    _flush.append(exporter.force_flush)  # SimpleSpanProcessor does not flush its exporter
    yield tracer
    _flush.clear()
    provider.shutdown()


_flush: list = []


def span(tracer, name, attributes, parent=None, start=T0, kind=SpanKind.INTERNAL):
    s = tracer.start_span(
        name,
        context=set_span_in_context(parent) if parent else None,
        start_time=start,
        attributes=attributes,
        kind=kind,
    )
    return s


def end(*spans):
    """End the spans, innermost first, and wait until the exporter has written them."""
    for s in reversed(spans):
        s.end(end_time=T0 + 1_000_000)
    for flush in _flush:
        flush()


def stage_rows(store, trace_id):
    return {
        name: row
        for name, *row in store.client.query(
            "SELECT SpanName, Stage, InputDigest, OutputDigest, Attributes FROM stagetrace.stagetrace_stages WHERE TraceId = {t:String}",
            parameters={"t": trace_id},
        ).result_rows
    }


def trace_id(s) -> str:
    return f"{s.get_span_context().trace_id:032x}"


# (span name, attributes) as each producer emits them, and the stage it is
FIELD_SPANS = [
    ("VectorIndexRetriever.retrieve", {"openinference.span.kind": "RETRIEVER"}, "retrieval"),
    ("BaseEmbedding.get_query_embedding", {"openinference.span.kind": "EMBEDDING"}, "retrieval"),
    ("CohereRerank.postprocess_nodes", {"openinference.span.kind": "RERANKER"}, "retrieval"),
    ("ChatPromptTemplate", {"openinference.span.kind": "PROMPT"}, "context_assembly"),
    (
        "PromptBuilder.run",
        {"openinference.span.kind": "LLM", "llm.prompt_template.template": "{{q}}"},
        "context_assembly",
    ),
    ("OpenAIGenerator.run", {"openinference.span.kind": "LLM"}, "decode"),
    ("RetrieverQueryEngine.query", {"openinference.span.kind": "CHAIN"}, ""),
    (
        "vector_db_retrieve VectorStoreRetriever",
        {"traceloop.span.kind": "task", "gen_ai.operation.name": "vector_db_retrieve"},
        "retrieval",
    ),
    (
        "execute_task ChatPromptTemplate",
        {"traceloop.span.kind": "task", "gen_ai.operation.name": "execute_task"},
        "context_assembly",
    ),
    ("ChatPromptTemplate.task", {"traceloop.span.kind": "task"}, "context_assembly"),
    ("ChatOpenAI.chat", {"gen_ai.operation.name": "chat", "gen_ai.provider.name": "openai"}, "decode"),
    ("openai.chat", {"llm.request.type": "chat"}, "decode"),
    ("chroma.query", {"db.system": "chroma", "db.chroma.query.n_results": 4}, "retrieval"),
    ("qdrant.search", {"db.system": "Qdrant"}, "retrieval"),
    ("retrieval products", {"gen_ai.operation.name": "retrieval", "gen_ai.data_source.id": "products"}, "retrieval"),
    ("embeddings text-embedding-3", {"gen_ai.operation.name": "embeddings"}, "retrieval"),
    ("execute_tool search", {"gen_ai.operation.name": "execute_tool"}, ""),
    ("llm_request", {"gen_ai.request.id": "cmpl-1"}, "decode"),
    ("decode_forward", {}, "decode"),
    ("SELECT", {"db.system": "postgresql"}, ""),
    ("anything", {"stagetrace.stage": "cache", "openinference.span.kind": "LLM"}, "cache"),
]


def test_each_producer_s_spans_get_their_stage(store, tracer):
    root = span(tracer, "request", {})
    children = [span(tracer, name, attrs, root) for name, attrs, _ in FIELD_SPANS]
    end(root, *children)
    rows = stage_rows(store, trace_id(root))
    for name, _, stage in FIELD_SPANS:
        assert rows.get(name, [""])[0] == stage, name


def test_digests_come_from_content_and_the_content_is_not_kept(store, tracer):
    docs = {
        "retrieval.documents.0.document.id": "a1",
        "retrieval.documents.0.document.content": "two years",
        "retrieval.documents.0.document.score": 0.93,
        "openinference.span.kind": "RETRIEVER",
        "input.value": "how long is the warranty?",
        "retrieval.top_k": 1,
    }
    root = span(tracer, "query", {"input.value": "how long is the warranty?", "output.value": "two years"})
    retriever = span(tracer, "retrieve", docs, root)
    same = span(
        tracer,
        "retrieve",
        {**docs, "retrieval.documents.0.document.id": "b7", "retrieval.documents.0.document.score": 0.5},
        root,
    )
    edited = span(tracer, "retrieve-edited", {**docs, "retrieval.documents.0.document.content": "one year"}, root)
    hidden = span(
        tracer,
        "hidden",
        {"openinference.span.kind": "LLM", "input.value": conventions.REDACTED, "output.value": conventions.REDACTED},
        root,
    )
    end(root, retriever, same, edited, hidden)
    rows = store.client.query(
        "SELECT SpanId, InputDigest, OutputDigest, Attributes FROM stagetrace.stagetrace_stages WHERE TraceId = {t:String}",
        parameters={"t": trace_id(root)},
    ).result_rows
    by_span = {sid: (i, o, a) for sid, i, o, a in rows}
    mine, other_ids, changed = (by_span[f"{s.get_span_context().span_id:016x}"] for s in (retriever, same, edited))
    assert mine[0] and mine[0] == other_ids[0] == changed[0]  # the query
    assert mine[1] == other_ids[1]  # same documents under other IDs and scores: same retrieval
    assert mine[1] != changed[1]  # an edited document: another retrieval
    assert by_span[f"{hidden.get_span_context().span_id:016x}"][:2] == ("", "")  # placeholders are no evidence
    assert mine[2] == {"openinference.span.kind": "RETRIEVER", "retrieval.top_k": "1"}  # settings kept, content not
    request = lookup.by_trace_id(store, trace_id(root))
    assert request.request_id == trace_id(root)  # no request-ID attribute: the trace ID stands for the request
    assert request.input_digest and request.output_digest and request.input_digest != request.output_digest


def test_an_engine_span_with_a_request_id_names_the_request_of_an_app_trace_without_one(store, tracer):
    """An app (OpenLLMetry, no request ID) calling vLLM with traceparent: one request, vLLM's ID, the app's digests."""
    app = span(
        tracer,
        "rag.workflow",
        {"traceloop.span.kind": "workflow", "traceloop.entity.input": "q", "traceloop.entity.output": "a"},
        kind=SpanKind.SERVER,
    )
    engine = span(
        tracer,
        "llm_request",
        {"gen_ai.request.id": "chatcmpl-42", "gen_ai.usage.prompt_tokens": 9},
        app,
        start=T0 + 1000,
        kind=SpanKind.SERVER,
    )
    end(app, engine)
    requests = conventions.requests_sql(table="stagetrace.stagetrace_requests")
    rows = store.client.query(f"SELECT RequestId, InputDigest FROM ({requests})").result_rows
    assert len(rows) == 1 and rows[0][0] == "chatcmpl-42" and rows[0][1]
    by_engine_id = lookup.by_request_id(store, "chatcmpl-42")
    by_trace = lookup.by_request_id(store, trace_id(app))
    assert by_engine_id.trace_id == by_trace.trace_id == trace_id(app)
    assert by_engine_id.input_digest == by_trace.input_digest != ""
    assert {s.stage for s in by_engine_id.spans} == {None, "decode"}


@pytest.mark.parametrize("newer", [False, True], ids=["rid only", "rid and gen_ai.request.id"])
def test_sglang_request_spans_are_found_by_their_rid(store, tracer, newer):
    """SGLang's request tree: root ``Req <rid[:8]>`` with ``rid`` (newer versions also set gen_ai.request.id at
    finish), a scheduler thread span per TP rank, slices below it."""
    rid = "3f9a1c2e8b7d4e6fa0b1c2d3e4f5a6b7"
    attrs = {"rid": rid, "module": "sglang::request", "bootstrap_room": "0x0"}
    if newer:
        attrs |= {"gen_ai.request.id": rid, "gen_ai.usage.cached_tokens": 12}
    root = span(tracer, f"Req {rid[:8]}", attrs, kind=SpanKind.SERVER)
    thread = span(
        tracer,
        "Scheduler [TP 0] (host:5e1f2a3b | pid:4242)",
        {"tp_rank": 0, "host_id": "5e1f2a3b", "pid": 4242, "thread_label": "Scheduler"},
        root,
    )
    slices = [
        span(tracer, name, {}, thread, start=T0 + i)
        for i, name in enumerate(("tokenize", "prefill_forward", "decode_forward"))
    ]
    end(root, thread, *slices)
    trace = lookup.by_request_id(store, rid)
    assert trace.trace_id == trace_id(root)
    assert [s.stage for s in trace.spans if s.stage] == ["context_assembly", "decode", "decode"]


def test_a_generic_rid_attribute_is_not_a_request_id(store, tracer):
    root = span(tracer, "job", {"rid": "row-17"})
    end(root)
    with pytest.raises(lookup.NotFound):
        lookup.by_request_id(store, "row-17")


def test_attribute_roles():
    for key in (
        "input.value",
        "retrieval.documents.3.document.content",
        "llm.output_messages.0.message.content",
        "traceloop.entity.output",
        "retrieval.doc_ids",
    ):
        assert conventions.is_content(key) and not conventions.is_comparable(key), key
    for key in ("gen_ai.usage.input_tokens", "llm.token_count.total", "decode.ttft_ms", "gen_ai.latency.e2e"):
        assert conventions.is_measurement(key), key
    for key in ("gen_ai.request.id", "gen_ai.task.id", "session.id", "stagetrace.output.digest"):
        assert not conventions.is_comparable(key), key
    for key in ("retrieval.index.version", "llm.model_name", "llm.invocation_parameters", "decode.batch_size"):
        assert conventions.is_comparable(key) and not conventions.is_measurement(key), key


NONDETERMINISM_CASES = [
    ({"gen_ai.request.temperature": 0.8}, True),
    ({"gen_ai.request.temperature": 0.8, "gen_ai.request.seed": 7}, False),
    ({"gen_ai.request.temperature": 0.0}, False),
    ({"llm.invocation_parameters": '{"temperature": 0.7, "max_tokens": 64}'}, True),
    ({"llm.invocation_parameters": '{"temperature": 0.7, "seed": 3}'}, False),
    ({"llm.invocation_parameters": '{"temperature": 0.7, "seed": null}'}, True),
    ({"llm.invocation_parameters": "not json"}, False),
    ({"stagetrace.nondeterministic": True}, True),
    ({"stagetrace.nondeterministic": False, "gen_ai.request.temperature": 0}, False),
    ({}, False),
    # engines that never export the seed (issue 53): unknown, so temperature alone is no verdict
    ({"gen_ai.request.temperature": 0.7, "rid": "r", "module": "sglang::request"}, False),
    ({"gen_ai.request.temperature": 0.7, "gen_ai.latency.e2e": 0.4}, False),
]


def test_nondeterminism_is_read_alike_by_the_store_and_by_python(store, tracer):
    """Sampling above temperature zero without a seed (OpenTelemetry GenAI, OpenInference's invocation parameters)
    or a declared nondeterministic span: the store's view and the Python rule must agree on every shape."""
    for i, (attributes, _) in enumerate(NONDETERMINISM_CASES):
        end(span(tracer, f"case-{i}", {"gen_ai.request.id": f"nd-{i}", **attributes}))
    rows = dict(
        store.client.query(
            "SELECT RequestId, Nondeterministic FROM {db:Identifier}.stagetrace_requests",
            parameters={"db": store.database},
        ).result_rows
    )
    for i, (attributes, expected) in enumerate(NONDETERMINISM_CASES):
        python = conventions.nondeterminism(
            {k: str(v).lower() if isinstance(v, bool) else str(v) for k, v in attributes.items()}
        )
        assert bool(rows[f"nd-{i}"]) is expected, (attributes, rows[f"nd-{i}"])
        assert bool(python) is expected, (attributes, python)


def test_engine_roots_that_are_no_request_are_kept_as_spans_but_not_listed(store, tracer):
    """vLLM's start-up spans and SGLang's KV sender root are trace roots, and SGLang's sender even carries the
    request's ``rid``: none is a request a client sent (issue 53). The request beside them is listed as before."""
    rid = "9c0ffee1d2e3f4a5b6c7d8e9f0a1b2c3"
    loading = span(tracer, "Overall Loading", {"code.function": "load_model", "code.namespace": "vllm.v1.worker"})
    load = span(tracer, "Load model", {"code.function": "load_model"}, loading)
    sender = span(tracer, "Sender Req 0x1f", {"rid": rid, "module": "sglang::mooncake", "bootstrap_room": "0x1f"})
    request = span(tracer, f"prefill Req {rid[:8]}", {"rid": rid, "module": "sglang::request"}, kind=SpanKind.SERVER)
    end(load, loading)
    end(sender)
    end(request)
    listed = store.client.query("SELECT SpanName, RequestId FROM stagetrace.stagetrace_requests").result_rows
    assert listed == [(f"prefill Req {rid[:8]}", rid)]
    kept = {name for (name,) in store.client.query("SELECT SpanName FROM stagetrace.otel_traces").result_rows}
    assert {"Overall Loading", "Load model", "Sender Req 0x1f"} <= kept
    assert lookup.by_request_id(store, rid).trace_id == trace_id(request)
    with pytest.raises(lookup.NotFound):
        lookup.by_request_id(store, trace_id(loading))
    # the Python twin agrees with the view
    assert conventions.is_not_request("Sender Req 0x1f", {"rid": rid, "module": "sglang::mooncake"})
    assert conventions.is_not_request("Overall Loading", {})
    assert not conventions.is_not_request(f" Req {rid[:8]}", {"rid": rid, "module": "sglang::request"})
