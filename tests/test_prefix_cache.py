"""A prefix-cache hit as a cause (issue 53): SGLang-shaped requests built from the export SGLang 0.5.23's own tracing
module sent (tests/fixtures/sglang/unified-tp2.json; README beside it), each a copy with its own trace, rid and
cached-token count on its root, below an application's request and decode stage that record the digests (SGLang's
spans record none), sent over OTLP/HTTP into a running receiver and read from the real store."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from google.protobuf import json_format
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from stagetrace import conventions
from stagetrace.analysis import divergences
from stagetrace.analysis.detectors import prefix_cache
from stagetrace.analysis.explain import Explainer
from tests.engine_exports import application_above
from tests.test_engines import post

pytestmark = pytest.mark.views_row_for_row

EXPORT = Path(__file__).parent / "fixtures" / "sglang" / "unified-tp2.json"
PROMPT, AGREED, OTHER = "1f" * 16, "aa" * 16, "bb" * 16
ROOT = " Req "


def sglang_request(
    receiver,
    n: int,
    cached: float | None,
    output: str,
    host: str = "node-a",
    driver: str = "575.57",
    configuration: dict | None = None,
) -> str:
    """The recorded request again as request ``sgl-<n>``, ``n`` seconds later, on ``host`` with GPU driver ``driver``
    and ``configuration`` on its processes' resources (as the configuration detector records them), its root
    recording ``cached`` prefix-cache tokens (None: no count, as an engine that records none) and sent after the
    rest; above it an application's request (the prompt's and ``output``'s digests) and the decode stage that called
    the engine (its output's digest). Returns the request ID."""
    message = json_format.ParseDict(json.loads(EXPORT.read_text())[0], ExportTraceServiceRequest())
    trace_id, shift = bytes([0x53, n]) * 8, n * 10**9
    spans = [s for r in message.resource_spans for ss in r.scope_spans for s in ss.spans]
    root = next(s for s in spans if ROOT in s.name)
    for resource in list(message.resource_spans):
        for key, value in {conventions.CONFIGURATION_DRIVER: driver, **(configuration or {})}.items():
            resource.resource.attributes.add(key=key, value={"string_value": value})
        resource.resource.attributes.add(key="host.name", value={"string_value": host})
    for span in spans:
        span.trace_id = trace_id
        span.span_id = bytes([n]) + span.span_id[1:]
        if span.parent_span_id:
            span.parent_span_id = bytes([n]) + span.parent_span_id[1:]
        span.start_time_unix_nano += shift
        span.end_time_unix_nano += shift
    request_id = f"sgl-{n}"
    for attribute in root.attributes:
        if attribute.key in ("rid", "gen_ai.request.id"):
            attribute.value.string_value = request_id
        if attribute.key == "gen_ai.usage.cached_tokens" and cached is not None:
            attribute.value.double_value = cached
    if cached is None:
        kept = [a for a in root.attributes if a.key != "gen_ai.usage.cached_tokens"]
        del root.attributes[:]
        root.attributes.extend(kept)
    resource = {"service.name": "rag-app", "host.name": host, conventions.CONFIGURATION_DRIVER: driver}
    application_above(message, root, resource, PROMPT, output, (bytes([n, 0xA0]) * 4, bytes([n, 0xA1]) * 4))
    # the root ends last, and SGLang's batch exporter sends it after its stage spans: an export of its own
    alone = ExportTraceServiceRequest()
    holder = next(r for r in message.resource_spans for ss in r.scope_spans if root in ss.spans)
    moved = alone.resource_spans.add(resource=holder.resource).scope_spans.add().spans.add()
    moved.CopyFrom(root)
    for scope_spans in holder.scope_spans:
        kept = [s for s in scope_spans.spans if s.span_id != root.span_id]
        del scope_spans.spans[:]
        scope_spans.spans.extend(kept)
    post(receiver, message)
    post(receiver, alone)
    return request_id


@pytest.fixture
def receiver(store):
    from stagetrace.exporters.otlp import OtlpReceiver

    r = OtlpReceiver(store, "127.0.0.1:0")
    yield r
    r.close()


def test_a_request_whose_prefix_cache_hit_differs_from_its_baseline_s_is_explained_by_it(store, receiver):
    """Five requests with one prompt on node-a, cold (no cached tokens), agree; a sixth whose 96 prompt tokens came
    from the prefix cache answers otherwise: the hit against the baseline's miss is its cause. The neighbours: at the
    same time on node-b another request of the prompt, as cold, ran on another GPU driver and answered otherwise:
    explained by that setting, never by the cache; and a warm request (64 cached tokens) whose output agreed is not
    listed at all."""
    ids = [sglang_request(receiver, n, 0, AGREED) for n in range(1, 6)]
    other_host = sglang_request(receiver, 6, 0, OTHER, host="node-b", driver="580.82")
    warm = sglang_request(receiver, 7, 96, OTHER)
    unharmed = sglang_request(receiver, 8, 64, AGREED)
    receiver.writer.flush()

    cached = {**dict.fromkeys(ids, "0"), unharmed: "64"}  # the agreeing requests' hits: a miss, or a shorter prefix

    report = Explainer(store).explain(warm).to_json()
    assert report["diverged"] and report["first_divergent_stage"] == "decode", report["summary"]
    baseline = report["baseline"]["request_id"]
    top = next(c for c in report["causes"] if not c["weak"])
    assert (top["kind"], top["name"], top["value"], top["baseline_value"]) == (
        "prefix_cache",
        "gen_ai.usage.cached_tokens",
        "96",
        cached[baseline],
    ), report["causes"]
    assert top["hit"] and top["baseline_hit"] == (baseline == unharmed)
    assert top["span"].startswith("Req ") and top["host"] == "node-a"
    assert f"gen_ai.usage.cached_tokens 96 vs {cached[baseline]}" in report["summary"]
    # against a cold baseline named explicitly: a hit against a miss
    cold = Explainer(store).explain(warm, against=ids[-1]).to_json()
    top = next(c for c in cold["causes"] if not c["weak"])
    assert (top["kind"], top["value"], top["baseline_value"], top["baseline_hit"]) == ("prefix_cache", "96", "0", False)
    assert conventions.PREFIX_CACHE_HIT in report["summary"]

    neighbour = Explainer(store).explain(other_host).to_json()
    top = next(c for c in neighbour["causes"] if not c["weak"])
    assert top["name"] == conventions.CONFIGURATION_DRIVER, neighbour["causes"]
    assert not any(c["kind"] == "prefix_cache" for c in neighbour["causes"])

    # what divergences finds over the same minutes, reading stage spans only: the hit from the roots in the store
    start = min(
        s
        for (s,) in store.client.query(
            "SELECT toUnixTimestamp64Nano(min(Timestamp)) FROM stagetrace.otel_traces"
        ).result_rows
    )
    result = divergences.find(store, 3600 * 10**9, until_ns=start + 60 * 10**9)
    deviating = {i["request_id"]: i for g in result["groups"] for i in g["deviating"]}
    assert set(deviating) == {warm, other_host}, deviating
    assert deviating[warm]["top_cause"]["kind"] == "prefix_cache"
    assert deviating[other_host]["top_cause"]["name"] == conventions.CONFIGURATION_DRIVER
    assert unharmed not in deviating


def test_a_differing_hit_is_named_not_blamed_under_batch_invariance_and_an_unrecorded_hit_is_no_difference(
    store, receiver
):
    """SGLang run with --enable-deterministic-inference (batch invariance: a hit is bit-exact with a miss): a warm
    request that answers otherwise is not explained by its hit, which is named as weak evidence only. Beside it, on
    another service's engine that records no cached-token count, a request that answers otherwise: its hit is
    unknown, not a miss, so no prefix-cache cause is proposed against its cold baseline."""
    deterministic = {"engine.deterministic_inference": "true"}
    ids = [sglang_request(receiver, n, 0, AGREED, configuration=deterministic) for n in range(1, 5)]
    warm = sglang_request(receiver, 5, 96, OTHER, configuration=deterministic)
    unrecorded = sglang_request(receiver, 6, None, OTHER, configuration=deterministic)
    receiver.writer.flush()

    report = Explainer(store).explain(warm, against=ids[-1]).to_json()
    assert report["diverged"], report["summary"]
    named = [c for c in report["causes"] if c["kind"] == "prefix_cache"]
    assert len(named) == 1 and named[0]["weak"] and "batch invariance" in named[0]["neutral"], report["causes"]
    assert not any(c["kind"] == "prefix_cache" and not c["weak"] for c in report["causes"])
    assert conventions.PREFIX_CACHE_HIT not in report["summary"]

    report = Explainer(store).explain(unrecorded, against=ids[-1]).to_json()
    assert report["diverged"] and not any(c["kind"] == "prefix_cache" for c in report["causes"]), report["causes"]
    # the detector's reading of the root as stored: SGLang's double, and no count at all
    assert prefix_cache.hit([("x", {"gen_ai.usage.cached_tokens": "96.0"}, {})])[:2] == (
        "gen_ai.usage.cached_tokens",
        96,
    )
    assert prefix_cache.hit([("x", {"gen_ai.usage.prompt_tokens": "17"}, {})]) is None
