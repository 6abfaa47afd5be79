"""The ``weights`` cause detector: a GPU that serves older weights than its fleet (it missed a weight sync).

The class of case: a service's GPUs (one per host) serve seeded greedy requests with the same input; a weight
sync moves the fleet from one training step to the next at some moment, and the weights of each step give
their own outputs. A GPU that missed the sync keeps serving the old step, so its outputs differ from the
fleet's. Variations: a GPU on the fleet's step that diverges for another reason, a canary GPU ahead of the
fleet, a fleet of only one other GPU. Spans are made with the plain OpenTelemetry SDK (one provider per host,
explicit times) and written through ``ClickHouseSpanExporter`` into a real embedded store; the verdicts come
from the public ``Explainer.explain``.
"""

from __future__ import annotations

import time

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from stagetrace.exporters.clickhouse import ClickHouseSpanExporter

from stagetrace import conventions as cv
from stagetrace.analysis.detectors.weights import WINDOW_S
from stagetrace.analysis.explain import Explainer
from stagetrace.digest import digest
from stagetrace.lookup import iso_ns

SECOND = 1_000_000_000
MINUTE = 60 * SECOND
PROMPT = {
    "prompt": "why is the sky blue?",
    "model": "acme-8b",
    "gen_ai.request.temperature": 0.0,
    "gen_ai.request.seed": 7,
}
OLD, NEW = 41, 42


class Fleet:
    """GPUs of one service, one per host, serving the same seeded greedy request at explicit times."""

    def __init__(self, store, service: str = "chat"):
        self.store = store
        self.service = service
        self.t0 = (time.time_ns() // MINUTE) * MINUTE - 120 * MINUTE  # inside every default analysis window
        self.memory = InMemorySpanExporter()
        self.providers: dict[str, TracerProvider] = {}
        self.requests: list[dict] = []

    def _tracer(self, host: str):
        if host not in self.providers:
            provider = TracerProvider(resource=Resource.create({"service.name": self.service, "host.name": host}))
            provider.add_span_processor(SimpleSpanProcessor(self.memory))
            self.providers[host] = provider
        return self.providers[host].get_tracer("app")

    def request(self, at_ns: int, gpu: str, host: str, step: int, batch: int = 16, odd: str = "") -> dict:
        """One request: a root span and its decode stage, whose output is that of the step's weights (``odd``:
        something else made this one differ too)."""
        rid = f"{gpu}-{len(self.requests):04d}"
        tracer = self._tracer(host)
        stage_input = digest(["decode", PROMPT])
        output = digest(["tokens", PROMPT, step, odd])
        root = tracer.start_span(
            "inference.request",
            kind=SpanKind.SERVER,
            start_time=at_ns,
            attributes={
                cv.REQUEST_ID: rid,
                cv.INPUT_DIGEST: digest(PROMPT),
                cv.OUTPUT_DIGEST: output,
                "gen_ai.request.model": PROMPT["model"],
                "gen_ai.request.temperature": 0.0,
                "gen_ai.request.seed": 7,
            },
        )
        decode = tracer.start_span(
            "stage.decode",
            context=trace.set_span_in_context(root),
            kind=SpanKind.INTERNAL,
            start_time=at_ns + 1_000_000,
            attributes={
                cv.STAGE: "decode",
                cv.STAGE_INPUT_DIGEST: stage_input,
                cv.STAGE_OUTPUT_DIGEST: output,
                cv.GPU_UUID: gpu,
                cv.WEIGHTS_STEP: step,
                "decode.batch_size": batch,
            },
        )
        decode.end(end_time=at_ns + 150_000_000)
        root.end(end_time=at_ns + 160_000_000)
        recorded = {
            "request_id": rid,
            "start_ns": at_ns,
            "decode_ns": at_ns + 1_000_000,
            "gpu": gpu,
            "host": host,
            "step": step,
        }
        self.requests.append(recorded)
        return recorded

    def serve(self, gpus: dict[str, str], minutes: int, step_of, every_s: int = 20) -> None:
        """Each GPU (uuid → host) serves a request every ``every_s``, staggered; ``step_of(gpu, t_ns)``."""
        for offset in range(0, minutes * 60, every_s):
            for i, (gpu, host) in enumerate(sorted(gpus.items())):
                at = self.t0 + offset * SECOND + i * 3 * SECOND
                self.request(at, gpu, host, step_of(gpu, at))

    def flush(self) -> None:
        writer = ClickHouseSpanExporter(store=self.store, spool_dir=False, create_schema=False)
        assert writer.export(self.memory.get_finished_spans()).name == "SUCCESS"
        self.memory.clear()

    def close(self) -> None:
        for provider in self.providers.values():
            provider.shutdown()


def gpus_of(n: int) -> dict[str, str]:
    return {f"GPU-{i:02d}-6f1c": f"node-{i}" for i in range(1, n + 1)}


def explain(store, request_id: str) -> dict:
    return Explainer(store).explain(request_id).to_json()


def weights_causes(report: dict) -> list[dict]:
    return [c for c in report["causes"] if c["kind"] == "weights"]


def synced_fleet(
    store,
    lagging: str,
    gpus: dict[str, str],
    sync_after_ns: int = 3 * MINUTE,
    minutes: int = 20,
    apart_ns: int = SECOND,
) -> tuple[Fleet, int]:
    """Every GPU but ``lagging`` moves from OLD to NEW ``sync_after_ns`` into the run (``apart_ns`` apart), so that
    most requests are served on NEW; ``lagging`` stays on OLD. Returns the fleet and the sync's first moment."""
    fl = Fleet(store)
    sync_ns = fl.t0 + sync_after_ns
    order = {gpu: i for i, gpu in enumerate(g for g in sorted(gpus) if g != lagging)}

    def step_of(gpu: str, at: int) -> int:
        return NEW if gpu != lagging and at >= sync_ns + order[gpu] * apart_ns else OLD

    fl.serve(gpus, minutes, step_of)
    return fl, sync_ns


def test_a_gpu_that_missed_the_sync_is_blamed_on_its_weights_with_its_fleets_step(store):
    gpus = gpus_of(4)
    lagging = sorted(gpus)[2]
    fl, sync_ns = synced_fleet(store, lagging, gpus)
    fl.flush()
    # a request of the lagging GPU after the sync, the sync within the window before it
    mine = [r for r in fl.requests if r["gpu"] == lagging and sync_ns + 3 * MINUTE <= r["start_ns"]]
    request = mine[0]
    assert request["start_ns"] - WINDOW_S * SECOND < sync_ns
    first_new = min(r["decode_ns"] for r in fl.requests if r["step"] == NEW)

    report = explain(store, request["request_id"])
    assert report["diverged"] and report["first_divergent_stage"] == "decode", report["summary"]
    top = report["causes"][0]
    assert (top["kind"], top["stage"], top["name"], top["value"], top["baseline_value"]) == (
        "weights",
        "decode",
        cv.WEIGHTS_STEP,
        str(OLD),
        str(NEW),
    ), report["causes"][:3]
    assert top["weak"] is False
    assert {
        k: top[k]
        for k in ("gpu", "host", "fleet_step", "steps_behind", "gpus", "gpus_on_fleet_step", "fleet_step_since")
    } == {
        "gpu": lagging,
        "host": gpus[lagging],
        "fleet_step": NEW,
        "steps_behind": NEW - OLD,
        "gpus": 3,
        "gpus_on_fleet_step": 3,
        "fleet_step_since": iso_ns(first_new),
    }
    # one entry for the step: the attribute difference and the lagging rollout of it are the same fact
    assert [c["kind"] for c in report["causes"] if c["name"] == cv.WEIGHTS_STEP] == ["weights"], report["causes"]
    summary = report["summary"]
    assert lagging in summary and f"step {OLD}" in summary and f"served {NEW}" in summary, summary
    assert "missed a weight sync" in summary and report["baseline"]["request_id"] in summary, summary

    # a minute after the sync, where the sync is found as a rollout that the GPU lags: still one entry, this one
    soon = next(r for r in fl.requests if r["gpu"] == lagging and r["start_ns"] >= sync_ns + MINUTE)
    report = explain(store, soon["request_id"])
    assert [(r["name"], r["old"], r["new"]) for r in report["rollouts"]] == [(cv.WEIGHTS_STEP, str(OLD), str(NEW))]
    assert report["expected"] is False
    assert [c["kind"] for c in report["causes"] if c["name"] == cv.WEIGHTS_STEP] == ["weights"], report["causes"]
    assert report["causes"][0]["kind"] == "weights" and "missed a weight sync" in report["summary"]

    # long after the sync (its moment out of the window) the GPU is still behind; the fleet's step is older
    # than the window: it was served from the window's start
    late = [r for r in fl.requests if r["gpu"] == lagging][-1]
    report = explain(store, late["request_id"])
    top = report["causes"][0]
    assert (top["kind"], top["value"], top["fleet_step"], top["gpus_on_fleet_step"]) == ("weights", "41", NEW, 3)
    in_window = [
        r["decode_ns"]
        for r in fl.requests
        if r["step"] == NEW and r["decode_ns"] >= late["start_ns"] - WINDOW_S * SECOND
    ]
    assert top["fleet_step_since"] == iso_ns(min(in_window))
    fl.close()


def test_a_gpu_not_yet_synced_while_the_sync_still_rolls_out_is_an_expected_change(store):
    gpus = gpus_of(4)
    lagging = sorted(gpus)[2]
    # the other GPUs move a minute apart: the fleet (most GPUs) is on NEW two minutes after the first, and the
    # wave is given as long again for the slower ones
    fl, sync_ns = synced_fleet(store, lagging, gpus, apart_ns=MINUTE)
    fl.flush()
    request = next(r for r in fl.requests if r["gpu"] == lagging and r["start_ns"] >= sync_ns + 3 * MINUTE)
    report = explain(store, request["request_id"])
    assert report["expected"] is True, report["summary"]
    assert (report["causes"][0]["kind"], report["causes"][0]["name"]) == ("rollout", cv.WEIGHTS_STEP)
    assert weights_causes(report) == [], report["causes"]
    fl.close()


def test_a_gpu_on_the_fleets_step_gets_no_weights_cause(store):
    gpus = gpus_of(4)
    lagging = sorted(gpus)[2]
    fl, _ = synced_fleet(store, lagging, gpus)
    # a GPU on the fleet's step whose decode differs for another reason (an odd batch)
    healthy = min(gpus)
    odd = fl.request(fl.t0 + 6 * MINUTE + 1 * SECOND, healthy, gpus[healthy], NEW, batch=48, odd="batch48")
    fl.flush()
    report = explain(store, odd["request_id"])
    assert report["diverged"] and report["first_divergent_stage"] == "decode", report["summary"]
    assert weights_causes(report) == [], report["causes"]
    assert cv.WEIGHTS_STEP not in {c["name"] for c in report["causes"]}, report["causes"]
    assert "missed a weight sync" not in report["summary"]
    fl.close()


def test_a_canary_ahead_of_its_fleet_gets_no_weights_cause(store):
    gpus = gpus_of(4)
    canary = sorted(gpus)[1]
    fl = Fleet(store)
    canary_from = fl.t0 + 8 * MINUTE
    fl.serve(gpus, 20, lambda gpu, at: NEW if gpu == canary and at >= canary_from else OLD)
    fl.flush()
    request = next(r for r in fl.requests if r["gpu"] == canary and r["start_ns"] >= canary_from + 3 * MINUTE)
    report = explain(store, request["request_id"])
    assert report["diverged"] and report["first_divergent_stage"] == "decode", report["summary"]
    assert weights_causes(report) == [], report["causes"]
    top = report["causes"][0]
    assert (top["kind"], top["name"], top["value"], top["baseline_value"]) == (
        "attribute",
        cv.WEIGHTS_STEP,
        str(NEW),
        str(OLD),
    ), report["causes"][:3]
    fl.close()


def test_of_three_gpus_one_canary_ahead_is_not_the_fleet_for_the_other_two(store):
    """With three GPUs, a GPU explained has two others: a canary ahead and one on the old step. Half of them is no
    majority, so the fleet's step stays the old one and a healthy GPU on it missed nothing."""
    gpus = gpus_of(3)
    canary, healthy = sorted(gpus)[0], sorted(gpus)[2]
    fl = Fleet(store)
    canary_from = fl.t0 + 8 * MINUTE
    fl.serve(gpus, 20, lambda gpu, at: NEW if gpu == canary and at >= canary_from else OLD)
    odd = fl.request(fl.t0 + 12 * MINUTE + 1 * SECOND, healthy, gpus[healthy], OLD, batch=48, odd="batch48")
    fl.flush()
    report = explain(store, odd["request_id"])
    assert report["diverged"] and report["first_divergent_stage"] == "decode", report["summary"]
    assert weights_causes(report) == [], report["causes"]
    assert "missed a weight sync" not in report["summary"]
    fl.close()


def test_a_fleet_of_one_other_gpu_gets_no_weights_cause(store):
    fl = Fleet(store)
    behind, other = "GPU-01-6f1c", "GPU-02-6f1c"
    # the other GPU serves three requests for each of the one behind, so its output is the majority
    for offset in range(0, 20 * 60, 10):
        at = fl.t0 + offset * SECOND
        fl.request(at, other, "node-2", NEW)
        if offset % 30 == 0:
            fl.request(at + 2 * SECOND, behind, "node-1", OLD)
    fl.flush()
    request = [r for r in fl.requests if r["gpu"] == behind][-5]
    report = explain(store, request["request_id"])
    assert report["diverged"] and report["first_divergent_stage"] == "decode", report["summary"]
    assert weights_causes(report) == [], report["causes"]
    # the step still differs from the baseline's, as an attribute difference, as before
    steps = [(c["kind"], c["value"], c["baseline_value"]) for c in report["causes"] if c["name"] == cv.WEIGHTS_STEP]
    assert steps == [("attribute", str(OLD), str(NEW))], report["causes"]
    fl.close()
