"""The stage-span API: one root span per request, one child span per pipeline stage, digests computed for you.

    import stagetrace

    stagetrace.configure(service_name="rag-api")              # embedded store by default
    with stagetrace.request("req-42", input={"prompt": p, "model": m, "seed": 7}) as req:
        with stagetrace.stage("retrieval", input=p, attributes={"retrieval.top_k": 8}) as st:
            docs = index.search(p)
            st.set_output([d.id for d in docs])
        ...
        req.set_output(text)

Spans follow the conventions in DESIGN.md, so any OpenTelemetry producer that uses the same names is
read the same way. Context crosses threads and processes as a W3C ``traceparent`` carrier:
``carrier = req.carrier()`` here, ``stagetrace.stage("allreduce", parent=carrier)`` there.
Prompts and outputs are stored only as digests unless ``record_content=True``
(or ``STAGETRACE_RECORD_CONTENT=1``).
"""

from __future__ import annotations

import json
import os
import socket
import threading
from collections.abc import Mapping

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.propagate import extract, inject
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import SpanKind, Status, StatusCode

from stagetrace import config
from stagetrace.conventions import (  # re-exported: the span API writes the conventions' names
    INPUT_CONTENT,
    INPUT_DIGEST,
    OUTPUT_CONTENT,
    OUTPUT_DIGEST,
    PIPELINE_STAGES,
    REQUEST_ID,
    STAGE,
    STAGE_INPUT_CONTENT,
    STAGE_INPUT_DIGEST,
    STAGE_OUTPUT_CONTENT,
    STAGE_OUTPUT_DIGEST,
)
from stagetrace.digest import digest

_SCOPE = "stagetrace"


class _Config:
    def __init__(self, provider, record_content: bool, exporter=None, owns_provider: bool = False):
        self.provider = provider
        self.tracer = provider.get_tracer(_SCOPE)
        self.record_content = record_content
        self.exporter = exporter
        self.owns_provider = owns_provider


_lock = threading.Lock()
_config: _Config | None = None


def configure(
    service_name: str | None = None,
    *,
    store=None,
    tracer_provider: TracerProvider | None = None,
    record_content: bool | None = None,
    host_name: str | None = None,
    resource_attributes: Mapping[str, str] | None = None,
) -> None:
    """Set up the API once per process.

    With ``tracer_provider``, spans go wherever that provider sends them (its processors and
    exporters are yours). Otherwise stagetrace builds a provider with ``service.name`` and
    ``host.name`` and a ``BatchSpanProcessor`` into a ``ClickHouseSpanExporter`` on ``store``
    (a DSN, default ``$STAGETRACE_STORE`` or the embedded store).
    """
    global _config
    record = config.record_content() if record_content is None else record_content
    with _lock:
        if _config is not None:
            _shutdown_locked()
        if tracer_provider is not None:
            _config = _Config(tracer_provider, record)
            return
        from stagetrace.exporters.clickhouse import ClickHouseSpanExporter

        attrs = {"service.name": service_name or config.service_name(), "host.name": host_name or socket.gethostname()}
        attrs.update(resource_attributes or {})
        provider = TracerProvider(resource=Resource.create(attrs))
        exporter = ClickHouseSpanExporter(store=store)
        provider.add_span_processor(BatchSpanProcessor(exporter, **batching()))
        _config = _Config(provider, record, exporter, owns_provider=True)


# The exporter stores each batch before it answers, and one insert costs about the same up to a few thousand
# rows: batches larger than the SDK's 512 (OTEL_BSP_* variables still decide when set).
_BATCHING = {"OTEL_BSP_MAX_EXPORT_BATCH_SIZE": ("max_export_batch_size", 4096),
             "OTEL_BSP_MAX_QUEUE_SIZE": ("max_queue_size", 16384),
             "OTEL_BSP_SCHEDULE_DELAY": ("schedule_delay_millis", 1000)}  # fmt: skip


def batching() -> dict:
    """The ``BatchSpanProcessor`` arguments ``configure`` uses, except those an ``OTEL_BSP_*`` variable sets."""
    return {argument: default for variable, (argument, default) in _BATCHING.items() if variable not in os.environ}


def flush(timeout_millis: int = 30_000) -> bool:
    """Export everything recorded so far; True when it is in the store (or, for a store the agent holds, handed
    to the agent, which stores it within seconds)."""
    cfg = _config
    if cfg is None:
        return True
    ok = cfg.provider.force_flush(timeout_millis)
    # BatchSpanProcessor.force_flush hands spans to the exporter but does not flush the exporter itself.
    if cfg.exporter is not None:
        ok = cfg.exporter.force_flush(timeout_millis) and ok
    return ok


def shutdown() -> None:
    """Flush and release the store (a provider passed to ``configure`` is left to its owner)."""
    with _lock:
        _shutdown_locked()


def _shutdown_locked() -> None:
    global _config
    if _config is not None and _config.owns_provider:
        _config.provider.shutdown()
    _config = None


def _current() -> _Config:
    if _config is None:
        configure()
    return _config


def _attribute_value(value):
    """OpenTelemetry takes primitives and homogeneous lists of them; anything else is kept as JSON text."""
    if isinstance(value, (str, bool, int, float)):
        return value
    if isinstance(value, (list, tuple)) and value and all(type(v) is type(value[0]) for v in value):
        if isinstance(value[0], (str, bool, int, float)):
            return list(value)
    return json.dumps(value, sort_keys=True, default=str)


def _content(value) -> str:
    return value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)


def _parent_context(parent):
    if parent is None:
        return None
    if isinstance(parent, _Span):
        return trace.set_span_in_context(parent.span)
    if isinstance(parent, otel_context.Context):
        return parent
    if isinstance(parent, Mapping):
        return extract(parent)
    raise TypeError(f"parent must be a request or stage, an OpenTelemetry Context or a traceparent carrier, not {type(parent).__name__}")


_UNSET = object()


class _Span:
    """A span that is current inside its ``with`` block."""

    _input_key = _output_key = _input_content_key = _output_content_key = ""

    def __init__(self, name: str, kind: SpanKind, attributes: dict, parent, input=_UNSET, input_digest=None):
        self._cfg = _current()
        self._name = name
        self._kind = kind
        self._attributes = {k: _attribute_value(v) for k, v in attributes.items() if v is not None}
        self._parent = _parent_context(parent)
        if input_digest is not None:
            self._attributes[self._input_key] = input_digest
        elif input is not _UNSET:
            self._attributes[self._input_key] = digest(input)
            if self._cfg.record_content:
                self._attributes[self._input_content_key] = _content(input)
        self.span = None
        self._token = None

    def __enter__(self):
        self.span = self._cfg.tracer.start_span(
            self._name, context=self._parent, kind=self._kind, attributes=self._attributes
        )
        self._token = otel_context.attach(trace.set_span_in_context(self.span))
        return self

    def __exit__(self, exc_type, exc, tb):
        try:
            if exc is not None:
                self.span.record_exception(exc)
                self.span.set_status(Status(StatusCode.ERROR, f"{exc_type.__name__}: {exc}"))
        finally:
            otel_context.detach(self._token)
            self.span.end()
        return False

    @property
    def trace_id(self) -> str:
        return f"{self.span.get_span_context().trace_id:032x}"

    def set_output(self, value=_UNSET, *, output_digest: str | None = None) -> str:
        """Record the output's digest (and the output itself if content recording is on)."""
        if output_digest is None:
            if value is _UNSET:
                raise TypeError("set_output needs the output value or output_digest=")
            output_digest = digest(value)
            if self._cfg.record_content:
                self.span.set_attribute(self._output_content_key, _content(value))
        self.span.set_attribute(self._output_key, output_digest)
        return output_digest

    def set_attribute(self, key: str, value) -> None:
        if value is not None:
            self.span.set_attribute(key, _attribute_value(value))

    def set_attributes(self, attributes: Mapping) -> None:
        for key, value in attributes.items():
            self.set_attribute(key, value)

    def carrier(self) -> dict[str, str]:
        """A W3C ``traceparent`` carrier that makes this span the parent in another thread or process."""
        out: dict[str, str] = {}
        inject(out, context=trace.set_span_in_context(self.span))
        return out


class Request(_Span):
    """The root span of one request (kind SERVER)."""

    _input_key, _output_key = INPUT_DIGEST, OUTPUT_DIGEST
    _input_content_key, _output_content_key = INPUT_CONTENT, OUTPUT_CONTENT

    def __init__(self, request_id: str, input=_UNSET, *, input_digest=None, attributes=None, name="inference.request", parent=None):
        if not isinstance(request_id, str) or not request_id:
            raise ValueError("request_id must be a non-empty string")
        self.request_id = request_id
        super().__init__(name, SpanKind.SERVER, {**(attributes or {}), REQUEST_ID: request_id}, parent, input, input_digest)

    def stage(self, name: str, input=_UNSET, **kwargs) -> Stage:
        """A stage of this request, whatever the current context is (for worker threads)."""
        kwargs.setdefault("parent", self)
        return Stage(name, input, **kwargs)


class Stage(_Span):
    """One pipeline stage of a request (a child of the request or of another stage)."""

    _input_key, _output_key = STAGE_INPUT_DIGEST, STAGE_OUTPUT_DIGEST
    _input_content_key, _output_content_key = STAGE_INPUT_CONTENT, STAGE_OUTPUT_CONTENT

    def __init__(self, name: str, input=_UNSET, *, input_digest=None, attributes=None, parent=None, rank: int | None = None, span_name: str | None = None):
        attrs = {**(attributes or {}), STAGE: name}
        if rank is not None:
            attrs["parallel.tp_rank"] = rank
        super().__init__(span_name or f"stage.{name}", SpanKind.INTERNAL, attrs, parent, input, input_digest)


def request(request_id: str, input=_UNSET, **kwargs) -> Request:
    """Open a request: ``with stagetrace.request(id, input=...) as req:``."""
    return Request(request_id, input, **kwargs)


def stage(name: str, input=_UNSET, **kwargs) -> Stage:
    """Open a stage under the current span, or under ``parent=`` (a request, stage, Context or carrier)."""
    return Stage(name, input, **kwargs)


def current_carrier() -> dict[str, str]:
    """The current context as a ``traceparent`` carrier, for handing work to another thread or process."""
    out: dict[str, str] = {}
    inject(out)
    return out
