"""One node of the demo cluster: the five-stage pipeline, recorded with the stage-span API.

The node runs in its own process with its TP ranks as child processes. Its spans, metric samples
and per-request results go to the parent through a queue; only the parent opens the store (an
embedded store belongs to one process). Ground truth is exact: where a fault is active in a stage,
the node also computes what the reference pipeline would have produced from the same input, and the
first stage whose output differs is recorded with the fault's cause. A node whose TP group spans two
hosts records the all-reduce as one span per rank, the remote ranks' under the remote host's
resource, and samples the remote host's hardware too.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from contextlib import ExitStack
from dataclasses import dataclass

import numpy as np
from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

import stagetrace
from stagetrace import configuration
from stagetrace.conventions import STAGE, STAGE_INPUT_DIGEST, STAGE_OUTPUT_DIGEST, TP_RANK
from stagetrace.demo import world
from stagetrace.demo.faults import (
    CAUSES,
    EXPECTED,
    NEW_TEMPLATE,
    NONDETERMINISTIC,
    OLD_TEMPLATE,
    REFERENCE_CONTEXT_TOKENS,
    NodeConfig,
)
from stagetrace.demo.hardware import NodeHardware
from stagetrace.demo.tp import TPGroup
from stagetrace.digest import digest
from stagetrace.environment_variables import STAGETRACE_NVML_FIXTURE
from stagetrace.exporters.rows import Resources, span_row

SIM_SECONDS_PER_REQUEST = 0.25  # the simulated clock: requests arrive this far apart (cache ages, TTLs, timestamps)
STEP_NS = int(SIM_SECONDS_PER_REQUEST * 1e9)
CACHE_CAPACITY, CACHE_TTL_S = 512, 120.0
XID_BAD_WEIGHT = (17, 42)  # the element of A a double-bit ECC error corrupts
REMOTE_RANKS = range(world.TP_SIZE // 2, world.TP_SIZE)  # the ranks on the remote host of a two-host TP group
SERVICE_NAME = "rag-demo"

# What the stages take on the simulated clock (ns): a model of the work, never a measurement, so that a loaded
# machine changes no timestamp. Rough figures of a small RAG service; a request takes well under STEP_NS.
RETRIEVAL_NS, RETRIEVAL_PER_HIT_NS = 1_500_000, 100_000
CACHE_HIT_NS, CACHE_MISS_NS = 20_000, 400_000  # a miss fetches the text from the document store
CONTEXT_NS, CONTEXT_PER_TOKEN_NS = 100_000, 200
ALLREDUCE_STEP_NS = 8_000  # one send/receive step of the collective; a ring takes 2(p-1), a tree 2 log2 p
RETRANSMIT_NS, RESEND_NS = 2_000_000, 1_000_000  # the NIC's retransmission timer; a go-back-N resend
DECODE_TOKEN_NS, DECODE_TOKEN_PER_BATCH_NS = 800_000, 20_000  # co-batched requests slow each token
SCRAPE_NS = 200_000  # a scrape of the host's hardware; its samples lie in its middle, never at a span's edge


class SimClock:
    """A node's clock, simulated: request ``i`` arrives at ``start_ns + i * STEP_NS``, its stages take the modelled
    times above, and a scrape takes ``SCRAPE_NS``.

    Every span and metric sample of the run is then a function of the seed and the requests' positions alone. On
    the wall clock a loaded machine moved a request near a rollout wave's end across it (its host's first request
    on the new value and the wave's end are times the analysis reads from the spans), so the same seed gave
    another truth and another count of deviating outputs; and node processes drifted apart, so that a position
    meant different times on different hosts. Time on one node only moves forward: a request that ran past the
    next one's arrival delays it (the modelled times keep a request far shorter than ``STEP_NS``).
    """

    def __init__(self, start_ns: int):
        self.start_ns = self.now_ns = start_ns

    def __call__(self) -> int:
        return self.now_ns

    def arrive(self, index: int) -> None:
        self.now_ns = max(self.now_ns, self.start_ns + index * STEP_NS)

    def advance(self, ns: int) -> int:
        self.now_ns += int(ns)
        return self.now_ns

    def scrape(self) -> int:
        """The time of a scrape that starts now: half a scrape on, and the clock a whole scrape on."""
        at = self.advance(SCRAPE_NS // 2)
        self.advance(SCRAPE_NS - SCRAPE_NS // 2)
        return at


@dataclass
class Result:
    """What a node reports for one request, ground truth included."""

    request_id: str
    input_digest: str
    output_digest: str
    stage: str | None  # the first stage whose output differs from the reference pipeline's
    cause: str | None
    node: int
    truncated: bool
    epoch: tuple[str, str]  # the index and template most hosts ran: comparable requests share them
    expected: bool
    nondeterministic: bool
    # stage → (the host's value of the rolled-out setting, the stage's start in ns, whether the host was behind the fleet)
    rollouts: dict[str, tuple[str, int, bool]]


@dataclass(frozen=True)
class RequestSpec:
    position: float  # global index / requests: when in the run this request arrives
    index: int
    request_id: str
    input: dict
    batch_size: int
    nic_timeout: bool
    seq_error: bool = False  # the remote host's NIC takes sequence errors during this request's all-reduce


class DocCache:
    """A TTL + LRU cache of document texts in front of the document store.

    Entries remember the index version they were fetched under. Keyed by (index version, document)
    they are never stale; keyed by document alone, as the faulty node does, a rebuild that edits a
    document leaves the old text to be served until the entry expires or is evicted.
    """

    def __init__(self, capacity: int, ttl_s: float, key_has_version: bool):
        self.capacity, self.ttl_s, self.key_has_version = capacity, ttl_s, key_has_version
        self._entries: OrderedDict = OrderedDict()  # key → (text, index version, stored at)

    def fetch(self, doc_id: int, index: world.VectorIndex, now: float) -> tuple[str, str, float | None]:
        """(text, index version of the entry, its age or None on a miss)."""
        key = (index.version, doc_id) if self.key_has_version else doc_id
        entry = self._entries.get(key)
        if entry is not None and now - entry[2] <= self.ttl_s:
            self._entries.move_to_end(key)
            return entry[0], entry[1], now - entry[2]
        text = index.docs[doc_id].text
        self._entries[key] = (text, index.version, now)
        self._entries.move_to_end(key)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)
        return text, index.version, None


def assemble_context(prompt: str, texts: list[str], max_tokens: int, template: str = "t3") -> tuple[str, int, bool]:
    """Template ``t3``: documents best first, then the question; ``t4``: documents best last, next to the
    question, in ``<doc i>`` tags. Tokens beyond the budget are cut from the front."""
    if template == NEW_TEMPLATE:
        parts = [f"<doc {i}> {text}" for i, text in reversed(list(enumerate(texts)))] + [f"question: {prompt} answer:"]
    else:
        parts = [f"[doc {i}] {text}" for i, text in enumerate(texts)] + [f"question: {prompt} answer:"]
    tokens = " ".join(parts).split()
    truncated = len(tokens) > max_tokens
    if truncated:
        tokens = tokens[-max_tokens:]  # keep the question, drop the oldest context
    return " ".join(tokens), len(tokens), truncated


class _Divergence:
    """The first stage whose output differs from the reference pipeline's, and the fault behind it."""

    def __init__(self):
        self.stage: str | None = None
        self.cause: str | None = None
        self.expected = False  # the difference is the fleet's move (a rollout wave), not a fault
        self.nondeterministic = False  # the request's output differs by design

    def check(self, stage: str, fault: str | None, actual, reference) -> None:
        if self.stage is not None or fault is None:
            return  # upstream already differs, or nothing differs from the reference in this stage
        if digest(actual) != digest(reference()):
            self.record(stage, fault)

    def record(self, stage: str, fault: str) -> None:
        self.stage, self.cause = stage, CAUSES[stage][fault]
        self.expected, self.nondeterministic = fault in EXPECTED, fault in NONDETERMINISTIC


class _QueueSpanExporter(SpanExporter):
    """Hands finished spans, as ``otel_traces`` rows, to the parent process that owns the store."""

    def __init__(self, queue):
        self._queue = queue
        self._resources = Resources()

    def export(self, spans) -> SpanExportResult:
        self._queue.put(("spans", [span_row(s, self._resources) for s in spans]))
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass


class Node:
    def __init__(self, config: NodeConfig, seed: int, queue, hardware_dir: str, start_ns: int):
        self.config = config
        self.queue = queue
        self.clock = SimClock(start_ns)
        self.model = world.Model(seed)
        self.indexes = world.corpora(seed)
        self.cache = DocCache(CACHE_CAPACITY, CACHE_TTL_S, config.cache_key_has_version)
        self.hardware = NodeHardware(
            config.host, hardware_dir, seed, shared_gpu=config.shared_gpu, gpu_model=config.gpu_model, start_ns=start_ns
        )
        # the remote host of a two-host TP group: its own NIC and GPUs, sampled by this node
        self.remote = (
            NodeHardware(config.tp_remote_host, hardware_dir, seed, start_ns=start_ns)
            if config.tp_remote_host
            else None
        )
        self._remote_tracer = None
        self._corrupt_left = 0
        self._xid_done = False
        self._corrupted_a = self.model.a.copy()
        self._corrupted_a[XID_BAD_WEIGHT] *= np.float32(-8.0)
        self._weights = {
            step: self.model.a_at_step(step) for step in {config.weights_step(0.0), config.weights_step(1.0)}
        }

    def _provider(self, hardware: NodeHardware, backend: str) -> TracerProvider:
        """A serving process's provider: its resource holds what the configuration detector records for an engine
        started with this attention backend on this host's GPUs."""
        detected = configuration.configuration(
            argv=[
                "vllm",
                "serve",
                world.MODEL_NAME,
                "--tensor-parallel-size",
                str(world.TP_SIZE),
                "--attention-backend",
                backend,
            ],
            environ={STAGETRACE_NVML_FIXTURE: str(hardware.nvml)},
        )
        resource = Resource.create({**detected, "service.name": SERVICE_NAME, "host.name": hardware.host})
        provider = TracerProvider(resource=resource)
        provider.add_span_processor(BatchSpanProcessor(_QueueSpanExporter(self.queue), schedule_delay_millis=200))
        return provider

    def run(self, specs: list[RequestSpec]) -> None:
        tp = TPGroup(self.model)  # fork the ranks before any thread exists in this process
        backend = self.config.attention_backend(specs[0].position if specs else 0.0)
        provider = self._provider(self.hardware, backend)
        stagetrace.configure(tracer_provider=provider, clock=self.clock)
        remote_provider = self._provider(self.remote, backend) if self.remote else None
        if remote_provider:
            self._remote_tracer = remote_provider.get_tracer("stagetrace")
        try:
            self._sample_hardware()
            after_error = False
            for n, spec in enumerate(specs):
                self.clock.arrive(spec.index)
                self._events(spec)
                if self.config.attention_backend(spec.position) != backend:  # the engine restarted with another
                    backend = self.config.attention_backend(spec.position)
                    provider.shutdown()  # flushes the old process's spans
                    provider = self._provider(self.hardware, backend)
                    stagetrace.configure(tracer_provider=provider, clock=self.clock)
                # The remote NIC is scraped right before and right after a request whose all-reduce takes
                # sequence errors, and again before the next request: a stage's hardware window (from one
                # scrape before the last at its start to the first after its end) then holds the errors of
                # that request and of no other.
                if spec.seq_error or after_error:
                    self._sample_remote(nic_only=True)
                result = self.serve(spec, tp)
                if spec.seq_error:
                    self._sample_remote(nic_only=True)
                after_error = spec.seq_error
                self.queue.put(("result", result))
                if n % 10 == 9:
                    self._sample_hardware()
            self._sample_hardware()
        finally:
            provider.shutdown()
            if remote_provider:
                remote_provider.shutdown()
            tp.close()
            for hardware in (self.hardware, self.remote):
                if hardware:
                    hardware.close()

    def _events(self, spec: RequestSpec) -> None:
        if self.config.xid_at is not None and not self._xid_done and spec.position >= self.config.xid_at:
            self._sample_hardware()
            self.hardware.xid(gpu=0, xid=48)
            self._sample_hardware()
            self._xid_done = True
            self._corrupt_left = self.config.xid_corrupts_requests

    def _sample_hardware(self) -> None:
        at = self.clock.scrape()  # the node's host and the remote host are scraped as one
        self.queue.put(("metrics", self.hardware.sample_rows(at)))
        if self.remote:
            self.queue.put(("metrics", self.remote.sample_rows(at)))

    def _sample_remote(self, nic_only: bool = False) -> None:
        if self.remote:
            self.queue.put(("metrics", self.remote.sample_rows(self.clock.scrape(), nic_only)))

    def serve(self, spec: RequestSpec, tp: TPGroup) -> Result:
        cfg, inp, pos = self.config, spec.input, spec.position
        truth = _Divergence()
        now = spec.index * SIM_SECONDS_PER_REQUEST
        attributes = {
            "gen_ai.request.model": inp["model"],
            "gen_ai.request.seed": inp.get("seed"),
            "gen_ai.request.temperature": inp["temperature"],
            "gen_ai.request.max_tokens": inp["max_new_tokens"],
        }
        with stagetrace.request(spec.request_id, input=inp, attributes=attributes) as req:
            index = self.indexes[cfg.index_version(pos)]
            query = [inp["prompt"], inp["top_k"]]
            with stagetrace.stage(
                "retrieval",
                input=query,
                attributes={"retrieval.index.version": index.version, "retrieval.top_k": inp["top_k"]},
            ) as st:
                hits = index.search(inp["prompt"], inp["top_k"])
                self.clock.advance(RETRIEVAL_NS + RETRIEVAL_PER_HIT_NS * len(hits))
                st.set_attribute("retrieval.doc_ids", [h[0] for h in hits])
                st.set_output(hits)
                retrieval_started = st.span.start_time
            reference_index = self.indexes[cfg.fleet_index_version(pos)]
            change = cfg.index_change(pos)
            truth.check(
                "retrieval",
                None if change is None else "index_rollout" if change == "expected" else "stale_index",
                hits,
                lambda: reference_index.search(inp["prompt"], inp["top_k"]),
            )

            with stagetrace.stage("cache", input=hits) as st:
                fetched = [self.cache.fetch(doc_id, index, now) for doc_id, _ in hits]
                texts = [f[0] for f in fetched]
                ages = [f[2] for f in fetched if f[2] is not None]
                self.clock.advance(CACHE_HIT_NS * len(ages) + CACHE_MISS_NS * (len(hits) - len(ages)))
                st.set_attributes(
                    {
                        "cache.hit": len(ages) == len(hits),
                        "cache.hits": len(ages),
                        "cache.misses": len(hits) - len(ages),
                        "cache.entry.age_s": round(max(ages), 3) if ages else 0.0,
                        "cache.entry.index_version": min(f[1] for f in fetched),
                    }
                )
                st.set_output(texts)
            stale = any(f[1] != index.version for f in fetched)
            truth.check(
                "cache",
                "unversioned_cache_key" if stale else None,
                texts,
                lambda: [index.docs[doc_id].text for doc_id, _ in hits],
            )

            max_tokens, template, fleet_template = (
                cfg.max_context_tokens(pos),
                cfg.template(pos),
                cfg.fleet_template(pos),
            )
            with stagetrace.stage(
                "context_assembly",
                input=[inp["prompt"], texts],
                attributes={"context.template.version": template, "context.max_tokens": max_tokens},
            ) as st:
                context, context_tokens, truncated = assemble_context(inp["prompt"], texts, max_tokens, template)
                self.clock.advance(CONTEXT_NS + CONTEXT_PER_TOKEN_NS * context_tokens)
                st.set_attributes({"context.tokens": context_tokens, "context.truncated": truncated})
                st.set_output(context)
                context_started = st.span.start_time
            fault = (
                "template_rollout"
                if template != fleet_template
                else "small_context"
                if max_tokens != REFERENCE_CONTEXT_TOKENS
                else None
            )
            truth.check(
                "context_assembly",
                fault,
                context,
                lambda: assemble_context(inp["prompt"], texts, REFERENCE_CONTEXT_TOKENS, fleet_template)[0],
            )

            x = self.model.context_vector(context)
            algorithm = cfg.algorithm(pos)
            attributes = {
                "parallel.tp_size": world.TP_SIZE,
                "allreduce.algorithm": algorithm,
                "allreduce.count": 1,
                "allreduce.bytes": world.HIDDEN * 4,
                "net.rdma.devices": [self.hardware.nic],
            }
            with ExitStack() as spans:
                if self.remote is None:  # one span for the group, as a single-host engine records it
                    rank_spans = [spans.enter_context(stagetrace.stage("allreduce", input=x, attributes=attributes))]
                else:
                    rank_spans = self._rank_spans(spans, req, x, attributes)
                partials = tp.partials(x)
                steps = 2 * (world.TP_SIZE - 1) if algorithm == "ring" else 2 * math.ceil(math.log2(world.TP_SIZE))
                elapsed_ns = ALLREDUCE_STEP_NS * steps
                if spec.nic_timeout:
                    late = 1 + spec.index % (world.TP_SIZE - 1)
                    self.hardware.nic_timeout()
                    elapsed_ns += RETRANSMIT_NS
                    h0 = world.arrival_order(partials, late)
                elif spec.seq_error:  # a remote rank's chunk arrived out of sequence and was resent (go-back-N)
                    late = REMOTE_RANKS[spec.index % len(REMOTE_RANKS)]
                    self.remote.seq_error()
                    elapsed_ns += RESEND_NS
                    h0 = world.arrival_order(partials, late)
                else:
                    h0 = world.ring_order(partials) if algorithm == "ring" else world.tree_order(partials)
                tp.finish(h0)
                self.clock.advance(elapsed_ns)
                self.hardware.allreduce(world.HIDDEN * 4, world.TP_SIZE)
                if self.remote is not None:  # the ring crosses the remote host's NIC too
                    self.remote.allreduce(world.HIDDEN * 4, world.TP_SIZE)
                elapsed_ms = elapsed_ns / 1e6
                for st in rank_spans:
                    st.set_attributes(
                        {"allreduce.time_ms": round(elapsed_ms, 3), "allreduce.max_ms": round(elapsed_ms, 3)}
                    )
                    st.set_output(h0)
            fault = (
                "nic_timeout"
                if spec.nic_timeout
                else "remote_seq_errors"
                if spec.seq_error
                else "tree_algorithm"
                if algorithm != "ring"
                else None
            )
            truth.check("allreduce", fault, h0, lambda: world.ring_order(partials))

            batch = spec.batch_size
            chunks = world.split_k_chunks(batch)
            corrupted = self._corrupt_left > 0
            if corrupted:
                self._corrupt_left -= 1
            step = cfg.weights_step(pos)
            backend = cfg.attention_backend(pos)
            unseeded = world.unseeded(inp)
            # the unseeded tenant's sampler draws from OS entropy: its outputs differ from request to request
            sampler = np.random.default_rng() if unseeded else None
            with stagetrace.stage(
                "decode",
                input=[h0, inp["max_new_tokens"]],
                attributes={
                    "gpu.uuid": self.hardware.gpu_uuids[0],
                    "decode.batch_size": batch,
                    "model.weights.step": step,
                    "decode.deterministic": False,
                },
            ) as st:
                tokens = self.model.decode(
                    h0,
                    chunks,
                    self._corrupted_a if corrupted else self._weights[step],
                    inp["temperature"],
                    sampler,
                    backend,
                )
                per_token_ns = DECODE_TOKEN_NS + DECODE_TOKEN_PER_BATCH_NS * batch
                self.clock.advance(per_token_ns * len(tokens))
                st.set_attributes({"decode.tokens": len(tokens), "decode.ttft_ms": round(per_token_ns / 1e6, 3)})
                st.set_output(tokens)
            self.hardware.decode(gpu=0, tokens=len(tokens), batch=batch)
            if unseeded:  # never a deviation, whatever else happened upstream
                truth.record("decode", "unseeded_sampling")
            fault = (
                "gpu_xid"
                if corrupted
                else "weights_step"
                if step != world.FLEET_WEIGHTS_STEP
                else "attention_backend"
                if backend != world.REFERENCE_ATTENTION_BACKEND
                else "batch_variance"
                if chunks != 1
                else None
            )
            truth.check("decode", fault, tokens, lambda: self.model.decode(h0, 1))

            text = self.model.detokenize(tokens)
            req.set_attributes({"gen_ai.usage.input_tokens": context_tokens, "gen_ai.usage.output_tokens": len(tokens)})
            output_digest = req.set_output(text)
        rollouts = {
            "retrieval": (
                index.version,
                retrieval_started,
                index.version == world.OLD_INDEX != reference_index.version,
            ),
            "context_assembly": (template, context_started, template == OLD_TEMPLATE != fleet_template),
        }
        return Result(
            spec.request_id,
            digest(inp),
            output_digest,
            truth.stage,
            truth.cause,
            cfg.index,
            truncated,
            (reference_index.version, fleet_template),
            truth.expected,
            truth.nondeterministic,
            rollouts,
        )

    def _rank_spans(self, spans: ExitStack, req, x, attributes: dict) -> list:
        """One all-reduce span per TP rank: ranks 0-1 on this host, 2-3 under the remote host's resource."""
        out = []
        for rank in range(world.TP_SIZE):
            if rank not in REMOTE_RANKS:
                rank_attributes = {**attributes, TP_RANK: str(rank)}
                out.append(
                    spans.enter_context(stagetrace.stage("allreduce", input=x, attributes=rank_attributes, parent=req))
                )
                continue
            rank_attributes = {
                **attributes,
                TP_RANK: str(rank),
                "net.rdma.devices": [self.remote.nic],
                STAGE: "allreduce",
                STAGE_INPUT_DIGEST: digest(x),
            }
            span = self._remote_tracer.start_span(
                "stage.allreduce",
                context=trace.set_span_in_context(req.span),
                attributes=rank_attributes,
                start_time=self.clock(),
            )
            spans.callback(lambda span=span: span.end(end_time=self.clock()))
            out.append(_RemoteRankSpan(span))
        return out


class _RemoteRankSpan:
    """A remote rank's all-reduce span (another host's provider), with the stage span's setters."""

    def __init__(self, span):
        self.span = span

    def set_attributes(self, attributes: dict) -> None:
        self.span.set_attributes(attributes)

    def set_output(self, value) -> str:
        output_digest = digest(value)
        self.span.set_attribute(STAGE_OUTPUT_DIGEST, output_digest)
        return output_digest


def node_main(config: NodeConfig, seed: int, specs: list[RequestSpec], queue, hardware_dir: str, start_ns: int) -> None:
    """Entry point of a node process; ``start_ns``: when request 0 arrives on the run's simulated clock."""
    try:
        Node(config, seed, queue, hardware_dir, start_ns).run(specs)
        queue.put(("done", config.index, None))
    except Exception as exc:  # the parent reports it in one line
        queue.put(("done", config.index, f"{type(exc).__name__}: {exc}"))
