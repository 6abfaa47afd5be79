"""What the framework apps share, none of it stagetrace code: a corpus, its queries, a bag-of-words embedding,
and the OpenTelemetry set-up a user of these frameworks writes, exporting with the official OTLP exporters.

Each app is one "node": a process with its own tracer provider (``host.name``), its own copy of the index
(``--edited`` changes one document, as an index update that reached only this node would), which asks every
query ``--repeat`` times and prints one JSON line per answer: the query, the answer and the trace it made.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExportResult

CORPUS = {
    "warranty": "The warranty covers parts and labour for two years from the date of purchase.",
    "returns": "Unused items can be returned within thirty days for a full refund.",
    "shipping": "Standard shipping takes three to five business days within the country.",
    "battery": "The battery lasts about ten hours of video playback on a full charge.",
    "support": "Support is reachable by chat every weekday from nine to five.",
    "payment": "We accept credit cards, bank transfers and gift vouchers as payment.",
}
# What an index update that reached only one node changed.
EDITED = {"warranty": "The warranty covers parts only, for one year from the date of purchase."}
QUERIES = [
    "How long does the warranty cover parts and labour?",
    "How many days do I have to return unused items?",
    "How long does standard shipping take?",
    "How many hours does the battery last?",
]


def corpus(edited: bool) -> dict[str, str]:
    return {**CORPUS, **(EDITED if edited else {})}


def embed(text: str, dims: int = 64) -> list[float]:
    """Hashed bag of words, normalised: similar wording, similar vectors; no model to download."""
    vector = [0.0] * dims
    for word in text.lower().replace("?", " ").replace(".", " ").replace(",", " ").split():
        vector[int.from_bytes(hashlib.blake2b(word.encode(), digest_size=4).digest(), "big") % dims] += 1.0
    norm = math.sqrt(sum(v * v for v in vector)) or 1.0
    return [v / norm for v in vector]


class _RootTraces(SpanProcessor):
    """Remembers the trace of each root span as it ends, so the app can say which trace answered which query."""

    def __init__(self):
        self.trace_ids: list[str] = []

    def on_end(self, span):
        if span.parent is None:
            self.trace_ids.append(f"{span.context.trace_id:032x}")


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", required=True)
    parser.add_argument("--protocol", choices=("grpc", "http"), required=True)
    parser.add_argument("--endpoint", required=True, help="host:port of the OTLP receiver")
    parser.add_argument("--edited", action="store_true")
    parser.add_argument("--repeat", type=int, default=1)
    return parser.parse_args()


def tracer_provider(args) -> tuple[TracerProvider, _RootTraces]:
    if args.protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter(endpoint=f"http://{args.endpoint}", insecure=True)
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter(endpoint=f"http://{args.endpoint}/v1/traces")
    provider = TracerProvider(resource=Resource.create({"service.name": "rag-app", "host.name": args.host}))
    roots = _RootTraces()
    provider.add_span_processor(roots)
    provider.add_span_processor(_Checked(exporter))
    return provider, roots


class _Checked(BatchSpanProcessor):
    """A batch processor whose exporter's failures make the app exit non-zero, so a test sees lost spans."""

    failed = False

    def __init__(self, exporter):
        original = exporter.export

        def export(spans):
            result = original(spans)
            if result is not SpanExportResult.SUCCESS:
                _Checked.failed = True
            return result

        exporter.export = export
        super().__init__(exporter)


def run(args, provider: TracerProvider, roots: _RootTraces, answer) -> None:
    """Ask every query ``--repeat`` times through ``answer(query) -> str``, flush, print one line per answer."""
    lines, before = [], len(roots.trace_ids)  # traces made before the queries (building the index) are not answers
    for _ in range(args.repeat):
        for query in QUERIES:
            text = answer(query)
            lines.append({"host": args.host, "query": query, "answer": text})
    provider.force_flush()
    provider.shutdown()
    for line, trace_id in zip(lines, roots.trace_ids[before:], strict=True):
        print(json.dumps({**line, "trace_id": trace_id}))
    if _Checked.failed:
        print("span export failed", file=sys.stderr)
        sys.exit(1)
