"""The single-node hub: the agent shares the embedded store it holds, read-only, over ClickHouse's HTTP interface.

chdb locks a store to one process. While ``stagetrace agent`` holds it, the agent serves a query endpoint
(``--query-listen``, loopback by default) speaking the part of ClickHouse's HTTP interface that
clickhouse-connect's HTTP client and Grafana's ClickHouse data source (protocol ``http``) use: ``GET /ping``;
the query in ``?query=``, the POST body, or both (joined by a newline, as ClickHouse does), or in a multipart
form; ``param_<name>`` values for ``{name:Type}`` placeholders; ``database``; ``default_format`` and any output
``FORMAT`` (clickhouse-connect reads ``Native``); errors with ``X-ClickHouse-Exception-Code``.

Writes are refused twice: a conservative check admits one SELECT, WITH, SHOW, DESCRIBE or EXISTS statement
per request and no ``INTO OUTFILE`` (which a readonly engine would still write), and every query runs in an
engine session with ``readonly = 1``. That session cannot change settings, so settings sent as URL parameters
are ignored rather than refused (clickhouse-connect and Grafana send some with every query); a ``SETTINGS``
clause in the SQL is refused by the engine.

The agent records the endpoint in ``<store>/agent.json`` (removed when it stops). ``open_store`` reads it when
the store is locked and returns a read-only Store through clickhouse-connect's HTTP client
(``stagetrace.through_agent``, the client half, below ``store``; this module is the server half), so every
command that reads the store works while the agent runs.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
import uuid
from email.parser import BytesParser
from email.policy import HTTP
from pathlib import Path
from urllib.parse import parse_qsl, urlsplit

from stagetrace import httpd, schema
from stagetrace.through_agent import AGENT_FILE, READ_ONLY_MESSAGE, Refused, read_only_format

logger = logging.getLogger(__name__)

DEFAULT_LISTEN = "127.0.0.1:8123"
MAX_QUERY_BYTES = 4 * 1024 * 1024

# --- the endpoint, in the agent ---------------------------------------------------------------------------

# ClickHouse's own mapping of exception codes to HTTP statuses, for the codes a read can raise
_HTTP_STATUS = {
    **dict.fromkeys((6, 27, 36, 62, 456, 457), 400),  # cannot parse, bad arguments, syntax, query parameters
    **dict.fromkeys((164, 497, 516), 403),  # READONLY, ACCESS_DENIED, AUTHENTICATION_FAILED
    **dict.fromkeys((46, 47, 50, 60, 81, 115), 404),  # unknown function, identifier, type, table, database, setting
}
_ERROR_NAMES = {36: "BAD_ARGUMENTS", 62: "SYNTAX_ERROR", 164: "READONLY", 516: "AUTHENTICATION_FAILED"}
_CODE = re.compile(r"Code: (\d+)\.")


def _content_type(fmt: str) -> str:
    lowered = fmt.lower()
    if lowered.startswith(("tabseparated", "tsv")):
        return "text/tab-separated-values; charset=UTF-8"
    if lowered.startswith("csv"):
        return "text/csv; charset=UTF-8"
    if lowered.startswith("json"):
        return "application/json; charset=UTF-8"
    return "application/octet-stream"


class QueryEndpoint:
    """The read-only ClickHouse HTTP interface on ``listen`` to the embedded engine at ``path`` (held by this process)."""

    def __init__(self, path: str, listen: str = DEFAULT_LISTEN, *, token: str | None = None):
        import chdb

        # a session of its own on the engine this process has open: readonly here leaves the writers alone
        self._session = chdb.connect(os.path.realpath(path))
        self._session.query("SET readonly = 1", "TabSeparated")
        self._lock = threading.Lock()  # one query at a time on the session (its USE state is shared)
        self._database = ""
        self.version, self.timezone = self._session.query("SELECT version(), timezone()", "TabSeparated") \
            .bytes().decode().split()  # fmt: skip
        self.token = token
        handler = type("QueryHandler", (_QueryHandler,), {"endpoint": self})
        try:
            self.listener = httpd.start(handler, listen, "stagetrace-query")
        except BaseException:
            self._session.close()
            raise

    @property
    def url(self) -> str:
        return self.listener.url

    def close(self) -> None:
        self.listener.close()
        with self._lock:
            self._session.close()

    def run(self, sql: str, fmt: str, params: dict[str, str], database: str):
        """The engine's result object for a checked read query, in ``database`` (ClickHouse's ``default`` if none)."""
        database = database or "default"
        with self._lock:
            if database != self._database:
                self._session.query(f"USE {schema.identifier(database, 'database name')}", "TabSeparated")
                self._database = database
            return self._session.query(sql, fmt, params=params)

    def error_body(self, code: int, message: str) -> bytes:
        return f"Code: {code}. DB::Exception: {message}. ({_ERROR_NAMES.get(code, 'UNKNOWN')}) (version {self.version})\n".encode()


class _QueryHandler(httpd.Handler):
    endpoint: QueryEndpoint

    def do_GET(self):  # noqa: N802 - the stdlib's names
        if self._admitted():
            self._answer(b"")

    do_HEAD = do_GET

    def do_POST(self):  # noqa: N802
        if not self._admitted(body_unread=True):
            return
        statement = dict(parse_qsl(urlsplit(self.path).query)).get("query", "")
        encoding = (self.headers.get("Content-Encoding") or "identity").strip().lower()
        try:  # an insert may name itself here and stream its data in the body: refuse it without reading that
            if statement.strip():
                read_only_format(statement)
            if encoding not in ("identity", "gzip", "deflate"):  # clickhouse-connect compresses only inserts so
                raise Refused(f"{READ_ONLY_MESSAGE} (a body in {encoding} is taken for an insert's data)")
        except Refused as exc:
            self._fail(403, 164, str(exc), close=True)
            return
        try:
            body = httpd.read_body(self.headers, self.rfile, MAX_QUERY_BYTES)
        except httpd.HttpError as exc:
            self._fail(exc.status, 36, exc.message, close=not exc.body_read)
            return
        self._answer(body)

    def _admitted(self, body_unread: bool = False) -> bool:
        """Whether the request is for a path served here and carries the token; answers it when not."""
        path = urlsplit(self.path).path
        if path in ("/ping", "/replicas_status"):  # health checks need no token, as on a ClickHouse server
            self.reply(200, b"Ok.\n", "text/plain; charset=UTF-8", close=body_unread)
        elif path != "/":
            self._fail(404, 36, f"no handler for {path}: query at / or check /ping", close=body_unread)
        elif not (httpd.authorized(self.headers.get("Authorization"), self.endpoint.token)
                  or httpd.authorized(f"Bearer {self.headers.get('X-ClickHouse-Key', '')}", self.endpoint.token)):
            self._fail(403, 516, "missing or wrong token (send it as a bearer token or as the password)", close=body_unread)
        else:
            return True
        return False

    def _fail(self, status: int, code: int, message: str, close: bool = False) -> None:
        self.reply(status, self.endpoint.error_body(code, message), "text/plain; charset=UTF-8",
                   {"X-ClickHouse-Exception-Code": str(code)}, close=close)  # fmt: skip

    def _answer(self, body: bytes) -> None:
        url = urlsplit(self.path)
        params = dict(parse_qsl(url.query, keep_blank_values=True))
        try:
            if (self.headers.get_content_type() or "") == "multipart/form-data":
                params.update(_form_fields(self.headers["Content-Type"], body))
                body = b""
        except ValueError as exc:
            self._fail(400, 36, f"cannot read the form: {exc}")
            return
        text = body.decode(errors="replace")  # an insert's binary data must still be refused as a write
        sql = "\n".join(part for part in (params.get("query", ""), text) if part)
        if not sql.strip():
            self.reply(200, b"Ok.\n", "text/plain; charset=UTF-8")  # what ClickHouse answers to a bare GET /
            return
        try:
            fmt = read_only_format(sql) or params.get("default_format") or "TabSeparated"
        except Refused as exc:
            self._fail(403, 164, str(exc))
            return
        if text.encode() != body:
            self._fail(400, 36, "the query is not valid UTF-8")
            return
        query_params = {name[6:]: value for name, value in params.items() if name.startswith("param_")}
        started = time.monotonic_ns()
        try:
            result = self.endpoint.run(sql, fmt, query_params, params.get("database", ""))
        except schema.SchemaError as exc:
            self._fail(400, 36, str(exc))
            return
        except Exception as exc:  # the engine's exception carries ClickHouse's code and message
            text = str(exc).strip() or type(exc).__name__
            match = _CODE.search(text)
            code = int(match[1]) if match else 0
            self.reply(_HTTP_STATUS.get(code, 500), text.encode() + b"\n", "text/plain; charset=UTF-8",
                       {"X-ClickHouse-Exception-Code": str(code)})  # fmt: skip
            return
        data = result.bytes()
        summary = {"read_rows": str(result.rows_read()), "read_bytes": str(result.bytes_read()),
                   "written_rows": "0", "written_bytes": "0", "result_bytes": str(len(data)),
                   "elapsed_ns": str(time.monotonic_ns() - started)}  # fmt: skip
        self.reply(200, data, _content_type(fmt), {
            "X-ClickHouse-Format": fmt,
            "X-ClickHouse-Timezone": self.endpoint.timezone,
            "X-ClickHouse-Query-Id": params.get("query_id") or str(uuid.uuid4()),
            "X-ClickHouse-Summary": json.dumps(summary, separators=(",", ":")),
        })  # fmt: skip


def _form_fields(content_type: str, body: bytes) -> dict[str, str]:
    """The text fields of a multipart form (clickhouse-connect sends long parameters this way)."""
    message = BytesParser(policy=HTTP).parsebytes(b"Content-Type: " + content_type.encode() + b"\r\n\r\n" + body)
    fields = {}
    for part in message.iter_parts():
        if part.get_filename():
            raise ValueError("external data (file parts) is not supported")
        fields[part.get_param("name", header="content-disposition")] = part.get_content()
    return fields


# --- discovery: agent.json in the store, read by open_store in other processes ----------------------------


def advertise(store_path: str, **endpoints) -> Path:
    """Record this process's endpoints in ``<store>/agent.json``, atomically."""
    path = Path(store_path) / AGENT_FILE
    partial = path.with_name(f".{AGENT_FILE}.{os.getpid()}")
    partial.write_text(json.dumps({"pid": os.getpid(), **endpoints}, indent=2) + "\n")
    partial.replace(path)
    return path


def withdraw(path: Path) -> None:
    """Remove the record, unless another agent has replaced it since."""
    try:
        if json.loads(path.read_text()).get("pid") == os.getpid():
            path.unlink()
    except (OSError, ValueError):
        pass


__all__ = ["DEFAULT_LISTEN", "QueryEndpoint", "advertise", "withdraw"]
