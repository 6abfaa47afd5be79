"""The kubelet's PodResources API (v1) without generated code: message classes built from ``api.proto``.

``api.proto`` beside this module is the source: its messages and service are read by a small parser
of the proto3 subset the file uses (messages with scalar, message and repeated fields, ``reserved``,
one service of unary methods) into a ``FileDescriptorProto``, added to a private descriptor pool, and
the message classes come from protobuf's message factory. gRPC needs no stubs either: a method is its
path (``/v1.PodResourcesLister/List``) and its request and response classes' (de)serializers.

Why not ``grpcio-tools`` and committed ``*_pb2.py``: generated modules pin the protobuf and grpcio
releases that generated them (``ValidateProtobufRuntimeVersion``, ``GRPC_GENERATED_VERSION``), so
each upgrade of either would need a regeneration and a build-time tool; the descriptors built here
are whatever the installed runtime builds, from the one file a person reads. The wire format is
pinned by tests that compare encoded bytes with the field numbers of the published API.

:class:`RecordedKubelet` serves recorded answers over the real protocol on a unix socket: the tests
and the demo's simulated nodes run one where a kubelet would be.
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Callable, Mapping
from concurrent import futures
from pathlib import Path
from typing import Any

# gRPC's core logs to stderr on its own (a kubelet closing its connection, in its format); the collector says
# what failed once, in its own line. Read when grpc is first imported (as the OTLP/gRPC receiver does).
os.environ.setdefault("GRPC_VERBOSITY", "NONE")

import grpc  # noqa: E402
from google.protobuf import descriptor_pb2, descriptor_pool, json_format, message_factory  # noqa: E402
from google.protobuf.message import DecodeError, Message  # noqa: E402

PROTO = Path(__file__).with_name("api.proto")

_FIELD = descriptor_pb2.FieldDescriptorProto
_SCALARS = {
    "string": _FIELD.TYPE_STRING,
    "bytes": _FIELD.TYPE_BYTES,
    "bool": _FIELD.TYPE_BOOL,
    "int32": _FIELD.TYPE_INT32,
    "int64": _FIELD.TYPE_INT64,
    "uint32": _FIELD.TYPE_UINT32,
    "uint64": _FIELD.TYPE_UINT64,
    "double": _FIELD.TYPE_DOUBLE,
    "float": _FIELD.TYPE_FLOAT,
}
_TOKEN = re.compile(r'"[^"]*"|[A-Za-z_][A-Za-z0-9_.]*|\d+|[{}();=]')
_COMMENT = re.compile(r"//[^\n]*|/\*.*?\*/", re.DOTALL)


class ProtoSyntaxError(ValueError):
    """The .proto text uses something the parser does not read; the message says what and where."""


def _json_name(name: str) -> str:
    """protoc's default JSON name: underscores dropped, the letter after each upper-cased."""
    parts = name.split("_")
    return parts[0] + "".join(p[:1].upper() + p[1:] for p in parts[1:])


class _Tokens:
    def __init__(self, text: str):
        self._tokens = _TOKEN.findall(_COMMENT.sub(" ", text))
        self._at = 0

    def peek(self) -> str | None:
        return self._tokens[self._at] if self._at < len(self._tokens) else None

    def take(self, expected: str | None = None) -> str:
        token = self.peek()
        if token is None or (expected is not None and token != expected):
            raise ProtoSyntaxError(f"expected {expected or 'a token'} at token {self._at}, found {token!r}")
        self._at += 1
        return token

    def until(self, end: str) -> None:
        while self.take() != end:
            pass


def parse_proto(text: str, name: str = "api.proto") -> descriptor_pb2.FileDescriptorProto:
    """The FileDescriptorProto of a proto3 file made of messages (scalar, message and repeated fields,
    ``reserved``) and services of unary methods; ProtoSyntaxError for anything else."""
    tokens = _Tokens(text)
    file = descriptor_pb2.FileDescriptorProto(name=name, syntax="proto3")
    while (token := tokens.peek()) is not None:
        if token in ("syntax", "option"):
            tokens.until(";")
        elif token == "package":
            tokens.take()
            file.package = tokens.take()
            tokens.take(";")
        elif token == "message":
            tokens.take()
            _message(tokens, file.message_type.add(name=tokens.take()))
        elif token == "service":
            tokens.take()
            _service(tokens, file.service.add(name=tokens.take()))
        else:
            raise ProtoSyntaxError(f"{name}: unexpected {token!r} at the top level")
    messages = {m.name for m in file.message_type}
    for message in file.message_type:
        for field in message.field:
            if field.type == _FIELD.TYPE_MESSAGE:
                if field.type_name not in messages:
                    raise ProtoSyntaxError(f"{name}: {message.name}.{field.name} has unknown type {field.type_name}")
                field.type_name = f".{file.package}.{field.type_name}"
    for service in file.service:
        for method in service.method:
            for kind in ("input_type", "output_type"):
                if getattr(method, kind) not in messages:
                    raise ProtoSyntaxError(
                        f"{name}: {service.name}.{method.name} names unknown {getattr(method, kind)}"
                    )
                setattr(method, kind, f".{file.package}.{getattr(method, kind)}")
    return file


def _message(tokens: _Tokens, message: descriptor_pb2.DescriptorProto) -> None:
    tokens.take("{")
    while (token := tokens.take()) != "}":
        if token == "reserved":
            while (item := tokens.take()) != ";":
                if item.isdigit():
                    message.reserved_range.add(start=int(item), end=int(item) + 1)
                elif item.startswith('"'):
                    message.reserved_name.append(item.strip('"'))
            continue
        label = _FIELD.LABEL_OPTIONAL
        if token == "repeated":
            label, token = _FIELD.LABEL_REPEATED, tokens.take()
        if token in ("map", "oneof", "enum", "message", "optional", "option", "extensions"):
            raise ProtoSyntaxError(f"{message.name}: {token!r} is not read by this parser")
        field = message.field.add(name=tokens.take(), label=label)
        tokens.take("=")
        field.number = int(tokens.take())
        field.json_name = _json_name(field.name)
        if token in _SCALARS:
            field.type = _SCALARS[token]
        else:
            field.type, field.type_name = _FIELD.TYPE_MESSAGE, token
        tokens.take(";")


def _service(tokens: _Tokens, service: descriptor_pb2.ServiceDescriptorProto) -> None:
    tokens.take("{")
    while tokens.take() != "}":  # "rpc"
        method = service.method.add(name=tokens.take())
        tokens.take("(")
        method.input_type = tokens.take()
        tokens.take(")")
        tokens.take("returns")
        tokens.take("(")
        method.output_type = tokens.take()
        tokens.take(")")
        if tokens.take() == "{":  # `{}` (options, empty: protoc records them as set) or `;`
            method.options.SetInParent()
            tokens.until("}")


FILE = parse_proto(PROTO.read_text())
POOL = descriptor_pool.DescriptorPool()  # private: another library's "v1" package cannot clash with it
_FILE_DESCRIPTOR = POOL.Add(FILE)


def message_class(name: str) -> type[Message]:
    """The message class of ``v1.<name>``."""
    return message_factory.GetMessageClass(POOL.FindMessageTypeByName(f"{FILE.package}.{name}"))


ListPodResourcesRequest = message_class("ListPodResourcesRequest")
ListPodResourcesResponse = message_class("ListPodResourcesResponse")
AllocatableResourcesRequest = message_class("AllocatableResourcesRequest")
AllocatableResourcesResponse = message_class("AllocatableResourcesResponse")
GetPodResourcesRequest = message_class("GetPodResourcesRequest")
GetPodResourcesResponse = message_class("GetPodResourcesResponse")
PodResources = message_class("PodResources")
ContainerResources = message_class("ContainerResources")
ContainerDevices = message_class("ContainerDevices")

SERVICE = POOL.FindServiceByName(f"{FILE.package}.PodResourcesLister")
# method name → (request class, response class), from the service's descriptor
METHODS: dict[str, tuple[type[Message], type[Message]]] = {
    m.name: (message_factory.GetMessageClass(m.input_type), message_factory.GetMessageClass(m.output_type))
    for m in SERVICE.methods
}


def method_path(method: str) -> str:
    """The gRPC path of a method: ``/v1.PodResourcesLister/List``."""
    return f"/{SERVICE.full_name}/{method}"


def call(channel: grpc.Channel, method: str, request: Message | None = None, *, timeout: float) -> Message:
    """One unary call of ``method`` on ``channel``: grpc.RpcError as gRPC raises it, DecodeError for an answer
    that is not the method's response message (decoded here, not by gRPC, which would log a traceback)."""
    request_class, response_class = METHODS[method]
    stub = channel.unary_unary(method_path(method), request_serializer=request_class.SerializeToString)
    answer = stub(request if request is not None else request_class(), timeout=timeout)
    return response_class.FromString(answer)


def channel(socket_path: str | os.PathLike) -> grpc.Channel:
    """A plaintext channel to a unix socket (the kubelet's is root-only; no TLS, as the kubelet serves it)."""
    return grpc.insecure_channel(
        f"unix:{os.fspath(socket_path)}",
        options=[
            ("grpc.max_receive_message_length", 16 * 2**20),  # the kubelet's own limit for this server
            ("grpc.enable_http_proxy", 0),
        ],
    )


def generic_handler(
    answers: Mapping[str, Callable[[Message, grpc.ServicerContext], Message]],
) -> grpc.GenericRpcHandler:
    """A gRPC handler of the PodResourcesLister service: ``answers`` maps method names to functions."""
    handlers = {
        name: grpc.unary_unary_rpc_method_handler(
            answer,
            request_deserializer=METHODS[name][0].FromString,
            response_serializer=METHODS[name][1].SerializeToString,
        )
        for name, answer in answers.items()
    }
    return grpc.method_handlers_generic_handler(SERVICE.full_name, handlers)


def parse_answer(method: str, text: str) -> Message:
    """A method's answer from its proto3 JSON form (what ``grpcurl`` prints); json_format.ParseError if not one."""
    return json_format.Parse(text, METHODS[method][1](), descriptor_pool=POOL)


def answer_json(method: str, answer: Message | Mapping[str, Any]) -> str:
    """The proto3 JSON of a method's answer (a message, or a dict in that JSON form, checked by parsing it)."""
    if not isinstance(answer, Message):
        answer = json_format.ParseDict(answer, METHODS[method][1](), descriptor_pool=POOL)
    return json_format.MessageToJson(answer, indent=1, descriptor_pool=POOL) + "\n"


class RecordedKubelet:
    """A PodResources server on a unix socket answering with recorded answers, over the real protocol.

    The answers are files in ``directory``: ``List.json`` and ``GetAllocatableResources.json``, each the
    proto3 JSON of the method's response (what ``grpcurl ... v1.PodResourcesLister/List`` prints), read
    again at each call so a writer can change them while the server runs (replace them atomically). A
    missing file answers UNIMPLEMENTED, as a kubelet without the method does; ``Get`` answers from
    ``List.json``, NOT_FOUND for a pod that is not there.
    """

    def __init__(self, socket_path: str | os.PathLike, directory: str | os.PathLike):
        self.socket_path = Path(socket_path)
        self.directory = Path(directory)
        self._server: grpc.Server | None = None
        self._lock = threading.Lock()

    def _recorded(self, method: str, context: grpc.ServicerContext) -> Message:
        path = self.directory / f"{method}.json"
        try:
            return parse_answer(method, path.read_text())
        except FileNotFoundError:
            context.abort(grpc.StatusCode.UNIMPLEMENTED, f"unknown method {method} (no {path.name} recorded)")

    def _get(self, request, context: grpc.ServicerContext) -> Message:
        for pod in self._recorded("List", context).pod_resources:
            if (pod.name, pod.namespace) == (request.pod_name, request.pod_namespace):
                return GetPodResourcesResponse(pod_resources=pod)
        context.abort(grpc.StatusCode.NOT_FOUND, f"pod {request.pod_namespace}/{request.pod_name} not found")

    def start(self) -> RecordedKubelet:
        with self._lock:
            if self._server is None:
                self.socket_path.parent.mkdir(parents=True, exist_ok=True)
                self.socket_path.unlink(missing_ok=True)  # a socket left by an earlier run
                server = grpc.server(futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="kubelet"))
                server.add_generic_rpc_handlers(
                    [
                        generic_handler(
                            {
                                "List": lambda request, context: self._recorded("List", context),
                                "GetAllocatableResources": lambda request, context: self._recorded(
                                    "GetAllocatableResources", context
                                ),
                                "Get": self._get,
                            }
                        )
                    ]
                )
                server.add_insecure_port(f"unix:{self.socket_path}")
                server.start()
                self._server = server
        return self

    def stop(self) -> None:
        with self._lock:
            if self._server is not None:
                self._server.stop(grace=None).wait(5)
                self._server = None
                self.socket_path.unlink(missing_ok=True)

    def __enter__(self) -> RecordedKubelet:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def write_answers(directory: str | os.PathLike, answers: Mapping[str, Message | Mapping[str, Any]]) -> None:
    """Write (atomically replace) recorded answers: method name → response (a message or its JSON dict)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for method, answer in answers.items():
        path = directory / f"{method}.json"
        partial = path.with_suffix(".json.partial")
        partial.write_text(answer_json(method, answer))
        partial.replace(path)


def load_answers(directory: str | os.PathLike) -> dict[str, Message]:
    """The recorded answers in ``directory``, by method name."""
    return {
        method: parse_answer(method, (Path(directory) / f"{method}.json").read_text())
        for method in METHODS
        if (Path(directory) / f"{method}.json").exists()
    }


__all__ = [
    "FILE",
    "METHODS",
    "POOL",
    "PROTO",
    "SERVICE",
    "DecodeError",
    "ProtoSyntaxError",
    "RecordedKubelet",
    "answer_json",
    "call",
    "channel",
    "generic_handler",
    "load_answers",
    "message_class",
    "method_path",
    "parse_answer",
    "parse_proto",
    "write_answers",
]
