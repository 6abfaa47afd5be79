"""The stage-span API: one root span per request, one child span per pipeline stage, digests computed for you.

    import stagetrace

    stagetrace.configure(service_name="rag-api")              # embedded store by default
    with stagetrace.request("req-42", input={"prompt": p, "model": m, "seed": 7}) as req:
        with stagetrace.stage("retrieval", input=p, attributes={"retrieval.top_k": 8}) as st:
            docs = index.search(p)
            st.set_output([d.id for d in docs])
        ...
        req.set_output(text)

Spans follow the conventions in docs/design.md#span-conventions, so any OpenTelemetry producer that uses the
same names is read the same way. Context crosses threads and processes as a W3C ``traceparent`` carrier:
``carrier = req.carrier()`` here, ``stagetrace.stage("allreduce", parent=carrier)`` there.
Prompts and outputs are stored only as digests unless ``record_content=True``
(or ``STAGETRACE_RECORD_CONTENT=1``).

Content may be a tensor on any device (``stagetrace.tensors``). A GPU tensor is hashed on its device without
synchronising the caller's stream: the stage ends when the caller leaves it, and the span is completed (digest set,
span ended at that time) off the caller's thread when the device has the digest (``stagetrace.completion``).
Arrays are never recorded as content, only digested.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.propagate import extract, inject
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import SpanKind, Status, StatusCode

from stagetrace import completion, config
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
    TP_RANK,
)
from stagetrace.digest import digest, is_array

_SCOPE = "stagetrace"


class _Config:
    def __init__(self, provider, record_content: bool, exporter=None, owns_provider: bool = False, clock=None):
        self.provider = provider
        self.tracer = provider.get_tracer(_SCOPE)
        self.record_content = record_content
        self.exporter = exporter
        self.owns_provider = owns_provider
        self.clock = clock  # None: the SDK reads the wall clock


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
    clock: Callable[[], int] | None = None,
) -> None:
    """Set up the API once per process.

    With ``tracer_provider``, spans go wherever that provider sends them (its processors and
    exporters are yours). Otherwise stagetrace builds a provider with ``service.name`` and
    ``host.name`` and a ``BatchSpanProcessor`` into a ``ClickHouseSpanExporter`` on ``store``
    (a DSN, default ``$STAGETRACE_STORE`` or the embedded store). ``clock``: where requests and
    stages read their start and end times (nanoseconds since the epoch), for a simulation or a
    replay whose spans must lie on its own clock; by default the wall clock.
    """
    global _config
    record = config.record_content() if record_content is None else record_content
    with _lock:
        if _config is not None:
            _shutdown_locked()
        if tracer_provider is not None:
            _config = _Config(tracer_provider, record, clock=clock)
            return
        from stagetrace.exporters.clickhouse import ClickHouseSpanExporter

        attrs = {"service.name": service_name or config.service_name(), "host.name": host_name or socket.gethostname()}
        attrs.update(resource_attributes or {})
        provider = TracerProvider(resource=Resource.create(attrs))
        exporter = ClickHouseSpanExporter(store=store)
        provider.add_span_processor(BatchSpanProcessor(exporter, **batching()))
        _config = _Config(provider, record, exporter, owns_provider=True, clock=clock)


# The exporter stores each batch before it answers, and one insert costs about the same up to a few thousand
# rows: batches larger than the SDK's 512 (OTEL_BSP_* variables still decide when set).
_BATCHING = {
    "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": ("max_export_batch_size", 4096),
    "OTEL_BSP_MAX_QUEUE_SIZE": ("max_queue_size", 16384),
    "OTEL_BSP_SCHEDULE_DELAY": ("schedule_delay_millis", 1000),
}


def batching() -> dict:
    """The ``BatchSpanProcessor`` arguments ``configure`` uses, except those an ``OTEL_BSP_*`` variable sets."""
    return {argument: default for variable, (argument, default) in _BATCHING.items() if variable not in os.environ}


def flush(timeout_millis: int = 30_000) -> bool:
    """Export everything recorded so far; True when it is in the store (or, for a store the agent holds, handed
    to the agent, which stores it within seconds)."""
    started = time.monotonic()
    ok = completion.drain(timeout_millis / 1000)  # spans waiting for device digests end first
    cfg = _config
    if cfg is None:
        return ok
    timeout_millis = max(0, int(timeout_millis - (time.monotonic() - started) * 1000))
    ok = cfg.provider.force_flush(timeout_millis) and ok
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
    if _config is not None:
        completion.drain(completion.EXIT_WAIT_S)
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
    raise TypeError(
        f"parent must be a request or stage, an OpenTelemetry Context or a traceparent carrier, not {type(parent).__name__}"
    )


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
        self._pending: dict = {}  # attribute -> value still being computed on a device
        if input_digest is not None:
            self._attributes[self._input_key] = input_digest
        elif input is not _UNSET:
            self._record(self._attributes, self._input_key, self._input_content_key, input)
        self.span = None
        self._token = None

    def _record(self, attributes: dict, key: str, content_key: str, value):
        """Digest ``value`` into ``attributes[key]`` and return the digest; for an array whose device is still at it
        (or that could not be read), keep it pending and return the pending digest."""
        if not is_array(value):
            attributes[key] = digest(value)
            if self._cfg.record_content:
                attributes[content_key] = _content(value)
            return attributes[key]
        from stagetrace import tensors

        # arrays are digested, never kept as content (and a device tensor is not read on the host)
        started = tensors.start(value)
        try:
            if started.done():
                attributes[key] = started.result()
                return attributes[key]
        except tensors.DigestUnavailable:  # a tensor that could not be read: the span says why when it ends
            pass
        self._pending[key] = started
        return started

    def __enter__(self):
        clock = self._cfg.clock
        self.span = self._cfg.tracer.start_span(
            self._name,
            context=self._parent,
            kind=self._kind,
            attributes=self._attributes,
            start_time=clock() if clock else None,
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
            clock = self._cfg.clock
            if self._pending:  # the stage ends now; its span when the device has the digests
                completion.submit(self.span, self._pending, clock() if clock else time.time_ns())
            else:
                self.span.end(end_time=clock() if clock else None)
        return False

    @property
    def trace_id(self) -> str:
        return f"{self.span.get_span_context().trace_id:032x}"

    def set_output(self, value=_UNSET, *, output_digest: str | None = None):
        """Record the output's digest (and the output itself if content recording is on); return the digest, or for
        a device tensor a ``Pending`` digest (``.result()`` waits for it) that the span gets when it is ready."""
        if output_digest is None:
            if value is _UNSET:
                raise TypeError("set_output needs the output value or output_digest=")
            self._pending.pop(self._output_key, None)  # the latest output is the stage's
            attributes: dict = {}
            recorded = self._record(attributes, self._output_key, self._output_content_key, value)
            for key, text in attributes.items():
                self.span.set_attribute(key, text)
            return recorded
        self._pending.pop(self._output_key, None)
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

    def __init__(
        self,
        request_id: str,
        input=_UNSET,
        *,
        input_digest=None,
        attributes=None,
        name="inference.request",
        parent=None,
    ):
        if not isinstance(request_id, str) or not request_id:
            raise ValueError("request_id must be a non-empty string")
        self.request_id = request_id
        super().__init__(
            name, SpanKind.SERVER, {**(attributes or {}), REQUEST_ID: request_id}, parent, input, input_digest
        )

    def stage(self, name: str, input=_UNSET, **kwargs) -> Stage:
        """A stage of this request, whatever the current context is (for worker threads)."""
        kwargs.setdefault("parent", self)
        return Stage(name, input, **kwargs)


class Stage(_Span):
    """One pipeline stage of a request (a child of the request or of another stage)."""

    _input_key, _output_key = STAGE_INPUT_DIGEST, STAGE_OUTPUT_DIGEST
    _input_content_key, _output_content_key = STAGE_INPUT_CONTENT, STAGE_OUTPUT_CONTENT

    def __init__(
        self,
        name: str,
        input=_UNSET,
        *,
        input_digest=None,
        attributes=None,
        parent=None,
        rank: int | None = None,
        span_name: str | None = None,
    ):
        attrs = {**(attributes or {}), STAGE: name}
        if rank is not None:
            attrs[TP_RANK] = rank
        super().__init__(span_name or f"stage.{name}", SpanKind.INTERNAL, attrs, parent, input, input_digest)


def request(request_id: str, input=_UNSET, **kwargs) -> Request:
    """Open a request: ``with stagetrace.request(id, input=...) as req:``."""
    return Request(request_id, input, **kwargs)


def stage(name: str, input=_UNSET, **kwargs) -> Stage:
    """Open a stage under the current span, or under ``parent=`` (a request, stage, Context or carrier)."""
    return Stage(name, input, **kwargs)


def measured_stage(
    name: str,
    *,
    parent,
    start_time_ns: int,
    end_time_ns: int,
    attributes: Mapping | None = None,
    rank: int | None = None,
    values: Mapping | None = None,
) -> None:
    """A stage an integration measured itself (many collectives or decode steps folded into one span): its span
    starts and ends at the given times, under ``parent`` (a request or stage, Context or carrier). ``values`` are
    attributes still being computed (``done()``/``result()``: device digests, device timings); they are set, and the
    span ended, when ready, off the caller's thread."""
    attrs = {k: _attribute_value(v) for k, v in (attributes or {}).items() if v is not None}
    attrs[STAGE] = name
    if rank is not None:
        attrs[TP_RANK] = rank
    span = _current().tracer.start_span(
        f"stage.{name}",
        context=_parent_context(parent),
        kind=SpanKind.INTERNAL,
        attributes=attrs,
        start_time=start_time_ns,
    )
    completion.submit(span, dict(values or {}), end_time_ns)


def current_carrier() -> dict[str, str]:
    """The current context as a ``traceparent`` carrier, for handing work to another thread or process."""
    out: dict[str, str] = {}
    inject(out)
    return out
