"""OTLP/gRPC receiver: the ``TraceService`` and ``MetricsService`` of OTLP in front of the OTLP/HTTP receiver's core.

gRPC on 4317 is what the OpenTelemetry Python SDK's OTLP exporter, vLLM and SGLang send by default. Each
``Export`` call is decoded with the HTTP receiver's ``decode`` and handed to the same
:class:`~stagetrace.exporters.otlp.OtlpReceiver` methods its ``POST`` handler calls, so both front-ends take
spans and points alike: one write path, one partial-success rule, one durability. Answers, as the OTLP specification
has them for gRPC:

* OK, with ``partial_success`` counting what was not taken (invalid IDs, histograms): the sender must not retry.
* ``UNAUTHENTICATED``: the agent requires a token and the call lacks ``authorization: Bearer <token>``.
* ``INVALID_ARGUMENT``: the message does not decode.
* ``RESOURCE_EXHAUSTED`` without RetryInfo, so final: a message over the size limit (gRPC checks it, inflated
  for gzip calls), or more spans in one call than the receiver takes.
* ``UNAVAILABLE`` with ``google.rpc.RetryInfo``: the store refuses inserts and there is no spool, the spool is
  full, or free space under the store or the spool is below the agent's reserve (``--min-free-space``); the
  sender waits and retries. RetryInfo goes in ``google.rpc.retryinfo-bin`` (the only place the Python exporter
  reads it) and in the rich status ``grpc-status-details-bin`` (where grpc-go senders, the Collector's, look).
"""

from __future__ import annotations

import collections
import logging
import os
import socket
from concurrent import futures

# gRPC's core logs to stderr on its own (a port it cannot bind, twice, in its format); the agent says it once,
# in a line a person can act on. Read when grpc is first imported.
os.environ.setdefault("GRPC_VERBOSITY", "NONE")

import grpc  # noqa: E402
from google.protobuf.duration_pb2 import Duration  # noqa: E402
from opentelemetry.proto.collector.logs.v1 import logs_service_pb2  # noqa: E402
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2  # noqa: E402
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2  # noqa: E402

from stagetrace import httpd  # noqa: E402
from stagetrace.exporters.otlp import (  # noqa: E402
    PROTOBUF,
    RETRY_AFTER_S,
    OtlpError,
    OtlpReceiver,
    _RpcStatus,  # google.rpc.Status, also the body of the HTTP receiver's errors
    decode,
    request_token,
)
from stagetrace.httpd import parse_listen  # noqa: E402

logger = logging.getLogger(__name__)

DEFAULT_GRPC_LISTEN = "127.0.0.1:4317"
MAX_WORKERS = 4  # calls served at once; the agent shares its node with the GPUs it watches
MAX_CONCURRENT_RPCS = 64  # calls in flight, served or waiting; beyond, gRPC answers RESOURCE_EXHAUSTED

# google.rpc.RetryInfo {retry_delay: Duration}: one length-delimited field 1. Encoded here rather than taken
# from googleapis-common-protos, which the receiver does not otherwise need.
_DELAY = Duration(seconds=RETRY_AFTER_S).SerializeToString()
RETRY_INFO = b"\x0a" + bytes([len(_DELAY)]) + _DELAY
_RETRY_INFO_TYPE = "type.googleapis.com/google.rpc.RetryInfo"

# the HTTP status OtlpError carries -> the gRPC code the OTLP specification names for the same case
_CODES = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    404: grpc.StatusCode.UNIMPLEMENTED,  # logs turned off (--otlp-logs none)
    413: grpc.StatusCode.RESOURCE_EXHAUSTED,
    503: grpc.StatusCode.UNAVAILABLE,
}

# (service full name, request class, receiver method): the names from the service definitions opentelemetry-proto
# ships. Not its *_pb2_grpc servicers: they deserialize before the handler runs, and a message that does not
# decode would then be gRPC's INTERNAL instead of INVALID_ARGUMENT.
_SERVICES = (
    (
        trace_service_pb2.DESCRIPTOR.services_by_name["TraceService"],
        trace_service_pb2.ExportTraceServiceRequest,
        OtlpReceiver.traces,
    ),
    (
        metrics_service_pb2.DESCRIPTOR.services_by_name["MetricsService"],
        metrics_service_pb2.ExportMetricsServiceRequest,
        OtlpReceiver.metrics,
    ),
    (
        logs_service_pb2.DESCRIPTOR.services_by_name["LogsService"],
        logs_service_pb2.ExportLogsServiceRequest,
        OtlpReceiver.logs,
    ),
)


class _Status(collections.namedtuple("_Status", ("code", "details", "trailing_metadata")), grpc.Status):
    """What ``abort_with_status`` sends: a code, its message and trailers (grpcio-status's shape, without it)."""


def _status(code: grpc.StatusCode, message: str, retry: bool) -> _Status:
    rich = _RpcStatus(code=code.value[0], message=message)
    trailers = []
    if retry:
        rich.details.add(type_url=_RETRY_INFO_TYPE, value=RETRY_INFO)
        trailers.append(("google.rpc.retryinfo-bin", RETRY_INFO))
    trailers.append(("grpc-status-details-bin", rich.SerializeToString()))
    return _Status(code, message, tuple(trailers))


def _bind_error(host: str, port: int) -> OSError:
    """Why gRPC could not bind (it says only that it failed): the error a plain socket gets on the same address."""
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family) as probe:
            probe.bind((host, port))
    except OSError as exc:
        return exc
    return OSError(f"gRPC could not bind {host}:{port}")


class OtlpGrpcServer:
    """OTLP/gRPC on ``listen``, handing each call to ``receiver``; ``close`` stops taking calls and lets those
    in flight finish (each is answered once its spans are durable). Its message limit is the
    receiver's ``max_body_bytes``, the HTTP body limit."""

    def __init__(
        self,
        receiver: OtlpReceiver,
        listen: str = DEFAULT_GRPC_LISTEN,
        *,
        max_workers: int = MAX_WORKERS,
        max_concurrent_rpcs: int = MAX_CONCURRENT_RPCS,
        tls=None,
    ):
        self.receiver = receiver
        host, port = parse_listen(listen)
        self._server = grpc.server(
            futures.ThreadPoolExecutor(max_workers, thread_name_prefix="stagetrace-otlp-grpc"),
            # so_reuseport off: with it, a second agent on the same port would bind and split the calls silently
            options=[("grpc.max_receive_message_length", receiver.max_body_bytes), ("grpc.so_reuseport", 0)],
            maximum_concurrent_rpcs=max_concurrent_rpcs,
        )
        for service, request_class, accept in _SERVICES:
            # raw bytes in (no request_deserializer), so decoding is the HTTP receiver's, with its answers
            handlers = {
                method.name: grpc.unary_unary_rpc_method_handler(
                    self._handler(request_class, accept),
                    response_serializer=lambda message: message.SerializeToString(),
                )
                for method in service.methods
            }
            self._server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
            # what the generated servicers also do: calls from generated stubs then skip the generic lookup
            self._server.add_registered_method_handlers(service.full_name, handlers)
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        try:
            # with TLS, the web configuration's certificate (taken again when it changes); the token as before
            bound = (
                self._server.add_secure_port(address, tls.grpc_credentials())
                if tls is not None
                else self._server.add_insecure_port(address)
            )
        except RuntimeError:  # recent grpcio raises where older ones returned 0
            bound = 0
        if not bound:
            raise _bind_error(host, port)
        self.url = f"[{host}]:{bound}" if ":" in host else f"{host}:{bound}"  # a gRPC target: no scheme, no path
        self._server.start()

    def _handler(self, request_class, accept):
        def export(body: bytes, context: grpc.ServicerContext):
            try:
                metadata = dict(context.invocation_metadata())
                if not httpd.authorized(metadata.get("authorization"), self.receiver.token):
                    raise OtlpError(401, "missing or wrong bearer token")
                return accept(self.receiver, decode(request_class(), body, PROTOBUF), request_token(body, "grpc"), body)
            except OtlpError as exc:
                code = _CODES.get(exc.status, grpc.StatusCode.INTERNAL)
                context.abort_with_status(_status(code, exc.message, exc.retry))

        return export

    def close(self) -> None:
        self._server.stop(grace=5).wait()


__all__ = ["DEFAULT_GRPC_LISTEN", "MAX_CONCURRENT_RPCS", "MAX_WORKERS", "OtlpGrpcServer", "RETRY_INFO"]
