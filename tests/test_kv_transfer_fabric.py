"""The fabric's counters beside a disaggregated request's KV transfer (issue 53).

Requests built from the export SGLang 0.5.23's own tracing module sent for prefill/decode disaggregation
(tests/fixtures/sglang/prefill.json and decode.json; README beside them), each a copy with its own traces, rid and
hosts (a prefill host and a decode host on the halves' resources), sent over OTLP/HTTP into a running receiver and
read from the real store. SGLang records no digest: an application's request and decode stage above the decode half
record the prompt's and the answer's digests, and the transfer spans carry the KV cache's digest as sent
(``prefill_transfer_kv_cache``) and as received (``decode_transferred``), as an operator's hook would, so that a
corrupted transfer is the first stage that differs. The NIC counters are written in the agent's own metric format
(tests/fleet.py), since no mlx5 NIC exists here; SGLang's and mooncake's spans name no NIC, so every NIC the agent
collected on each end's host counts.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
from google.protobuf import json_format
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from stagetrace import conventions, lookup
from stagetrace.analysis import divergences
from stagetrace.analysis.explain import Explainer
from stagetrace.analysis.hardware import context as hardware_context
from tests.engine_exports import application_above
from tests.fleet import Fleet
from tests.test_engines import post

pytestmark = pytest.mark.views_row_for_row

SGLANG = Path(__file__).parent / "fixtures" / "sglang"
PROMPT, AGREED, OTHER = "2e" * 16, "aa" * 16, "bb" * 16
KV_SENT, KV_RECEIVED_BAD, KV_RECEIVED_OTHER = "c0" * 16, "c1" * 16, "c2" * 16
EVERY_NS = 60 * 10**9  # a request a minute: each one's scrape window (15 s scrapes) is its own
SCRAPE_NS = 15 * 10**9


def _messages(half: str) -> list[ExportTraceServiceRequest]:
    recorded = json.loads((SGLANG / f"{half}.json").read_text())
    return [json_format.ParseDict(m, ExportTraceServiceRequest()) for m in recorded]


def _spans(messages):
    return [s for m in messages for r in m.resource_spans for ss in r.scope_spans for s in ss.spans]


RECORDED_START = min(s.start_time_unix_nano for s in _spans(_messages("prefill")))


def disaggregated_request(
    receiver,
    n: int,
    start_ns: int,
    hosts: tuple[str, str],
    kv_received: str,
    output: str,
    driver: str = "575.57",
    kv_sent: str = KV_SENT,
) -> str:
    """The recorded disaggregated request again as ``pd-<n>``, beginning at ``start_ns``, its prefill half on
    ``hosts[0]`` and its decode half on ``hosts[1]`` (GPU driver ``driver`` on both), the prefill sending the KV
    cache with digest ``kv_sent``, the decode receiving it with digest ``kv_received`` and answering ``output``.
    Returns the request ID."""
    request_id, shift = f"pd-{n}", start_ns - RECORDED_START
    for number, (half, host) in enumerate(zip(("prefill", "decode"), hosts)):
        messages = _messages(half)
        for message in messages:
            for resource in message.resource_spans:
                for key, value in (("host.name", host), (conventions.CONFIGURATION_DRIVER, driver)):
                    resource.resource.attributes.add(key=key, value={"string_value": value})
        spans = _spans(messages)
        for span in spans:  # each half's traces (the request's, the mooncake sender's) renamed for this copy
            span.trace_id = bytes([0x53, n, number]) + span.trace_id[3:]
            span.span_id = bytes([n, number]) + span.span_id[2:]
            if span.parent_span_id:
                span.parent_span_id = bytes([n, number]) + span.parent_span_id[2:]
            span.start_time_unix_nano += shift
            span.end_time_unix_nano += shift
            if " Req " in span.name and span.name.startswith(half):
                root = span
                for attribute in span.attributes:
                    if attribute.key in ("rid", "gen_ai.request.id"):
                        attribute.value.string_value = request_id
            digest = {"prefill_transfer_kv_cache": kv_sent, "decode_transferred": kv_received}.get(span.name)
            if digest:
                span.attributes.add(key=conventions.STAGE_OUTPUT_DIGEST, value={"string_value": digest})
        if half == "decode":  # the application above the decode half: the prompt and the answer
            _application(messages[-1], root, host, driver, output)
        for message in messages:
            post(receiver, message)
    return request_id


def _application(message, root, host: str, driver: str, output: str) -> None:
    resource = {"service.name": "pd-app", "host.name": host, conventions.CONFIGURATION_DRIVER: driver}
    ids = (root.span_id[:2] + b"\xa0" * 6, root.span_id[:2] + b"\xa1" * 6)
    application_above(message, root, resource, PROMPT, output, ids)


# each end of the transfer: its span, and the host and NIC that count errors there in the test
ENDS = {"decode": ("decode_transferred", "dc-a", "mlx5_1"), "prefill": ("prefill_transfer_kv_cache", "pf-a", "mlx5_0")}


def _transfer_end(store, request_id: str, span: str) -> int:
    """When the request's ``span`` (one end's transfer) ended, in ns."""
    ((end,),) = store.client.query(
        "SELECT toUnixTimestamp64Nano(Timestamp) + Duration FROM stagetrace.otel_traces WHERE SpanName = {span:String}"
        " AND TraceId IN (SELECT TraceId FROM stagetrace.otel_traces WHERE SpanAttributes['rid'] = {rid:String})",
        parameters={"rid": request_id, "span": span},
    ).result_rows
    return end


@pytest.fixture
def receiver(store):
    from stagetrace.exporters.otlp import OtlpReceiver

    r = OtlpReceiver(store, "127.0.0.1:0")
    yield r
    r.close()


@pytest.mark.parametrize("end", sorted(ENDS))
def test_a_kv_transfer_whose_nic_counted_sequence_errors_at_one_end_is_explained_by_that_nic(store, receiver, end):
    """Five disaggregated requests with one prompt (prefill on pf-a, decode on dc-a, two NICs each) agree. A sixth on
    the same hosts received another KV cache and answered otherwise, while one NIC of one end's host (the decode
    host's second NIC, mlx5_1; or the prefill host's first, mlx5_0) counted out-of-sequence packets and packet
    sequence errors during that end's transfer: that NIC's counters on that host, at that end of the KV transfer (the
    cache stage), are its cause, and no other NIC. The neighbour: in the same minute another request of the prompt,
    on pf-b and dc-b with another GPU driver, received yet another KV cache: its NICs were quiet, so it is explained
    by its driver, never by the erring NIC."""
    span, host, nic = ENDS[end]
    t0 = time.time_ns() - 30 * 60 * 10**9
    agreeing = [
        disaggregated_request(receiver, n, t0 + n * EVERY_NS, ("pf-a", "dc-a"), KV_SENT, AGREED) for n in range(1, 6)
    ]
    broken = disaggregated_request(receiver, 6, t0 + 6 * EVERY_NS, ("pf-a", "dc-a"), KV_RECEIVED_BAD, OTHER)
    neighbour = disaggregated_request(
        receiver, 7, t0 + 6 * EVERY_NS + 10**9, ("pf-b", "dc-b"), KV_RECEIVED_OTHER, OTHER, driver="580.82"
    )
    receiver.writer.flush()
    # the agent's NIC counters, scraped every 15 s all along: one NIC counts errors in the scrape after the sixth
    # request's transfer at its end ended, every other NIC stays where it was
    errored = _transfer_end(store, broken, span) + 2 * 10**9
    fleet, first, last = Fleet(store), t0 - 5 * 60 * 10**9, t0 + 15 * 60 * 10**9
    for where, device in (
        ("pf-a", "mlx5_0"),
        ("pf-a", "mlx5_1"),
        ("dc-a", "mlx5_0"),
        ("dc-a", "mlx5_1"),
        ("pf-b", "mlx5_0"),
        ("dc-b", "mlx5_0"),
    ):
        rises = ((errored, 7.0),) if (where, device) == (host, nic) else ()
        for metric in ("rdma_out_of_sequence_total", "rdma_packet_seq_err_total"):
            fleet.counter(
                where, metric, {"device": device, "port": "1"}, first, last, every_ns=SCRAPE_NS, value=12, rises=rises
            )

    report = Explainer(store).explain(broken).to_json()
    assert report["diverged"] and report["first_divergent_stage"] == "cache", report["summary"]
    assert report["baseline"]["request_id"] in agreeing
    top = report["causes"][0]
    assert (top["kind"], top["stage"], top["host"], top["device"], top["half"]) == (
        "hardware",
        "cache",
        host,
        nic,
        end,
    ), report["causes"][:3]
    assert top["name"] in ("rdma_out_of_sequence_total", "rdma_packet_seq_err_total") and top["value"] == "+7"
    hardware = [c for c in report["causes"] if c["kind"] == "hardware"]
    assert {(c["host"], c["device"], c["half"]) for c in hardware} == {(host, nic, end)}, hardware
    assert re.search(rf"rose by 7 .*cache.* {nic} \({host}, the {end} end of the KV transfer\)", report["summary"]), (
        report["summary"]
    )
    # the verdict names where the difference showed first: what the prefill end sent agreed with the baseline's,
    # what the decode end received did not, so the decode's host, whichever end's NIC erred
    assert report["summary"].startswith("cache diverged on rank 0 (dc-a): "), report["summary"]
    # stagetrace trace's hardware table beside the waterfall: the same NIC, at the KV transfer
    shown = hardware_context(store, lookup.by_request_id(store, broken))
    assert {(c["stage"], c["host"], c["device"]) for c in shown} == {("cache", host, nic)}, shown

    other = Explainer(store).explain(neighbour).to_json()
    assert other["diverged"] and other["first_divergent_stage"] == "cache", other["summary"]
    assert not any(c["kind"] == "hardware" for c in other["causes"]), other["causes"]
    assert next(c for c in other["causes"] if not c["weak"])["name"] == conventions.CONFIGURATION_DRIVER

    # divergences over the same minutes says the same of each
    result = divergences.find(store, 3600 * 10**9, until_ns=t0 + 10 * 60 * 10**9)
    deviating = {i["request_id"]: i for g in result["groups"] for i in g["deviating"]}
    assert set(deviating) == {broken, neighbour}, deviating
    found = deviating[broken]["top_cause"]
    assert (found["kind"], found["name"], found["host"], found["device"], found.get("half")) == (
        "hardware",
        top["name"],
        host,
        nic,
        end,
    ), found
    assert deviating[neighbour]["top_cause"]["name"] == conventions.CONFIGURATION_DRIVER
    # the tally names the same host for it, analysed in full or not (the SQL twin: limit 1 analyses the neighbour)
    for limit in (100, 1):
        lines = divergences.find(store, 3600 * 10**9, until_ns=t0 + 10 * 60 * 10**9, limit=limit)["tally"]
        assert {h for line in lines for h in line.get("began_on", {})} == {"dc-a", "dc-b"}, lines


def test_the_verdict_names_the_end_of_the_kv_transfer_where_the_difference_showed_first(store, receiver):
    """Five disaggregated requests with one prompt (prefill on pf-a, decode on dc-a) agree. A sixth's prefill server
    sent another KV cache, and its decode received that: the difference showed first at the sending end, so the
    verdict and divergences name the prefill's host, pf-a. The neighbour, in the same minutes on pf-b and dc-b: its
    prefill sent what the others did and its decode received another cache, so its verdict names the decode's host,
    dc-b. No hardware counter rose anywhere: the place comes from the digests alone."""
    t0 = time.time_ns() - 30 * 60 * 10**9
    for n in range(1, 6):
        disaggregated_request(receiver, n, t0 + n * EVERY_NS, ("pf-a", "dc-a"), KV_SENT, AGREED)
    sent_otherwise = disaggregated_request(
        receiver, 6, t0 + 6 * EVERY_NS, ("pf-a", "dc-a"), KV_RECEIVED_BAD, OTHER, kv_sent=KV_RECEIVED_BAD
    )
    received_otherwise = disaggregated_request(
        receiver, 7, t0 + 6 * EVERY_NS + 10**9, ("pf-b", "dc-b"), KV_RECEIVED_OTHER, OTHER
    )
    receiver.writer.flush()
    for request, host in ((sent_otherwise, "pf-a"), (received_otherwise, "dc-b")):
        report = Explainer(store).explain(request).to_json()
        assert report["diverged"] and report["first_divergent_stage"] == "cache", report["summary"]
        assert report["summary"].startswith(f"cache diverged on rank 0 ({host}): "), report["summary"]
    # divergences says the same of the requests it analyses in full (the tally's SQL twin reads a request's own
    # trace, the decode half of an SGLang request split without a traced router: docs/instrumented.md)
    lines = divergences.find(store, 3600 * 10**9, until_ns=t0 + 10 * 60 * 10**9)["tally"]
    began = {h: n for line in lines for h, n in line.get("began_on", {}).items()}
    assert began == {"pf-a": 1, "dc-b": 1}, lines
