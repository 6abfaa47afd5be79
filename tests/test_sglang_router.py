"""Requests routed by SGLang's model gateway (``smg`` 1.13.0, the router), recorded with the router's own OTLP tracing
and SGLang 0.5.23's released ``trace.py`` on each server (tests/fixtures/sglang/README.md, ``record_router.py``):
``router-pd`` over prefill/decode disaggregation, ``router`` to one server. No GPU can serve here, so the servers are
stand-ins answering the router as SGLang does and tracing each request with SGLang's own module, as its tokenizer
manager does from the router's ``traceparent``. Sent over OTLP/HTTP into a running receiver and read from the real
store (issue 53)."""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path

import pytest
from google.protobuf import json_format
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from stagetrace import conventions, lookup
from stagetrace.exporters.otlp import OtlpReceiver

# every span these tests store is also the corpus of the views' rows (tests/views_reference.py)
pytestmark = pytest.mark.views_row_for_row

SGLANG = Path(__file__).parent / "fixtures" / "sglang"
UNROUTED_RID = "3f9a1c2e8b7d4e6fa0b1c2d3e4f5a6b7"  # prefill.json and decode.json: the same request without a router


@pytest.fixture
def receiver(store):
    r = OtlpReceiver(store, "127.0.0.1:0")
    yield r
    r.close()


def send(receiver, scenario: str, hosts: dict[str, str] | None = None) -> None:
    """Post each export request as its exporter sent it; ``hosts``: service -> the ``host.name`` its resource gets
    (the recording ran on one machine, and SGLang's tracer names no host unless its resource is given one)."""
    import urllib.request

    for message in json.loads((SGLANG / f"{scenario}.json").read_text()):
        parsed = json_format.ParseDict(message, ExportTraceServiceRequest())
        for resource in parsed.resource_spans:
            service = next(a.value.string_value for a in resource.resource.attributes if a.key == "service.name")
            if service in (hosts or {}):
                resource.resource.attributes.add(key="host.name", value={"string_value": hosts[service]})
        data = parsed.SerializeToString()
        request = urllib.request.Request(
            f"{receiver.url}/v1/traces", data=data, method="POST", headers={"Content-Type": "application/x-protobuf"}
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            assert response.status == 200
    receiver.writer.flush()


def recorded(scenario: str) -> list[dict]:
    """The fixture's spans as recorded: name, service, trace, span and parent IDs (hex), attributes."""
    out = []
    for message in json.loads((SGLANG / f"{scenario}.json").read_text()):
        for resource in message["resourceSpans"]:
            service = next(
                a["value"]["stringValue"] for a in resource["resource"]["attributes"] if a["key"] == "service.name"
            )
            for span in (s for scope in resource["scopeSpans"] for s in scope["spans"]):
                out.append(
                    {
                        "name": span["name"],
                        "service": service,
                        **{k: base64.b64decode(span.get(k, "")).hex() for k in ("traceId", "spanId", "parentSpanId")},
                        "attributes": {a["key"]: next(iter(a["value"].values())) for a in span.get("attributes", [])},
                    }
                )
    return out


def routed(scenario: str) -> tuple[dict, list[dict]]:
    """The router's span of the request the client sent (a model route), and the SGLang request roots below it."""
    spans = recorded(scenario)
    (router,) = [s for s in spans if s["service"] == "smg" and s["attributes"]["path"] == "/generate"]
    roots = [s for s in spans if s["attributes"].get("module") == "sglang::request"]
    return router, roots


def requests(store) -> dict[str, tuple]:
    """Request ID -> (trace ID, service, span name), one per request as the analysis lists them."""
    rows = store.client.query(
        f"SELECT RequestId, TraceId, ServiceName, SpanName FROM ({conventions.requests_sql(table='stagetrace.stagetrace_requests')})"
    ).result_rows
    return {r[0]: tuple(r[1:]) for r in rows}


def test_a_routed_disaggregated_request_is_one_request_found_by_its_id_with_prefill_kv_transfer_and_decode(
    store, receiver
):
    """The router's http_request is the request's root, found by the client's x-request-id it records; SGLang's
    prefill and decode roots (each with its own rid, as SGLang gives a request sent without one) are its children in
    the same trace, each rid finding that one request too. The router's readiness probe is kept as a span, never a
    request. Beside it: the same engine's unrouted disaggregated request (two traces, one rid) and a request routed
    to one server, whose answers are those they have alone."""
    send(receiver, "prefill")
    send(receiver, "decode")
    alone = lookup.by_request_id(store, UNROUTED_RID)
    send(receiver, "router-pd")
    send(receiver, "router")
    router, roots = routed("router-pd")
    client_id = router["attributes"]["request_id"]
    assert re.fullmatch(r"req-[0-9a-f]{8}", client_id), client_id  # the x-request-id record_router.py sent
    assert {r["name"].split(" Req ")[0] for r in roots} == {"prefill", "decode"}
    assert {r["parentSpanId"] for r in roots} == {router["spanId"]}
    assert len({r["attributes"]["rid"] for r in roots}) == 2  # each server its own rid
    assert len({r["attributes"]["bootstrap_room"] for r in roots}) == 1  # the room the router gave both

    listed = requests(store)
    assert listed[client_id] == (router["traceId"], "smg", "http_request")
    # one request per trace: the halves' rids are not requests of their own, the probes no request at all
    assert not {r["attributes"]["rid"] for r in roots} & set(listed)
    probes = {s["traceId"] for sc in ("router-pd", "router") for s in recorded(sc) if s["attributes"].get("path")}
    probes -= {routed(sc)[0]["traceId"] for sc in ("router-pd", "router")}
    assert probes and not probes & {t for t, _, _ in listed.values()}
    # the Python twins say of every stored span what their SQL says
    stored = store.client.query(
        f"SELECT SpanName, SpanAttributes, {conventions.IS_NOT_REQUEST_SQL}, {conventions.IS_SMG_REQUEST_SQL} "
        "FROM stagetrace.otel_traces"
    ).result_rows
    assert [(bool(no), bool(smg)) for _, _, no, smg in stored] == [
        (conventions.is_not_request(n, a), conventions.is_smg_request(n, a)) for n, a, _, _ in stored
    ]
    smg = [(n, a) for n, a, _, _ in stored if conventions.is_smg_span(n, a)]
    assert len(smg) == 4 and all(conventions.is_not_request(n, a) != conventions.is_smg_request(n, a) for n, a in smg)

    for request_id in (client_id, *(r["attributes"]["rid"] for r in roots)):
        trace = lookup.by_request_id(store, request_id)
        assert trace.trace_id == router["traceId"], request_id
        by_name = {s.name: s for s in trace.spans}
        assert by_name["http_request"].service == "smg" and by_name["http_request"].stage is None
        assert {by_name[n].stage for n in ("prefill_forward", "decode_forward")} == {"decode"}
        kv = ("prefill_bootstrap", "prefill_transfer_kv_cache", "decode_bootstrap", "decode_transferred")
        assert {by_name[n].stage for n in kv} == {"cache"}
        assert {s.service for s in trace.spans} == {"smg", "sglang-prefill", "sglang-decode"}
        # the router's span first, each span after its parent, each once
        assert trace.spans[0].name == "http_request"
        position = {s.span_id: n for n, s in enumerate(trace.spans)}
        assert all(position[s.parent_span_id] < position[s.span_id] for s in trace.spans if s.parent_span_id)
        assert len(position) == len(trace.spans)

    # the neighbours: the unrouted request is still its two halves, as alone; the request routed to one server is
    # its own, found by its client's ID with the unified server's stages
    again = lookup.by_request_id(store, UNROUTED_RID)
    assert (again.trace_id, [s.name for s in again.spans]) == (alone.trace_id, [s.name for s in alone.spans])
    single, (root,) = routed("router")
    one = lookup.by_request_id(store, single["attributes"]["request_id"])
    assert one.trace_id == single["traceId"] != router["traceId"]
    assert root["parentSpanId"] == single["spanId"]
    assert {s.stage for s in one.spans} == {None, "context_assembly", "decode"}
    assert listed[single["attributes"]["request_id"]] == (single["traceId"], "smg", "http_request")
    # the model the servers name on their roots is the routed requests' (the router's span names none)
    table = "stagetrace.stagetrace_requests"
    models = dict(
        store.client.query(
            f"SELECT RequestId, Model FROM ({conventions.requests_sql(table=table, model=True)})"
        ).result_rows
    )
    assert models[client_id] == models[single["attributes"]["request_id"]] == "Qwen/Qwen3-0.6B"
    assert listed[UNROUTED_RID][1:] in {
        ("sglang-prefill", "prefill Req 3f9a1c2e"),
        ("sglang-decode", "decode Req 3f9a1c2e"),
    }


def test_trace_json_and_the_report_hold_both_halves_of_a_routed_request(store, store_dsn, receiver, capsys):
    """``stagetrace trace <x-request-id> --json`` lists the router's span, the prefill's forward pass and KV transfer
    and the decode's, with their stages; ``explain`` and its incident page read the same one trace, both halves'
    bars in its waterfall. A neighbour (the unrouted disaggregated request) in the same store is not drawn in."""
    from stagetrace.analysis.explain import Explainer
    from stagetrace.cli import main
    from stagetrace.report import incident_html

    send(receiver, "prefill")
    send(receiver, "decode")
    send(receiver, "router-pd")
    router, roots = routed("router-pd")
    client_id = router["attributes"]["request_id"]
    trace = lookup.by_request_id(store, client_id)
    report = Explainer(store).explain(client_id)
    page = incident_html(store, report)
    assert (report.request_id, report.trace_id) == (client_id, router["traceId"])
    # one bar per span of the trace, in its order: both halves' forward passes and KV transfer among them
    bars = re.findall(r'data-stage="([a-z_]*)"', page)
    assert bars == [s.stage or "" for s in trace.spans]
    halves = {s.service for s in trace.spans if s.stage in ("cache", "decode")}
    assert halves == {"sglang-prefill", "sglang-decode"}

    receiver.close()
    store.close()
    assert main(["trace", client_id, "--store", store_dsn, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert (doc["request_id"], doc["trace_id"], doc["service"]) == (client_id, router["traceId"], "smg")
    names = {s["name"]: s for s in doc["spans"]}
    assert names["http_request"]["parent_span_id"] == ""
    for role, forward, transfer in (
        ("prefill", "prefill_forward", "prefill_transfer_kv_cache"),
        ("decode", "decode_forward", "decode_transferred"),
    ):
        (root,) = [s for s in doc["spans"] if s["name"].startswith(f"{role} Req ")]
        assert root["parent_span_id"] == router["spanId"]
        assert (names[forward]["stage"], names[transfer]["stage"]) == ("decode", "cache")
    assert {s["service"] for s in doc["spans"]} == {"smg", "sglang-prefill", "sglang-decode"}
    assert UNROUTED_RID not in json.dumps(doc)


def test_the_kv_transfer_of_a_routed_request_is_weighed_at_each_end_on_its_own_host(store, receiver):
    """The routed request's cache stage (its KV transfer) has two ends in its one trace: where the fabric's counters
    are read for it, each half's transfer spans are weighed on that half's host over its own window, as for the same
    request without a router (tests/test_kv_transfer_fabric.py). Beside it the unrouted request, on other hosts."""
    from stagetrace.analysis.fabric import watched
    from stagetrace.analysis.hardware import Samples

    send(receiver, "router-pd", {"sglang-prefill": "pf-a", "sglang-decode": "dc-a"})
    send(receiver, "prefill", {"sglang-prefill": "pf-b"})
    send(receiver, "decode", {"sglang-decode": "dc-b"})
    router, _ = routed("router-pd")
    trace = lookup.by_request_id(store, router["attributes"]["request_id"])
    first = min(trace.stages[("cache", "0")], key=lambda s: s.start_ns)
    samples = Samples(store, ["pf-a", "dc-a"], trace.start_ns, trace.start_ns + trace.duration_ns)
    ends = watched(trace, "cache", first, samples)
    assert [(w.half, w.host) for w in ends] == [("decode", "dc-a"), ("prefill", "pf-a")]
    for w in ends:
        spans = [s for s in trace.spans if s.stage == "cache" and s.service == f"sglang-{w.half}"]
        assert (w.start_ns, w.end_ns) == (
            min(s.start_ns for s in spans),
            max(s.start_ns + s.duration_ns for s in spans),
        )
