"""ClickHouse's HTTP interface in front of the embedded engine, for measuring an agent that writes to a server store.

No ClickHouse server runs on these machines; the agent's footprint with a server store is about the agent's
process (which then loads clickhouse-connect's HTTP client and never the engine), not about the server. This
answers what clickhouse-connect sends over HTTP (queries with bound ``param_*`` values and settings in the URL,
inserts as a ``Native`` body) with the engine in this process, so a real agent can write to it:
``python -m benchmarks.clickhouse_http PATH PORT`` serves the store at ``PATH`` on ``127.0.0.1:PORT``.
"""

from __future__ import annotations

import io
import os
import re
import sys
import tempfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qsl, urlsplit

import chdb
import lz4.frame
import zstandard

from stagetrace.httpd import form_fields

_FORMAT = re.compile(r"\bFORMAT\s+(\w+)\s*;?\s*$", re.I)
_INSERT = re.compile(r"^\s*INSERT\s+INTO\s+(.+?)\s+FORMAT\s+Native\s*$", re.I | re.S)
# what clickhouse-connect may put in the URL that is no engine setting
_NOT_SETTINGS = {
    "query",
    "database",
    "session_id",
    "session_timeout",
    "compress",
    "decompress",
    "client_protocol_version",
    "default_format",
    "query_id",
    "wait_end_of_query",
    "send_progress_in_http_headers",
    "quota_key",
}


def decompressed(body: bytes, encoding: str) -> bytes:
    """An HTTP body as the client sent it: clickhouse-connect compresses an insert larger than one of its blocks as
    one frame a block, so every frame is read, not the first alone."""
    if encoding == "zstd":
        return zstandard.ZstdDecompressor().stream_reader(io.BytesIO(body), read_across_frames=True).read()
    if encoding != "lz4":
        return body
    out = bytearray()
    while body:
        frame = lz4.frame.LZ4FrameDecompressor()
        out += frame.decompress(body)
        body = frame.unused_data
    return bytes(out)


def serve(path: str, port: int) -> ThreadingHTTPServer:
    connection = chdb.connect(path)
    lock = threading.Lock()  # one query at a time, as the engine's connection wants

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):  # quiet
            pass

        def do_GET(self):
            self._answer(b"")

        def do_POST(self):
            if self.headers.get("Transfer-Encoding", "").lower() == "chunked":  # how the client streams an insert
                body = bytearray()
                while size := int(self.rfile.readline().split(b";")[0], 16):
                    body += self.rfile.read(size)
                    self.rfile.readline()
                self.rfile.readline()
            else:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            self._answer(decompressed(bytes(body), self.headers.get("Content-Encoding", "")))

        def _answer(self, body: bytes) -> None:
            url = urlsplit(self.path)
            params = dict(parse_qsl(url.query, keep_blank_values=True))
            if (self.headers.get_content_type() or "") == "multipart/form-data":  # long parameters come this way
                params.update(form_fields(self.headers["Content-Type"], body))
                body = b""
            if url.path == "/ping":
                return self._reply(200, b"Ok.\n")
            query = params.get("query", "")
            if not query:  # the statement is the body's first line; an insert's data follows it
                head, _, rest = body.partition(b"\n")
                if _INSERT.match(head.decode("utf-8", "replace")):
                    query, body = head.decode(), rest
                else:
                    query, body = body.decode("utf-8", "replace"), b""
            bound = {k[6:]: v for k, v in params.items() if k.startswith("param_")}
            # settings matter to inserts (the deduplication token); the client's defaults for reads are left out
            settings = {k: v for k, v in params.items() if k not in _NOT_SETTINGS and not k.startswith("param_")}
            suffix = f" SETTINGS {', '.join(f'{k} = {v!r}' for k, v in settings.items())}" if settings else ""
            database = params.get("database")
            try:
                with lock:
                    if database:
                        connection.query(f"USE `{database}`")
                    insert = _INSERT.match(query)
                    if insert:
                        with tempfile.NamedTemporaryFile(suffix=".native", delete=False) as data:
                            data.write(body)
                        try:
                            connection.query(f"INSERT INTO {insert[1]} FROM INFILE '{data.name}'{suffix} FORMAT Native")
                        finally:
                            os.unlink(data.name)
                        return self._reply(200, b"")
                    found = _FORMAT.search(query)
                    fmt = found[1] if found else "TabSeparated"
                    sql = query[: found.start()] if found else query
                    result = connection.query(sql.rstrip().rstrip(";"), fmt, params=bound or None)
                    return self._reply(200, result.bytes() or b"")
            except Exception as exc:  # the engine's message, as ClickHouse's HTTP interface answers it
                code = re.search(r"Code: (\d+)", str(exc))
                self._reply(500, f"{exc}\n".encode(), {"X-ClickHouse-Exception-Code": code[1] if code else "1"})

        def _reply(self, status: int, payload: bytes, headers: dict | None = None) -> None:
            self.send_response(status)
            self.send_header("Content-Length", str(len(payload)))
            self.send_header("X-ClickHouse-Server-Display-Name", "stagetrace-benchmark")
            self.send_header("X-ClickHouse-Timezone", "UTC")
            for key, value in (headers or {}).items():
                self.send_header(key, value)
            self.end_headers()
            self.wfile.write(payload)

    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    server.daemon_threads = True
    return server


if __name__ == "__main__":
    serve(sys.argv[1], int(sys.argv[2])).serve_forever()
