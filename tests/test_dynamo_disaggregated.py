"""NVIDIA Dynamo's prefill/decode disaggregation, read whole (issue 53).

Recorded from Dynamo 1.6.1's real frontend in front of two of its mocker workers, one registered as the prefill
worker (``--disaggregation-mode prefill``) and one as the decode worker (``--disaggregation-mode decode``), each process
exporting its own spans (tests/fixtures/dynamo/serve-disagg.json; README.md beside it says how). A GPU is what a real
engine would need; the mocker is Dynamo's own GPU-less worker, which registers and is routed to as a real one is. The
export is sent over OTLP/HTTP into a running receiver and read from the real store. The neighbour: the aggregated
recording (one worker, serve.json) in the same store, whose requests keep their one worker's decode.
"""

from __future__ import annotations

import json

import pytest

from stagetrace import lookup
from stagetrace.analysis.explain import Explainer
from stagetrace.exporters.otlp import OtlpReceiver
from stagetrace.report import incident_html
from stagetrace.store import open_store
from tests.test_engines import DYNAMO, dynamo_roots, send

pytestmark = pytest.mark.views_row_for_row

DISAGGREGATED = "serve-disagg"
AGGREGATED = "serve"
# the services record.py named each process (OTEL_SERVICE_NAME)
FRONTEND, PREFILL, DECODE, WORKER = "dynamo-frontend", "dynamo-prefill-worker", "dynamo-decode-worker", "dynamo-worker"


def request_id(root: dict) -> str:
    """The ID a person holds for a recorded request: the client's x-request-id where it sent one, else Dynamo's."""
    return root.get("x_request_id") or root["request_id"]


def response_id(root: dict) -> str:
    """The ``id`` of the response the client got."""
    return ("cmpl-" if root["uri"] == "/v1/completions" else "chatcmpl-") + root["request_id"]


def recorded_services() -> set[str]:
    services = set()
    for message in json.loads((DYNAMO / f"{DISAGGREGATED}.json").read_text()):
        for resource in message["resourceSpans"]:
            attributes = {a["key"]: a["value"]["stringValue"] for a in resource["resource"]["attributes"]}
            services.add(attributes["service.name"])
    return services


@pytest.fixture
def stored(store_dsn):
    """The store DSN after the disaggregated recording and the aggregated one were received, the store closed (chdb
    opens a path once per process: the command line opens it again)."""
    with open_store(store_dsn) as store:
        receiver = OtlpReceiver(store, "127.0.0.1:0")
        try:
            send(receiver, DISAGGREGATED, DYNAMO)
            send(receiver, AGGREGATED, DYNAMO)
        finally:
            receiver.close()
    return store_dsn


def test_the_recording_holds_each_process_s_own_export():
    """The fixture is what three processes sent: the frontend, the prefill worker and the decode worker."""
    assert recorded_services() == {FRONTEND, PREFILL, DECODE}
    roots = dynamo_roots(DISAGGREGATED)
    assert len(roots) == 5  # record.py's five requests
    # the frontend's root names both workers it routed to, each once for all five (one of each kind ran)
    assert len({(r["prefill_worker_id"], r["decode_worker_id"]) for r in roots if "prefill_worker_id" in r}) == 1


def test_a_disaggregated_request_is_one_request_with_its_prefill_and_its_decode(stored):
    """Each request the frontend served disaggregated is one request, found by the client's x-request-id (or Dynamo's
    request_id, or the response's ``chatcmpl-``/``cmpl-`` id where the client named none): the frontend's root over
    two route spans, one over the prefill worker's handle_payload and one over the decode worker's, in one trace (the
    frontend propagates its context to each worker). Both handlings are passes of the decode stage, the prefill's
    first, as SGLang's prefill and decode forward passes are. No worker's span is listed as a request of its own; the
    aggregated requests beside them keep their one worker's handling."""
    with open_store(stored) as store:
        listed = store.client.query(
            "SELECT RequestId, ServiceName, SpanName FROM stagetrace.stagetrace_requests"
        ).result_rows
        disaggregated, aggregated = dynamo_roots(DISAGGREGATED), dynamo_roots(AGGREGATED)
        assert sorted(listed) == sorted(
            (request_id(r), FRONTEND, "http-request") for r in disaggregated + aggregated
        ), listed

        worker_ids = {}
        for root in disaggregated:
            trace = lookup.by_request_id(store, request_id(root))
            assert trace.trace_id == root["trace_id"] and trace.service == FRONTEND, request_id(root)
            staged = [s for s in trace.spans if s.stage]
            assert [(s.name, s.service, s.stage) for s in staged] == [
                ("handle_payload", PREFILL, "decode"),
                ("handle_payload", DECODE, "decode"),
            ], request_id(root)
            prefill, decode = staged
            assert prefill.start_ns <= decode.start_ns
            # the decode stage's passes are both handlings, the prefill's first: its input is the stage's input
            assert list(trace.stages) == [("decode", "")]
            assert trace.stages[("decode", "")] == [prefill, decode]
            # each handling below a route span of the frontend's root, the worker it routed to the one that handled
            by_id = {s.span_id: s for s in trace.spans}
            for span in staged:
                route = by_id[span.parent_span_id]
                assert route.name == "router.route_request" and route.service == FRONTEND
                assert route.parent_span_id in by_id  # the root, or completions_single below it (/v1/completions)
                assert route.attributes["worker_id"] == span.attributes["instance_id"]
            worker_ids[request_id(root)] = (prefill.attributes["instance_id"], decode.attributes["instance_id"])
            # where the root names the workers (chat completions), they are these two
            if "prefill_worker_id" in root:
                assert worker_ids[request_id(root)] == (root["prefill_worker_id"], root["decode_worker_id"])
            # by the response's id too, where the client named the request by none of its own
            if "x_request_id" not in root:
                assert lookup.by_request_id(store, response_id(root)).trace_id == root["trace_id"]
        assert len(set(worker_ids.values())) == 1 and len(worker_ids) == 5

        # the neighbour: the aggregated requests, each one worker's one handling
        for root in aggregated:
            trace = lookup.by_request_id(store, request_id(root))
            assert trace.trace_id == root["trace_id"]
            assert [(s.name, s.service, s.stage) for s in trace.spans if s.stage] == [
                ("handle_payload", WORKER, "decode")
            ]


def test_trace_json_and_the_incident_report_hold_both_workers_spans(stored, capsys):
    """``stagetrace trace ID --json`` shows the disaggregated request's spans of all three processes, both workers'
    handlings as its decode; ``explain --html``'s page draws both in the request's waterfall. The aggregated neighbour's
    page draws its one."""
    from stagetrace.cli import main

    root = dynamo_roots(DISAGGREGATED)[0]
    assert main(["trace", request_id(root), "--store", stored, "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert (shown["request_id"], shown["trace_id"]) == (request_id(root), root["trace_id"])
    assert {s["service"] for s in shown["spans"]} == {FRONTEND, PREFILL, DECODE}
    assert [(s["service"], s["stage"]) for s in shown["spans"] if s["name"] == "handle_payload"] == [
        (PREFILL, "decode"),
        (DECODE, "decode"),
    ]

    neighbour = dynamo_roots(AGGREGATED)[0]
    with open_store(stored) as store:
        pages = {}
        for r in (root, neighbour):
            report = Explainer(store).explain(request_id(r))
            assert report.trace_id == r["trace_id"] and not report.diverged
            pages[request_id(r)] = incident_html(store, report)
    drawn = {rid: page.count('data-stage="decode"') for rid, page in pages.items()}
    assert drawn == {request_id(root): 2, request_id(neighbour): 1}, drawn
