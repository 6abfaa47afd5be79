"""What the agent's HTTP listeners share: a threaded stdlib server on one address, and the optional bearer token.

The token guards the OTLP receiver and the query endpoint alike. It comes from a file (``--token-file``,
``$STAGETRACE_AGENT_TOKEN_FILE``) or ``$STAGETRACE_AGENT_TOKEN``, never from the command line, where ``ps``
would show it, and is never logged.
"""

from __future__ import annotations

import base64
import hmac
import socket
import ssl
import threading
import time
import zlib
from dataclasses import dataclass
from email.parser import BytesParser
from email.policy import HTTP
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from stagetrace.config import TokenError, load_token  # re-exported

_LINGER_S = 2.0
_LINGER_BYTES = 64 * 1024 * 1024


def parse_listen(text: str) -> tuple[str, int]:
    """``127.0.0.1:9464``, ``[::1]:9464`` or ``:9464`` (loopback) -> (address, port); ValueError says how to write it."""
    host, sep, port = text.rpartition(":")
    host = host.strip("[]") or "127.0.0.1"
    if not sep or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"listen address {text!r} is not HOST:PORT: write e.g. 127.0.0.1:9464")
    return host, int(port)


class HttpError(Exception):
    """A request answered with an HTTP error status and a one-line message."""

    def __init__(self, status: int, message: str, *, body_read: bool = True):
        super().__init__(message)
        self.status = status
        self.message = message
        self.body_read = body_read  # False: the body is still on the connection, which must not be reused


def read_body(headers, rfile, limit: int) -> bytes:
    """The request body, inflated (gzip, deflate); HttpError for a missing length, an oversized or truncated body."""
    if (headers.get("Transfer-Encoding") or "").strip().lower() == "chunked":
        body = _read_chunked(rfile, limit)
    else:
        length = (headers.get("Content-Length") or "").strip()
        if not length.isdigit():
            raise HttpError(411, "send the body with a Content-Length", body_read=False)
        if int(length) > limit:
            raise HttpError(413, f"body of {length} bytes is over the limit of {limit}", body_read=False)
        body = rfile.read(int(length))
        if len(body) < int(length):
            raise HttpError(400, "body ended before Content-Length bytes", body_read=False)
    encoding = (headers.get("Content-Encoding") or "identity").strip().lower()
    if encoding == "identity":
        return body
    if encoding not in ("gzip", "deflate"):
        raise HttpError(415, f"Content-Encoding {encoding} is not supported: use gzip, deflate or none")
    # gzip: with header and trailer; deflate: zlib-wrapped, as HTTP and the OTLP exporters have it
    inflater = zlib.decompressobj(16 + zlib.MAX_WBITS if encoding == "gzip" else zlib.MAX_WBITS)
    try:
        data = inflater.decompress(body, limit + 1)  # stop early: a small bomb must not inflate to gigabytes
    except zlib.error as exc:
        raise HttpError(400, f"body is not valid {encoding}: {exc}") from None
    if len(data) > limit:
        raise HttpError(413, f"body inflates to over the limit of {limit} bytes")
    if not inflater.eof:
        raise HttpError(400, f"{encoding} body is truncated")
    return data


def _read_chunked(rfile, limit: int) -> bytes:
    """A ``Transfer-Encoding: chunked`` body (clickhouse-connect streams inserts this way), at most ``limit`` bytes."""
    chunks, total = [], 0
    while True:
        line = rfile.readline(1024)
        try:
            size = int(line.split(b";", 1)[0].strip(), 16)
        except ValueError:
            raise HttpError(400, "malformed chunked body", body_read=False) from None
        if size == 0:
            while rfile.readline(1024).strip():  # trailer fields, up to the blank line
                pass
            return b"".join(chunks)
        total += size
        if total > limit:
            raise HttpError(413, f"body is over the limit of {limit} bytes", body_read=False)
        chunk = rfile.read(size)
        if len(chunk) < size or rfile.readline(3).strip():
            raise HttpError(400, "chunked body ended early", body_read=False)
        chunks.append(chunk)


def form_fields(content_type: str, body: bytes) -> dict[str, str]:
    """The text fields of a multipart form (clickhouse-connect sends long parameters this way)."""
    message = BytesParser(policy=HTTP).parsebytes(b"Content-Type: " + content_type.encode() + b"\r\n\r\n" + body)
    fields = {}
    for part in message.iter_parts():
        if part.get_filename():
            raise ValueError("external data (file parts) is not supported")
        fields[part.get_param("name", header="content-disposition")] = part.get_content()
    return fields


def authorized(header: str | None, token: str | None) -> bool:
    """Whether an ``Authorization`` header carries ``token``: ``Bearer <token>``, or Basic with the token as the
    password (what Grafana's ClickHouse data source sends when the token is entered as its password)."""
    if token is None:
        return True
    scheme, _, credentials = (header or "").strip().partition(" ")
    offered = credentials.strip()
    if scheme.lower() == "basic":
        try:
            offered = base64.b64decode(offered, validate=True).decode().partition(":")[2]
        except (ValueError, UnicodeDecodeError):
            return False
    elif scheme.lower() != "bearer":
        return False
    return hmac.compare_digest(offered.encode(), token.encode())


class Handler(BaseHTTPRequestHandler):
    """Keep-alive HTTP/1.1, without the stdlib's line on stderr for every request."""

    protocol_version = "HTTP/1.1"
    # headers and body go out as separate writes: with Nagle's algorithm the body waits for the client's delayed
    # ACK of the headers, 40 ms on every answer of a kept-alive connection
    disable_nagle_algorithm = True
    server_version = "stagetrace"
    sys_version = ""
    # Seconds a connection may stay silent (idle keep-alive, or a body that stops short of its length):
    # without it each such client holds a thread forever. The stdlib closes the connection quietly.
    timeout = 120
    slots: threading.BoundedSemaphore | None = None  # requests in flight at once (``start``'s max_in_flight)
    _holding = False
    user_admitted = False  # a user of the web configuration's basic_auth_users: no token is asked for on top

    def setup(self) -> None:
        super().setup()
        if hasattr(self.connection, "do_handshake"):  # TLS: handshaken here, in the connection's own thread
            self.connection.do_handshake()

    def parse_request(self) -> bool:
        if not super().parse_request():
            return False
        web = self.server.web
        if web is not None and web.users:  # one Authorization header: a user's password stands in for the token
            self.user_admitted = web.user_admitted(self.headers.get("Authorization"))
            if not self.user_admitted and not self.token_allowed():
                self.reply(
                    401,
                    b"unauthorized: give a user and password of the web configuration\n",
                    "text/plain; charset=UTF-8",
                    {"WWW-Authenticate": 'Basic realm="stagetrace"'},
                    close=True,
                )
                return False
        if self.slots is not None:
            if not self.slots.acquire(blocking=False):
                self.too_busy()
                return False
            self._holding = True
        return True

    def handle_one_request(self) -> None:
        try:
            super().handle_one_request()
        finally:
            if self._holding:
                self._holding = False
                self.slots.release()

    def token_allowed(self) -> bool:
        """Whether this listener admits its bearer token instead of a basic-auth user (``/metrics`` has no token)."""
        return False

    def admitted(self, token: str | None, header: str | None = None) -> bool:
        """Whether the request carries ``token`` (in ``header``, default its Authorization) or came from a user of
        the web configuration's ``basic_auth_users``."""
        return self.user_admitted or authorized(self.headers.get("Authorization") if header is None else header, token)

    def too_busy(self) -> None:
        """The answer when ``slots`` are all taken (the body is left unread): 503 with Retry-After."""
        self.reply(
            503,
            b"too many requests in flight: retry later\n",
            "text/plain; charset=UTF-8",
            {"Retry-After": "1"},
            close=True,
        )

    def log_message(self, format, *args):  # noqa: A002 - the stdlib's signature
        pass

    def reply(
        self, status: int, body: bytes, content_type: str, headers: dict[str, str] | None = None, close: bool = False
    ) -> None:
        """Send a complete response; ``close`` when the request body was not read, so the connection is not reused."""
        try:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            if close:
                self.send_header("Connection", "close")
                self.close_connection = True
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):  # the client is gone: nobody to answer
            self.close_connection = True
            return
        if close:
            self._linger()

    def _linger(self) -> None:
        """Half-close, then read what the client is still sending: closing a socket with unread input resets the
        connection, and the client would see the reset instead of the answer. Bounded in bytes and time."""
        try:
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_WR)
            self.connection.settimeout(_LINGER_S)
            deadline = time.monotonic() + _LINGER_S
            drained = 0
            while drained < _LINGER_BYTES and time.monotonic() < deadline:
                chunk = self.rfile.read1(65536)
                if not chunk:
                    break
                drained += len(chunk)
        except OSError:
            pass


class _Server(ThreadingHTTPServer):
    daemon_threads = True  # a stuck client must not keep the agent from exiting
    block_on_close = False
    # the listen backlog: socketserver's 5 overflows when a fleet's exporters connect at once, and a connection the
    # kernel could not queue may be reset instead of answered 503 (the kernel caps it at net.core.somaxconn)
    request_queue_size = 128
    web = None  # the web configuration (TLS, basic auth), or None

    def get_request(self):
        connection, address = super().get_request()
        if self.web is not None and self.web.tls is not None:
            connection = self.web.tls.wrap(connection)
        return connection, address

    def handle_error(self, request, client_address) -> None:
        import sys

        if isinstance(sys.exc_info()[1], (ssl.SSLError, OSError)):  # plain HTTP to TLS, a refused certificate
            return
        super().handle_error(request, client_address)


class _Server6(_Server):
    address_family = socket.AF_INET6


@dataclass
class Listener:
    """A running server; ``port`` is the bound one (useful with port 0)."""

    server: ThreadingHTTPServer
    thread: threading.Thread
    address: str
    port: int

    @property
    def url(self) -> str:
        host = f"[{self.address}]" if ":" in self.address else self.address
        scheme = self.server.web.scheme if self.server.web is not None else "http"
        return f"{scheme}://{host}:{self.port}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


def start(handler: type[Handler], listen: str, name: str, max_in_flight: int | None = None, web=None) -> Listener:
    """Serve ``handler`` on ``listen`` in a thread, at most ``max_in_flight`` requests at once (the others are
    answered ``too_busy``), with the TLS and basic auth of ``web`` (a ``web_config.WebConfig``); OSError when the
    address cannot be bound."""
    address, port = parse_listen(listen)
    if max_in_flight:
        handler = type(handler.__name__, (handler,), {"slots": threading.BoundedSemaphore(max_in_flight)})
    server = (_Server6 if ":" in address else _Server)((address, port), handler)
    server.web = web
    thread = threading.Thread(target=server.serve_forever, name=name, daemon=True)
    thread.start()
    return Listener(server, thread, address, server.server_address[1])


def is_loopback(address: str) -> bool:
    return address in ("localhost", "::1") or address.startswith("127.")


__all__ = [
    "Handler",
    "HttpError",
    "Listener",
    "TokenError",
    "read_body",
    "authorized",
    "form_fields",
    "is_loopback",
    "load_token",
    "parse_listen",
    "start",
]
