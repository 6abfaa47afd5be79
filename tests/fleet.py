"""A small simulated fleet, recorded into a real store at explicit (simulated) times.

Spans are made with the OpenTelemetry SDK, one ``TracerProvider`` per host (so each span carries its own
resource ``host.name``, as TP ranks on other nodes do), with explicit ``start_time`` / ``end_time`` so a
rollout can spread over simulated minutes without a test sleeping. They follow the span conventions
(``stagetrace.conventions``): a SERVER root with the request ID and input/output digests, one child span per
stage with ``stagetrace.stage`` and the stage's digests, and for a TP stage one span per rank with
``parallel.tp_rank``. They reach ``otel_traces`` through stagetrace's own ``ClickHouseSpanExporter``, so the
store's views derive requests and stages exactly as for any producer.

The output model: each stage's input is the previous stage's output, the first stage's the prompt. A stage's
output is a pure function of its input, unless the request says the stage's output differs (``differs``,
a tag: requests with the same tag produce the same changed output, as every request served by a new index
does); a difference then flows downstream, into every later stage's input and the request's output.

Hardware samples are written like the agent's metric writer writes them (cumulative counters in
``otel_metrics_sum``, resource ``host.name``), scraped at explicit times.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExportResult
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from stagetrace.exporters.clickhouse import SUM_COLUMNS, ClickHouseSpanExporter

from stagetrace import conventions as cv
from stagetrace.analysis.explain import Explainer
from stagetrace.digest import digest

MS = 1_000_000
SECOND = 1_000 * MS
MINUTE = 60 * SECOND

SERVICE = "rag"
MODEL = "acme-70b"
PROMPTS = ("why is the sky blue?", "summarise the incident report", "what is RoCE?", "translate 'hello' to French")

# Every setting a healthy host serves, and the stage whose span records it (identity matters: 1199 is not 1200).
SETTINGS = {
    "retrieval.index.version": ("retrieval", "v41"),
    "retrieval.top_k": ("retrieval", 8),
    "context.template.version": ("context_assembly", "t3"),
    "context.max_tokens": ("context_assembly", 4096),
    "allreduce.algorithm": ("allreduce", "ring"),
    "decode.batch_size": ("decode", 16),
    "model.weights.step": ("decode", 1200),
}
# How long each stage runs (its span's duration).
STAGE_MS = {"retrieval": 20, "cache": 2, "context_assembly": 5, "allreduce": 30, "decode": 180}


def _jitter(i: int, spread: int) -> int:
    """A deterministic per-request wobble in [0, spread): measurements differ a little on every request."""
    return (i * 7919 + 13) % spread


@dataclass(frozen=True)
class Rank:
    """One TP rank of a stage that runs as one span per rank."""

    rank: int
    host: str
    nics: tuple[str, ...] = ("mlx5_0",)
    gpu: str | None = None


class Fleet:
    def __init__(
        self,
        store,
        start_ns: int | None = None,
        service: str = SERVICE,
        resources: dict[str, dict] | None = None,
        model: str = MODEL,
        model_on: str | None = None,
        model_service: str | None = None,
    ):
        self.store = store
        # the model the root span names; the input digest covers MODEL whatever it is, as a producer's that leaves
        # the model out of it (a shadow deployment of another model then shares the first one's input digests)
        self.model = model
        # the span that names it: the root span (None), or only the span of this stage (an application's root above
        # an engine's or framework's span, such as OpenInference's LLM span under a chain)
        self.model_on = model_on
        # the service of that span: an engine's of its own below the application's root (default the fleet's)
        self.model_service = model_service or service
        self.resources = resources or {}  # host -> resource attributes besides service.name and host.name
        # two hours ago, on a minute: inside every default analysis window, and never in the future
        self.t0 = start_ns if start_ns is not None else (time.time_ns() // MINUTE) * MINUTE - 120 * MINUTE
        self.service = service
        self._providers: dict[tuple[str, str], tuple[TracerProvider, InMemorySpanExporter]] = {}  # (host, service)
        self._count = 0
        self.requests: dict[str, dict] = {}  # request ID -> what was recorded (for the tests' own bookkeeping)

    def at(self, minutes: float = 0.0, seconds: float = 0.0) -> int:
        """The simulated time ``minutes`` + ``seconds`` after the fleet's start, in ns."""
        return self.t0 + int(minutes * MINUTE) + int(seconds * SECOND)

    def _tracer(self, host: str, service: str | None = None):
        service = service or self.service
        if (host, service) not in self._providers:
            provider = TracerProvider(
                resource=Resource.create({"service.name": service, "host.name": host, **self.resources.get(host, {})})
            )
            memory = InMemorySpanExporter()
            provider.add_span_processor(SimpleSpanProcessor(memory))
            self._providers[(host, service)] = (provider, memory)
        return self._providers[(host, service)][0].get_tracer("fleet")

    def request(
        self,
        request_id: str,
        at_ns: int,
        host: str,
        *,
        prompt: int = 0,
        gpu: str | None = None,
        nics: tuple[str, ...] = ("mlx5_0",),
        settings: dict | None = None,
        differs: dict[str, str] | None = None,
        temperature: float | None = 0.0,
        seed: int | None = 7,
        sampling_on: str = "request",
        root: dict | None = None,
        extra: dict[str, dict] | None = None,
        measures: dict | None = None,
        tp: list[Rank] | None = None,
        rank_differs: dict[int, str] | None = None,
        skip: tuple[str, ...] = (),
    ) -> dict:
        """Record one five-stage request starting at ``at_ns`` on ``host``; returns what it recorded.

        ``settings`` overrides :data:`SETTINGS`; ``differs`` maps a stage to a tag that changes its output;
        ``temperature`` / ``seed`` (None: not recorded) go on the request span or, with ``sampling_on="decode"``,
        on the decode span; ``root`` and ``extra`` add attributes to the request span and to stage spans;
        ``measures`` overrides the jittered measurements; ``tp`` records ``allreduce`` as one span per rank, each on
        its rank's host, and ``rank_differs`` changes the allreduce output of some ranks only; the stages in ``skip``
        are not run (their input passes on unchanged).
        """
        i = self._count
        self._count += 1
        settings = {key: value for key, (_, value) in SETTINGS.items()} | (settings or {})
        differs, extra, rank_differs = differs or {}, extra or {}, rank_differs or {}
        gpu = gpu or f"GPU-{host}-0"
        text = PROMPTS[prompt]
        sampling = {"gen_ai.request.temperature": temperature, "gen_ai.request.seed": seed}
        sampling = {k: v for k, v in sampling.items() if v is not None}
        request_input = {"prompt": text, "model": MODEL, **sampling}
        diverged = "".join(differs.get(s, "") for s in cv.PIPELINE_STAGES) + "".join(rank_differs.values())
        measured = {
            "cache.hit": i % 5 != 0,
            "cache.entry.age_s": round(1.5 + _jitter(i, 300) / 10, 1),
            "context.tokens": 900 + 37 * prompt,
            "allreduce.time_ms": round(3.0 + _jitter(i, 40) / 10, 1),
            "decode.ttft_ms": 140 + _jitter(i, 30),
            "decode.tokens": 120 + 11 * prompt + (17 if diverged else 0),
        } | (measures or {})

        tracer = self._tracer(host)
        root_attrs = {
            cv.REQUEST_ID: request_id,
            cv.INPUT_DIGEST: digest(request_input),
            **({"gen_ai.request.model": self.model} if self.model_on is None else {}),
            **(sampling if sampling_on == "request" else {}),
            **(root or {}),
        }
        root_span = tracer.start_span(
            "inference.request", kind=SpanKind.SERVER, attributes=root_attrs, start_time=at_ns
        )
        parent = trace.set_span_in_context(root_span)
        t = at_ns + 1 * MS
        data = text
        stages = []
        for name in cv.PIPELINE_STAGES:
            if name in skip:
                continue
            attrs = {key: value for key, value in settings.items() if SETTINGS.get(key, (None,))[0] == name}
            attrs |= {key: value for key, value in measured.items() if key.split(".")[0] == name.split("_")[0]}
            if name == "retrieval":
                tag = differs.get("retrieval", "")
                attrs["retrieval.doc_ids"] = [f"doc-{prompt}-{k}{tag}" for k in range(3)]
            if name == "decode":
                attrs["gpu.uuid"] = gpu
                if sampling_on == "decode":
                    attrs |= sampling
            if name == "allreduce":
                attrs["parallel.tp_size"] = len(tp) if tp else 1
            if name == self.model_on:
                attrs["gen_ai.request.model"] = self.model
            attrs |= extra.get(name, {})
            out = f"{name}({data})" + (f"~{differs[name]}" if name in differs else "")
            end = t + STAGE_MS[name] * MS
            if name == "allreduce" and tp:
                outputs = []
                for r in tp:
                    rank_out = out + (f"~rank{r.rank}:{rank_differs[r.rank]}" if r.rank in rank_differs else "")
                    rank_attrs = {
                        **attrs,
                        cv.TP_RANK: r.rank,
                        "net.rdma.devices": list(r.nics),
                        **({"gpu.uuid": r.gpu} if r.gpu else {}),
                    }
                    self._stage(self._tracer(r.host), parent, name, data, rank_out, rank_attrs, t, end)
                    outputs.append(rank_out)
                    stages.append({"stage": name, "rank": str(r.rank), "host": r.host, "attributes": rank_attrs})
                data = "|".join(outputs)
            else:
                if name == "allreduce":
                    attrs["net.rdma.devices"] = list(nics)
                named = self._tracer(host, self.model_service) if name == self.model_on else tracer
                self._stage(named, parent, name, data, out, attrs, t, end)
                stages.append({"stage": name, "rank": "", "host": host, "attributes": attrs})
                data = out
            t = end + 1 * MS
        root_span.set_attribute(cv.OUTPUT_DIGEST, digest(data))
        root_span.end(end_time=t)
        recorded = {
            "request_id": request_id,
            "start_ns": at_ns,
            "end_ns": t,
            "host": host,
            "gpu": gpu,
            "prompt": prompt,
            "settings": settings,
            "differs": differs,
            "rank_differs": rank_differs,
            "output": digest(data),
            "stages": stages,
            "index": i,
        }
        self.requests[request_id] = recorded
        return recorded

    @staticmethod
    def _stage(tracer, parent, name, data, out, attrs, start, end) -> None:
        attrs = {**attrs, cv.STAGE: name, cv.STAGE_INPUT_DIGEST: digest(data), cv.STAGE_OUTPUT_DIGEST: digest(out)}
        span = tracer.start_span(
            f"stage.{name}", context=parent, kind=SpanKind.INTERNAL, attributes=attrs, start_time=start
        )
        span.end(end_time=end)

    def flush(self) -> int:
        """Write every span recorded so far into the store (through the span exporter); returns how many."""
        spans = []
        for _, memory in self._providers.values():
            spans.extend(memory.get_finished_spans())
            memory.clear()
        if not spans:
            return 0
        exporter = ClickHouseSpanExporter(store=self.store, spool_dir=False, create_schema=False)
        try:
            assert exporter.export(spans) is SpanExportResult.SUCCESS
            assert exporter.force_flush(60_000), "the store did not take the fleet's spans"
        finally:
            exporter.shutdown()
        return len(spans)

    # -- hardware
    def counter(
        self,
        host: str,
        name: str,
        labels: dict,
        start_ns: int,
        end_ns: int,
        *,
        every_ns: int = 15 * SECOND,
        value: float = 0.0,
        rises: tuple[tuple[int, float], ...] = (),
    ) -> list[tuple[int, float]]:
        """A cumulative counter on ``host``, scraped every ``every_ns`` from ``start_ns`` to ``end_ns``.

        Each ``(t_ns, delta)`` of ``rises`` adds ``delta`` to every sample taken at or after ``t_ns``.
        Returns the (time, value) points written.
        """
        points = []
        t = start_ns
        while t <= end_ns:
            points.append((t, value + sum(delta for at, delta in rises if at <= t)))
            t += every_ns
        rows = [
            (
                {"host.name": host},
                "stagetrace-agent",
                "stagetrace.collectors",
                "",
                name,
                "",
                "",
                labels,
                start_ns - MINUTE,
                t_ns,
                float(v),
                2,
                True,
            )
            for t_ns, v in points
        ]
        self.store.client.insert("otel_metrics_sum", rows, column_names=SUM_COLUMNS, database=self.store.database)
        return points


def timeline(start_ns: int, end_ns: int, every_ns: int, hosts: list[str]):
    """``(i, t_ns, host)`` for requests every ``every_ns`` from ``start_ns`` (exclusive of ``end_ns``), round-robin."""
    i, t = 0, start_ns
    while t < end_ns:
        yield i, t, hosts[i % len(hosts)]
        i += 1
        t += every_ns


def top_cause(causes: list[dict]) -> tuple | None:
    """The first cause that is not weak, as what two answers are compared by: (kind, stage, name, value, baseline's)."""
    top = next((c for c in causes if not c["weak"]), None)
    return (top["kind"], top["stage"], top["name"], top["value"], top["baseline_value"]) if top else None


def explained(store, requests: list[str]) -> dict:
    """explain's answer for each request: (diverged, first divergent stage, baseline's request ID, top cause)."""
    explainer, answers = Explainer(store), {}
    for rid in requests:
        report = explainer.explain(rid).to_json()
        baseline = (report["baseline"] or {}).get("request_id")
        answers[rid] = (report["diverged"], report["first_divergent_stage"], baseline, top_cause(report["causes"]))
    return answers


def entries(found: dict, keep) -> dict:
    """divergences' answer (``found``: its JSON) for each deviating request ``keep`` takes: (first divergent stage,
    baseline's request ID, top cause)."""
    return {
        d["request_id"]: (
            d["first_divergent_stage"],
            d["baseline_request_id"],
            top_cause([d["top_cause"]]) if d["top_cause"] else None,
        )
        for g in found["groups"]
        for d in g["deviating"]
        if keep(d)
    }
