"""The trace-lookup dashboard finds a request by the IDs ``stagetrace trace`` finds it by: the ID it is stored under,
and for NVIDIA Dynamo the ``id`` of its response (``chatcmpl-<request_id>``, ``cmpl-<request_id>``), by the same rule
(conventions.request_id_candidates and its SQL twin).

Grafana cannot run here: every query the dashboard sends runs on a real chdb store after exactly the rewrites the
ClickHouse data source applies (``tests.grafana_macros.expand``), as in tests/test_dashboards.py. The store holds
Dynamo 1.6.1's recorded export (tests/fixtures/dynamo/serve.json, recorded from its real frontend and mocker worker)
and, as the neighbours, vLLM's (tests/fixtures/vllm/serve.json), whose own request IDs start with ``chatcmpl-`` and are
stored so, both sent over OTLP/HTTP into a running receiver as the engine tests send them, and an application's
request whose own ID is the rest of one of vLLM's, sent by the OpenTelemetry SDK's OTLP/HTTP exporter.
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.trace import set_span_in_context

from stagetrace import lookup
from stagetrace.dashboards import build_all, compare
from stagetrace.exporters.otlp import OtlpReceiver
from tests.grafana_macros import QueryContext, Variable, expand
from tests.test_dashboards import queries, run
from tests.test_engines import DYNAMO, VLLM, VLLM_REQUESTS, dynamo_roots, send

pytestmark = pytest.mark.views_row_for_row

DASHBOARDS = build_all()
LOOKUP = DASHBOARDS["stagetrace-trace-lookup"]
NOW = datetime.now(timezone.utc)
CONTEXT = QueryContext(NOW - timedelta(hours=1), NOW, interval_ms=1000)  # the lookup ignores the picker
VLLM_ID = "chatcmpl-53a1"  # one of vLLM's own IDs, stored with its prefix
APP_ID = VLLM_ID.removeprefix("chatcmpl-")  # the application's request, stored under the rest of it
APP = "rag-app"


def send_app_request(receiver) -> None:
    """An application's request (a root with stagetrace.request.id and a decode stage below it), from the SDK."""
    provider = TracerProvider(resource=Resource.create({"service.name": APP, "host.name": "app-node-1"}))
    provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(endpoint=f"{receiver.url}/v1/traces")))
    tracer = provider.get_tracer("app")
    root = tracer.start_span("request", attributes={"stagetrace.request.id": APP_ID})
    tracer.start_span("generate", context=set_span_in_context(root), attributes={"stagetrace.stage": "decode"}).end()
    root.end()
    provider.shutdown()
    receiver.writer.flush()


@pytest.fixture
def stored(store):
    receiver = OtlpReceiver(store, "127.0.0.1:0")
    try:
        send(receiver, "serve", DYNAMO)
        send(receiver, "serve", VLLM)
        send_app_request(receiver)
    finally:
        receiver.close()
    store.client.database = store.database  # as the data source's default database
    return store


def panels(store, request_id: str) -> dict[str, list[dict]]:
    """Each query of the trace-lookup dashboard, run with the Request ID variable set to ``request_id``: its rows."""
    out = {}
    for what, _, sql, _ in queries(LOOKUP):
        names, _, rows = run(store, expand(sql, CONTEXT, {"request_id": Variable(request_id)}))
        out[what] = [dict(zip(names, row)) for row in rows]
    return out


def response_id(root: dict) -> str:
    """The ``id`` of the response the client got from Dynamo."""
    return ("cmpl-" if root["uri"] == "/v1/completions" else "chatcmpl-") + root["request_id"]


def test_a_dynamo_response_id_finds_the_request_its_bare_id_finds(stored):
    """For each Dynamo request the client did not name (its stored ID is Dynamo's request_id), the response's
    ``chatcmpl-``/``cmpl-`` id shows in every panel the rows its stored ID shows: the request, its trace with the
    worker's handle_payload, its decode stage, its host. Where the client named the request (x-request-id), the
    response's id finds nothing, as ``stagetrace trace`` finds nothing by it."""
    roots = dynamo_roots("serve")
    unnamed = [r for r in roots if "x_request_id" not in r]
    assert unnamed and len(unnamed) < len(roots)  # both kinds recorded
    for root in roots:
        stored_id = root.get("x_request_id") or root["request_id"]
        by_stored = panels(stored, stored_id)
        (request,) = by_stored["Request"]
        assert (request["request_id"], request["trace_id"]) == (stored_id, root["trace_id"])
        assert {s["traceID"] for s in by_stored["Trace"]} == {root["trace_id"]}
        trace = {(s["operationName"], s["serviceName"]) for s in by_stored["Trace"]}
        assert {("http-request", "dynamo-frontend"), ("handle_payload", "dynamo-worker")} <= trace
        assert [(s["stage"], s["span"]) for s in by_stored["Stages"]] == [("decode", "handle_payload")]
        assert by_stored["Hosts"]

        by_response = panels(stored, response_id(root))
        if root in unnamed:
            assert by_response == by_stored, response_id(root)
            assert lookup.by_request_id(stored, response_id(root)).trace_id == root["trace_id"]  # as the CLI finds it
        else:
            assert not any(by_response.values()), response_id(root)
            with pytest.raises(lookup.NotFound):
                lookup.by_request_id(stored, response_id(root))


def test_an_id_stored_with_the_prefix_is_found_as_it_is_and_unrelated_ones_not_at_all(stored):
    """vLLM's own IDs start with ``chatcmpl-`` and are stored so; an application's request is stored under the rest of
    one of them. As in the CLI, the ID as typed comes first: vLLM's ID finds vLLM's request, the bare one the
    application's, and the other prefix before it (no request's own ID) the application's. A response ID no request
    has, a prefix alone, and a bare ID under two prefixes find nothing in any panel."""
    assert VLLM_ID in VLLM_REQUESTS
    for typed, service in ((VLLM_ID, "vllm"), (APP_ID, APP), ("cmpl-" + APP_ID, APP)):
        found = panels(stored, typed)
        (request,) = found["Request"]
        assert request["service"] == service, typed
        assert request["trace_id"] == lookup.by_request_id(stored, typed).trace_id  # the CLI's choice
        assert {s["serviceName"] for s in found["Trace"]} == {service}, typed
    bare = next(r["request_id"] for r in dynamo_roots("serve") if "x_request_id" not in r)
    for unrelated in ("chatcmpl-" + "0" * 8, "cmpl-", "chatcmpl-", "chatcmpl-cmpl-" + bare, bare[:-1]):
        found = {what: rows for what, rows in panels(stored, unrelated).items() if rows}
        assert not found, (unrelated, found)


def test_compare_finds_both_requests_by_their_response_ids(stored):
    """The compare dashboard, which shares the lookup's rule, given two of Dynamo's response ids, lists both requests
    by their stored IDs and sets their decode stages side by side."""
    unnamed = [r for r in dynamo_roots("serve") if "x_request_id" not in r][:2]
    assert len(unnamed) == 2
    variables = {"request_id": Variable(response_id(unnamed[0])), "other_request_id": Variable(response_id(unnamed[1]))}
    names, _, rows = run(stored, expand(compare.REQUESTS_SQL, CONTEXT, variables))
    assert [dict(zip(names, row))["request_id"] for row in rows] == [r["request_id"] for r in unnamed]
    names, _, rows = run(stored, expand(compare.STAGES_SQL, CONTEXT, variables))
    (stage,) = [dict(zip(names, row)) for row in rows]  # the worker's handling of each, side by side
    assert stage["stage"] == "decode"
    assert f"request_id: {unnamed[0]['request_id']} -> {unnamed[1]['request_id']}" in stage["differing_attributes"]
