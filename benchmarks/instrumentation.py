"""Instrumentation overhead: a 5-stage request through the stage-span API against the bare OpenTelemetry SDK.

Both sides make the same six spans (a SERVER root with the request ID and digests, five INTERNAL stage
spans with stage name, input and output digests and one attribute each) on their own ``TracerProvider``
with the same resource and the same ``SimpleSpanProcessor`` into an exporter that does nothing, so only
the cost of making and ending the spans is timed. Blocks of requests alternate between the two sides
and the figure is the median block, so load on the shared machine hits both alike.

Two variants: digests handed in (``input_digest=`` / ``set_output(output_digest=)``, the API's own cost),
and digests computed from the values (the API hashes them; the bare side calls the same ``digest``).
"""

from __future__ import annotations

import statistics
import time

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.trace import SpanKind

import stagetrace.tracing as st
from benchmarks import Figure, benchmark
from stagetrace.digest import digest

STAGES = st.PIPELINE_STAGES
# what each stage is given and returns (small values, as digests of real prompts would be of larger ones)
INPUT = {"prompt": "why is the sky blue?", "model": "m-7b", "seed": 7, "temperature": 0.0}
VALUES = {stage: (f"{stage} in", f"{stage} out") for stage in STAGES}
OUTPUT = "because of Rayleigh scattering"
ATTRIBUTE = {stage: (f"{stage}.setting", "a") for stage in STAGES}


class _NoOpExporter(SpanExporter):
    def export(self, spans) -> SpanExportResult:
        return SpanExportResult.SUCCESS


def _provider() -> TracerProvider:
    provider = TracerProvider(resource=Resource.create({"service.name": "bench", "host.name": "bench"}))
    provider.add_span_processor(SimpleSpanProcessor(_NoOpExporter()))
    return provider


_DIGESTS = {stage: (digest(i), digest(o)) for stage, (i, o) in VALUES.items()}
_INPUT_DIGEST, _OUTPUT_DIGEST = digest(INPUT), digest(OUTPUT)


def _stagetrace_given(n: int) -> None:
    for i in range(n):
        with st.request(f"req-{i}", input_digest=_INPUT_DIGEST) as req:
            for stage in STAGES:
                key, value = ATTRIBUTE[stage]
                with st.stage(stage, input_digest=_DIGESTS[stage][0], attributes={key: value}) as s:
                    s.set_output(output_digest=_DIGESTS[stage][1])
            req.set_output(output_digest=_OUTPUT_DIGEST)


def _stagetrace_computed(n: int) -> None:
    for i in range(n):
        with st.request(f"req-{i}", input=INPUT) as req:
            for stage in STAGES:
                key, value = ATTRIBUTE[stage]
                with st.stage(stage, input=VALUES[stage][0], attributes={key: value}) as s:
                    s.set_output(VALUES[stage][1])
            req.set_output(OUTPUT)


def _bare(tracer, computed: bool):
    def run(n: int) -> None:
        for i in range(n):
            in_digest = digest(INPUT) if computed else _INPUT_DIGEST
            with tracer.start_as_current_span(
                "inference.request",
                kind=SpanKind.SERVER,
                attributes={st.REQUEST_ID: f"req-{i}", st.INPUT_DIGEST: in_digest},
            ) as root:
                for stage in STAGES:
                    key, value = ATTRIBUTE[stage]
                    stage_in = digest(VALUES[stage][0]) if computed else _DIGESTS[stage][0]
                    with tracer.start_as_current_span(
                        f"stage.{stage}",
                        kind=SpanKind.INTERNAL,
                        attributes={key: value, st.STAGE: stage, st.STAGE_INPUT_DIGEST: stage_in},
                    ) as span:
                        span.set_attribute(
                            st.STAGE_OUTPUT_DIGEST, digest(VALUES[stage][1]) if computed else _DIGESTS[stage][1]
                        )
                root.set_attribute(st.OUTPUT_DIGEST, digest(OUTPUT) if computed else _OUTPUT_DIGEST)

    return run


def _side_by_side(ours, theirs, block: int, rounds: int) -> tuple[float, float]:
    """Median µs per request of each side over ``rounds`` alternating blocks of ``block`` requests."""
    times: dict[str, list[float]] = {"ours": [], "theirs": []}
    ours(block // 10 or 1)  # warm-up
    theirs(block // 10 or 1)
    for r in range(rounds):
        order = (("ours", ours), ("theirs", theirs)) if r % 2 == 0 else (("theirs", theirs), ("ours", ours))
        for name, function in order:
            started = time.perf_counter()
            function(block)
            times[name].append((time.perf_counter() - started) / block * 1e6)
    return statistics.median(times["ours"]), statistics.median(times["theirs"])


@benchmark("instrumentation")
def instrumentation(quick: bool) -> list[Figure]:
    block, rounds = (200, 5) if quick else (2000, 25)
    ours_provider, bare_provider = _provider(), _provider()
    st.configure(tracer_provider=ours_provider, record_content=False)
    bare_tracer = bare_provider.get_tracer("bare")
    try:
        given = _side_by_side(_stagetrace_given, _bare(bare_tracer, computed=False), block, rounds)
        computed = _side_by_side(_stagetrace_computed, _bare(bare_tracer, computed=True), block, rounds)
    finally:
        st.shutdown()
        ours_provider.shutdown()
        bare_provider.shutdown()
    baseline = "bare OpenTelemetry SDK, same 6 spans, no-op exporter"
    return [
        Figure(
            f"5-stage request (6 spans), digests given, median of {rounds} blocks of {block}",
            given[0],
            "µs",
            baseline,
            given[1],
        ),
        Figure(
            "5-stage request (6 spans), digests computed from the values (both sides)",
            computed[0],
            "µs",
            baseline,
            computed[1],
        ),
    ]
