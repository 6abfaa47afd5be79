"""One node of the demo cluster: the five-stage pipeline, recorded with the stage-span API.

The node runs in its own process with its TP ranks as child processes. Its spans, metric samples
and per-request results go to the parent through a queue; only the parent opens the store (an
embedded store belongs to one process). Ground truth is exact: where a fault is active in a stage,
the node also computes what the reference pipeline would have produced from the same input, and the
first stage whose output differs is recorded with the fault's cause.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

import stagetrace
from stagetrace.demo import world
from stagetrace.demo.faults import CAUSES, REFERENCE_CONTEXT_TOKENS, NodeConfig
from stagetrace.demo.hardware import NodeHardware
from stagetrace.demo.tp import TPGroup
from stagetrace.digest import digest
from stagetrace.exporters.clickhouse import _Resources, span_row

SIM_SECONDS_PER_REQUEST = 0.25  # the cluster's simulated clock, which drives cache ages and TTLs
CACHE_CAPACITY, CACHE_TTL_S = 512, 120.0
TEMPLATE_VERSION = "t3"
XID_BAD_WEIGHT = (17, 42)  # the element of A a double-bit ECC error corrupts


@dataclass(frozen=True)
class RequestSpec:
    position: float  # global index / requests: when in the run this request arrives
    index: int
    request_id: str
    input: dict
    batch_size: int
    nic_timeout: bool


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


def assemble_context(prompt: str, texts: list[str], max_tokens: int) -> tuple[str, int, bool]:
    """Template ``t3``: documents, then the question; tokens beyond the budget are cut from the front."""
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

    def check(self, stage: str, fault: str | None, actual, reference) -> None:
        if self.stage is not None or fault is None:
            return  # upstream already differs, or nothing differs from the reference in this stage
        if digest(actual) != digest(reference()):
            self.stage, self.cause = stage, CAUSES[stage][fault]


class _QueueSpanExporter(SpanExporter):
    """Hands finished spans, as ``otel_traces`` rows, to the parent process that owns the store."""

    def __init__(self, queue):
        self._queue = queue
        self._resources = _Resources()

    def export(self, spans) -> SpanExportResult:
        self._queue.put(("spans", [span_row(s, self._resources) for s in spans]))
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass


class Node:
    def __init__(self, config: NodeConfig, seed: int, queue, hardware_dir: str):
        self.config = config
        self.queue = queue
        self.model = world.Model(seed)
        self.indexes = world.corpora(seed)
        self.cache = DocCache(CACHE_CAPACITY, CACHE_TTL_S, config.cache_key_has_version)
        self.hardware = NodeHardware(config.host, hardware_dir, seed)
        self._corrupt_left = 0
        self._xid_done = False
        self._corrupted_a = self.model.a.copy()
        self._corrupted_a[XID_BAD_WEIGHT] *= np.float32(-8.0)

    def run(self, specs: list[RequestSpec]) -> None:
        tp = TPGroup(self.model)  # fork the ranks before any thread exists in this process
        provider = TracerProvider(resource=Resource.create({"service.name": "rag-demo", "host.name": self.config.host}))
        provider.add_span_processor(BatchSpanProcessor(_QueueSpanExporter(self.queue), schedule_delay_millis=200))
        stagetrace.configure(tracer_provider=provider)
        try:
            self._sample_hardware()
            for n, spec in enumerate(specs):
                self._events(spec)
                result = self.serve(spec, tp)
                self.queue.put(("result", result))
                if n % 10 == 9:
                    self._sample_hardware()
            self._sample_hardware()
        finally:
            provider.shutdown()
            tp.close()

    def _events(self, spec: RequestSpec) -> None:
        if self.config.xid_at is not None and not self._xid_done and spec.position >= self.config.xid_at:
            self._sample_hardware()
            self.hardware.xid(gpu=0, xid=48)
            self._sample_hardware()
            self._xid_done = True
            self._corrupt_left = self.config.xid_corrupts_requests

    def _sample_hardware(self) -> None:
        self.queue.put(("metrics", self.hardware.sample_rows()))

    def serve(self, spec: RequestSpec, tp: TPGroup) -> tuple:
        cfg, inp, pos = self.config, spec.input, spec.position
        truth = _Divergence()
        now = spec.index * SIM_SECONDS_PER_REQUEST
        attributes = {"gen_ai.request.model": inp["model"], "gen_ai.request.seed": inp["seed"],
                      "gen_ai.request.temperature": inp["temperature"], "gen_ai.request.max_tokens": inp["max_new_tokens"]}  # fmt: skip
        with stagetrace.request(spec.request_id, input=inp, attributes=attributes) as req:
            index = self.indexes[cfg.index_version(pos)]
            query = [inp["prompt"], inp["top_k"]]
            with stagetrace.stage("retrieval", input=query, attributes={"retrieval.index.version": index.version, "retrieval.top_k": inp["top_k"]}) as st:  # fmt: skip
                hits = index.search(inp["prompt"], inp["top_k"])
                st.set_attribute("retrieval.doc_ids", [h[0] for h in hits])
                st.set_output(hits)
            reference_index = self.indexes[world.NEW_INDEX]
            truth.check("retrieval", "stale_index" if index is not reference_index else None, hits,
                        lambda: reference_index.search(inp["prompt"], inp["top_k"]))  # fmt: skip

            with stagetrace.stage("cache", input=hits) as st:
                fetched = [self.cache.fetch(doc_id, index, now) for doc_id, _ in hits]
                texts = [f[0] for f in fetched]
                ages = [f[2] for f in fetched if f[2] is not None]
                st.set_attributes({"cache.hit": len(ages) == len(hits), "cache.hits": len(ages),
                                   "cache.misses": len(hits) - len(ages),
                                   "cache.entry.age_s": round(max(ages), 3) if ages else 0.0,
                                   "cache.entry.index_version": min(f[1] for f in fetched)})  # fmt: skip
                st.set_output(texts)
            stale = any(f[1] != index.version for f in fetched)
            truth.check("cache", "unversioned_cache_key" if stale else None, texts,
                        lambda: [index.docs[doc_id].text for doc_id, _ in hits])  # fmt: skip

            max_tokens = cfg.max_context_tokens(pos)
            with stagetrace.stage("context_assembly", input=[inp["prompt"], texts],
                                  attributes={"context.template.version": TEMPLATE_VERSION, "context.max_tokens": max_tokens}) as st:  # fmt: skip
                context, context_tokens, truncated = assemble_context(inp["prompt"], texts, max_tokens)
                st.set_attributes({"context.tokens": context_tokens, "context.truncated": truncated})
                st.set_output(context)
            truth.check("context_assembly", "small_context" if max_tokens != REFERENCE_CONTEXT_TOKENS else None, context,
                        lambda: assemble_context(inp["prompt"], texts, REFERENCE_CONTEXT_TOKENS)[0])  # fmt: skip

            x = self.model.context_vector(context)
            algorithm = cfg.algorithm(pos)
            with stagetrace.stage("allreduce", input=x, attributes={"parallel.tp_size": world.TP_SIZE, "allreduce.algorithm": algorithm,
                                  "allreduce.count": 1, "allreduce.bytes": world.HIDDEN * 4,
                                  "net.rdma.devices": [self.hardware.nic]}) as st:  # fmt: skip
                started = time.perf_counter()
                partials = tp.partials(x)
                if spec.nic_timeout:
                    late = 1 + spec.index % (world.TP_SIZE - 1)
                    self.hardware.nic_timeout()
                    time.sleep(0.002)  # the retransmission timer
                    h0 = world.arrival_order(partials, late)
                else:
                    h0 = world.ring_order(partials) if algorithm == "ring" else world.tree_order(partials)
                tp.finish(h0)
                self.hardware.allreduce(world.HIDDEN * 4, world.TP_SIZE)
                elapsed_ms = (time.perf_counter() - started) * 1000
                st.set_attributes({"allreduce.time_ms": round(elapsed_ms, 3), "allreduce.max_ms": round(elapsed_ms, 3)})
                st.set_output(h0)
            fault = "nic_timeout" if spec.nic_timeout else "tree_algorithm" if algorithm != "ring" else None
            truth.check("allreduce", fault, h0, lambda: world.ring_order(partials))

            batch = spec.batch_size
            chunks = world.split_k_chunks(batch)
            corrupted = self._corrupt_left > 0
            if corrupted:
                self._corrupt_left -= 1
            started = time.perf_counter()
            with stagetrace.stage("decode", input=[h0, inp["max_new_tokens"]],
                                  attributes={"gpu.uuid": self.hardware.gpu_uuids[0], "decode.batch_size": batch,
                                              "model.weights.digest": self.model.weights_digest, "decode.deterministic": False}) as st:  # fmt: skip
                tokens = self.model.decode(h0, chunks, self._corrupted_a if corrupted else None)
                st.set_attributes({"decode.tokens": len(tokens), "decode.ttft_ms": round((time.perf_counter() - started) * 1000 / len(tokens), 3)})
                st.set_output(tokens)
            self.hardware.decode(gpu=0, tokens=len(tokens), batch=batch)
            fault = "gpu_xid" if corrupted else "batch_variance" if chunks != 1 else None
            truth.check("decode", fault, tokens, lambda: self.model.decode(h0, 1))

            text = self.model.detokenize(tokens)
            req.set_attributes({"gen_ai.usage.input_tokens": context_tokens, "gen_ai.usage.output_tokens": len(tokens)})
            output_digest = req.set_output(text)
        return (spec.request_id, digest(inp), output_digest, truth.stage, truth.cause, cfg.index, truncated)


def node_main(config: NodeConfig, seed: int, specs: list[RequestSpec], queue, hardware_dir: str) -> None:
    """Entry point of a node process."""
    try:
        Node(config, seed, queue, hardware_dir).run(specs)
        queue.put(("done", config.index, None))
    except Exception as exc:  # the parent reports it in one line
        queue.put(("done", config.index, f"{type(exc).__name__}: {exc}"))
