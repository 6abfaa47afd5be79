"""OTLP/gRPC receiver: the ``TraceService`` and ``MetricsService`` of OTLP in front of the OTLP/HTTP receiver's core.

gRPC on 4317 is what the OpenTelemetry SDKs' OTLP exporters, vLLM and SGLang send by default. Each ``Export``
call is handed to the same :class:`~stagetrace.exporters.otlp.OtlpReceiver` methods the HTTP receiver calls, so
both take spans and points alike: one queue, one partial-success rule, one durability. Answers, as the OTLP
specification has them for gRPC:

* OK, with ``partial_success`` counting what was not taken (invalid IDs, histograms): the sender must not retry.
* ``UNAUTHENTICATED``: the agent requires a token and the call lacks ``authorization: Bearer <token>``.
* ``INVALID_ARGUMENT``: the message does not decode.
* ``RESOURCE_EXHAUSTED`` (no RetryInfo, so not to be retried): a message over the size limit, or more spans
  in one call than the receiver queues.
* ``UNAVAILABLE`` with ``google.rpc.RetryInfo`` in ``google.rpc.retryinfo-bin`` (the trailer the SDK exporters
  read): the span queue is full or the store refuses inserts; the sender waits and retries.

gzip-compressed calls are inflated by gRPC itself, within the same limit.
"""

from __future__ import annotations

import errno
import logging
import os
from concurrent import futures

# gRPC's core logs to stderr on its own (a port it cannot bind, twice, in its format); the agent says it once,
# in a line a person can act on. Read when grpc is first imported.
os.environ.setdefault("GRPC_VERBOSITY", "NONE")

import grpc  # noqa: E402
from google.protobuf.duration_pb2 import Duration  # noqa: E402
from google.protobuf.message import DecodeError
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

from stagetrace import httpd
from stagetrace.exporters.otlp import RETRY_AFTER_S, OtlpError, OtlpReceiver
from stagetrace.exporters.prometheus import parse_listen

logger = logging.getLogger(__name__)

DEFAULT_GRPC_LISTEN = "127.0.0.1:4317"
MAX_WORKERS = 4  # calls served at once; the agent shares its node with the GPUs it watches
MAX_CONCURRENT_RPCS = 64  # calls in flight, served or waiting; beyond, gRPC answers RESOURCE_EXHAUSTED

# google.rpc.RetryInfo {retry_delay: Duration}: field 1, length-delimited. Encoded here rather than taken from
# googleapis-common-protos, which the receiver does not otherwise need.
_DELAY = Duration(seconds=RETRY_AFTER_S).SerializeToString()
RETRY_INFO = b"\x0a" + bytes([len(_DELAY)]) + _DELAY

_CODES = {400: grpc.StatusCode.INVALID_ARGUMENT, 413: grpc.StatusCode.RESOURCE_EXHAUSTED,
          503: grpc.StatusCode.UNAVAILABLE}  # fmt: skip

# (service full name, request class, receiver method), the names from the service definitions opentelemetry-proto ships
_SERVICES = (
    (trace_service_pb2.DESCRIPTOR.services_by_name["TraceService"].full_name,
     trace_service_pb2.ExportTraceServiceRequest, OtlpReceiver.traces),
    (metrics_service_pb2.DESCRIPTOR.services_by_name["MetricsService"].full_name,
     metrics_service_pb2.ExportMetricsServiceRequest, OtlpReceiver.metrics),
)  # fmt: skip


class OtlpGrpcServer:
    """OTLP/gRPC on ``listen``, handing each call to ``receiver``; ``close`` stops taking calls and lets those
    in flight finish (the receiver, which the caller owns, then writes what is queued)."""

    def __init__(self, receiver: OtlpReceiver, listen: str = DEFAULT_GRPC_LISTEN, *, max_workers: int = MAX_WORKERS,
                 max_concurrent_rpcs: int = MAX_CONCURRENT_RPCS):  # fmt: skip
        self.receiver = receiver
        host, port = parse_listen(listen)
        limit = receiver.max_body_bytes
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers, thread_name_prefix="stagetrace-otlp-grpc"),
            options=[("grpc.max_receive_message_length", limit), ("grpc.so_reuseport", 0)],
            maximum_concurrent_rpcs=max_concurrent_rpcs,
        )
        for service, request_class, accept in _SERVICES:
            # raw bytes in: a message that does not decode is INVALID_ARGUMENT, not gRPC's generic INTERNAL
            handler = grpc.unary_unary_rpc_method_handler(
                self._handler(request_class, accept), request_deserializer=None,
                response_serializer=lambda message: message.SerializeToString(),
            )  # fmt: skip
            self._server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, {"Export": handler}),))
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        try:
            bound = self._server.add_insecure_port(address)
        except RuntimeError:  # grpcio raises instead of returning 0 on some releases
            bound = 0
        if not bound:  # gRPC says no more; with SO_REUSEPORT off a port in use is the usual reason
            raise OSError(errno.EADDRINUSE, os.strerror(errno.EADDRINUSE))
        self.url = f"{host}:{bound}"
        self._server.start()

    def _handler(self, request_class, accept):
        def export(body: bytes, context: grpc.ServicerContext):
            metadata = dict(context.invocation_metadata())
            if not httpd.authorized(metadata.get("authorization"), self.receiver.token):
                context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")
            request = request_class()
            try:
                request.ParseFromString(body)
            except DecodeError as exc:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"not an {request_class.__name__}: {exc}")
            try:
                return accept(self.receiver, request)
            except OtlpError as exc:
                if exc.retry:
                    context.set_trailing_metadata((("google.rpc.retryinfo-bin", RETRY_INFO),))
                context.abort(_CODES.get(exc.status, grpc.StatusCode.INTERNAL), exc.message)

        return export

    def close(self) -> None:
        self._server.stop(grace=5).wait()


__all__ = ["DEFAULT_GRPC_LISTEN", "OtlpGrpcServer", "RETRY_INFO"]
