"""The single-node hub: the agent shares the embedded store it holds, read-only, over ClickHouse's HTTP interface.

chdb locks a store to one process. While ``stagetrace agent`` holds it, the agent serves a query endpoint
(``--query-listen``, loopback by default) speaking the part of ClickHouse's HTTP interface that
clickhouse-connect's HTTP client and Grafana's ClickHouse data source (protocol ``http``) use: ``GET /ping``;
the query in ``?query=``, the POST body, or both (joined by a newline, as ClickHouse does), or in a multipart
form; ``param_<name>`` values for ``{name:Type}`` placeholders; ``database``; ``default_format`` and any output
``FORMAT`` (clickhouse-connect reads ``Native``); errors with ``X-ClickHouse-Exception-Code``.

Every statement is checked before it runs (``stagetrace.query_guard``): the engine's own parser decides that it is
one read of the store's tables or of the few system tables clients ask for, and calls no function that reaches a
file, the network, the server's state or its configuration; the text the engine formatted from that tree is what
runs. Every query also runs in an engine session with ``readonly = 1``, which refuses writes and settings: settings
sent as URL parameters are ignored rather than refused (clickhouse-connect and Grafana send some with every query);
a ``SETTINGS`` clause in the SQL is refused by the engine. The session's database is always the store's.

**Limits.** The agent runs next to the GPUs it watches, so every query runs under ``QueryLimits``: a time
limit, a memory limit, a thread count and result caps, set on the session before ``readonly = 1`` (which no
client can undo), so a runaway query ends with ClickHouse's own error (``Code: 159 … TIMEOUT_EXCEEDED``,
``Code: 241 … MEMORY_LIMIT_EXCEEDED``). Queries run one at a time; beyond ``max_concurrent`` in flight
(running or waiting) a request gets 503 with ``Retry-After`` (``Code: 202 … TOO_MANY_SIMULTANEOUS_QUERIES``).
A query whose client disconnects is cancelled (checked every 0.1 s; ``KILL QUERY`` from a control session), and
so is every running query when the endpoint closes (the agent stopping).

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
import select
import socket
import threading
import time
import uuid
from dataclasses import dataclass, fields
from pathlib import Path
from urllib.parse import parse_qsl, urlsplit

from stagetrace import httpd, schema
from stagetrace.environment_variables import (
    STAGETRACE_QUERY_MAX_CONCURRENT,
    STAGETRACE_QUERY_MAX_MEMORY,
    STAGETRACE_QUERY_MAX_RESULT_BYTES,
    STAGETRACE_QUERY_MAX_RESULT_ROWS,
    STAGETRACE_QUERY_MAX_THREADS,
    STAGETRACE_QUERY_TIMEOUT,
)
from stagetrace.query_guard import Denied, QueryGuard
from stagetrace.through_agent import AGENT_FILE, READ_ONLY_MESSAGE, Refused, read_only_format

logger = logging.getLogger(__name__)

DEFAULT_LISTEN = "127.0.0.1:8123"
MAX_QUERY_BYTES = 4 * 1024 * 1024
WATCH_EVERY_S = 0.1  # how often a running query's client is checked: a query left behind ends this soon
_MARK = "/* stagetrace-query "  # prefixed to each query, so that the control session can name it in KILL QUERY


@dataclass(frozen=True)
class QueryLimits:
    """What one query through the endpoint may use, and how many may be in flight. Each field has an agent
    option and an environment variable (``OPTIONS``)."""

    timeout_s: float = 30.0  # max_execution_time
    max_memory_bytes: int = 1 << 30  # max_memory_usage
    max_threads: int = 2
    max_result_rows: int = 1_000_000
    max_result_bytes: int = 256 << 20
    max_concurrent: int = 16  # in flight: one runs, the others wait their turn

    # each field's agent option and environment variable
    OPTIONS = {
        "timeout_s": ("--query-timeout", STAGETRACE_QUERY_TIMEOUT),
        "max_memory_bytes": ("--query-max-memory", STAGETRACE_QUERY_MAX_MEMORY),
        "max_threads": ("--query-max-threads", STAGETRACE_QUERY_MAX_THREADS),
        "max_result_rows": ("--query-max-result-rows", STAGETRACE_QUERY_MAX_RESULT_ROWS),
        "max_result_bytes": ("--query-max-result-bytes", STAGETRACE_QUERY_MAX_RESULT_BYTES),
        "max_concurrent": ("--query-max-concurrent", STAGETRACE_QUERY_MAX_CONCURRENT),
    }

    def __post_init__(self):
        for field in fields(self):
            if not getattr(self, field.name) > 0:
                option, variable = self.OPTIONS[field.name]
                raise ValueError(f"{option} ({variable}) must be positive, not {getattr(self, field.name)!r}")

    def settings(self) -> dict[str, str]:
        """The engine settings the limits are, for every query of the session."""
        return {
            "max_execution_time": f"{self.timeout_s:g}",
            "max_memory_usage": str(self.max_memory_bytes),
            "max_threads": str(self.max_threads),
            "max_result_rows": str(self.max_result_rows),
            "max_result_bytes": str(self.max_result_bytes),
            "result_overflow_mode": "'throw'",
            "timeout_overflow_mode": "'throw'",
        }


# --- the endpoint, in the agent ---------------------------------------------------------------------------

# ClickHouse's own mapping of exception codes to HTTP statuses, for the codes a read can raise
_HTTP_STATUS = {
    **dict.fromkeys((6, 27, 36, 62, 456, 457), 400),  # cannot parse, bad arguments, syntax, query parameters
    **dict.fromkeys((164, 497, 516), 403),  # READONLY, ACCESS_DENIED, AUTHENTICATION_FAILED
    **dict.fromkeys((46, 47, 50, 60, 81, 115), 404),  # unknown function, identifier, type, table, database, setting
}
_ERROR_NAMES = {
    36: "BAD_ARGUMENTS",
    62: "SYNTAX_ERROR",
    164: "READONLY",
    202: "TOO_MANY_SIMULTANEOUS_QUERIES",
    497: "ACCESS_DENIED",
    516: "AUTHENTICATION_FAILED",
}
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
    """The read-only ClickHouse HTTP interface on ``listen`` to the store's ``database`` in the embedded engine at
    ``path`` (held by this process)."""

    def __init__(
        self,
        path: str,
        listen: str = DEFAULT_LISTEN,
        *,
        database: str,
        token: str | None = None,
        limits: QueryLimits | None = None,
        web=None,
    ):
        import chdb

        self.limits = limits or QueryLimits()
        # a session of its own on the engine this process has open: readonly here leaves the writers alone
        self._session = chdb.connect(os.path.realpath(path))
        for name, value in self.limits.settings().items():
            self._session.query(f"SET {name} = {value}", "TabSeparated")
        self._session.query("SET readonly = 1", "TabSeparated")  # from here on no query can change a setting
        self._session.query(f"USE {schema.identifier(database, 'database name')}", "TabSeparated")
        self.guard = QueryGuard(self._text, database)
        self._control = chdb.connect(os.path.realpath(path))  # cancels queries: KILL QUERY, never a client's SQL
        self._lock = threading.Lock()  # one query at a time on the session (its USE state is shared)
        self._slots = threading.BoundedSemaphore(self.limits.max_concurrent)
        self._closing = threading.Event()
        self.version, self.timezone = (
            self._session.query("SELECT version(), timezone()", "TabSeparated").bytes().decode().split()
        )
        self.token = token
        handler = type("QueryHandler", (_QueryHandler,), {"endpoint": self})
        try:
            self.listener = httpd.start(handler, listen, "stagetrace-query", web=web)
        except BaseException:
            self._session.close()
            self._control.close()
            raise

    @property
    def url(self) -> str:
        return self.listener.url

    def close(self) -> None:
        """Stop serving: running queries are cancelled first, so closing never waits for one."""
        self._closing.set()
        self._kill(_MARK)
        self.listener.close()
        with self._lock:
            self._session.close()
        self._control.close()

    def admit(self) -> bool:
        """Take a place among the queries in flight; False when all ``max_concurrent`` are taken."""
        return self._slots.acquire(blocking=False)

    def release(self) -> None:
        self._slots.release()

    def run(self, sql: str, fmt: str, params: dict[str, str], database: str, gone=lambda: False):
        """The engine's result object for ``sql`` once the guard admits it, and the format it is in (the
        statement's FORMAT, else ``fmt``); None when its client went away (``gone()``) or the endpoint closed
        before it ran. A running query whose client goes away is cancelled. Raises ``Denied`` for a statement the
        endpoint does not run."""
        mark = f"{_MARK}{uuid.uuid4().hex} */"
        while not self._lock.acquire(timeout=WATCH_EVERY_S):  # waiting its turn: no need to wait for a client gone
            if gone() or self._closing.is_set():
                return None
        try:
            if gone() or self._closing.is_set():
                return None
            checked = self.guard.check(sql, params, database)
            done = threading.Event()
            watcher = threading.Thread(
                target=self._watch, args=(mark, gone, done), name="stagetrace-query-watch", daemon=True
            )
            watcher.start()
            fmt = checked.format or fmt
            try:
                return self._session.query(f"{mark}\n{checked.sql}", fmt, params=params), fmt
            finally:
                done.set()
        finally:
            self._lock.release()

    def _text(self, sql: str, params: dict[str, str]) -> str:
        """The answer to one of the guard's own statements, as text (the lock is held)."""
        return self._session.query(sql, "TabSeparatedRaw", params=params).bytes().decode()

    def _watch(self, mark: str, gone, done: threading.Event) -> None:
        # until the query ends: a KILL sent before the engine has registered the query (a loaded host, a low-priority
        # agent) finds nothing, and one kill would leave the query running to its time limit
        while not done.wait(WATCH_EVERY_S):
            if gone() or self._closing.is_set():
                self._kill(mark)

    def _kill(self, mark: str) -> None:
        try:  # the KILL statement's own text starts with KILL: it never matches itself
            self._control.query(
                "KILL QUERY WHERE startsWith(query, {mark:String}) ASYNC", "TabSeparated", params={"mark": mark}
            )
        except Exception as exc:  # a query that just ended, a session closing: nothing left to cancel
            logger.debug("KILL QUERY: %s", exc)

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

    def token_allowed(self) -> bool:
        return self.endpoint.token is not None

    def _admitted(self, body_unread: bool = False) -> bool:
        """Whether the request is for a path served here and carries the token; answers it when not."""
        path = urlsplit(self.path).path
        if path in ("/ping", "/replicas_status"):  # health checks need no token, as on a ClickHouse server
            self.reply(200, b"Ok.\n", "text/plain; charset=UTF-8", close=body_unread)
        elif path != "/":
            self._fail(404, 36, f"no handler for {path}: query at / or check /ping", close=body_unread)
        elif not (
            self.admitted(self.endpoint.token)
            or self.admitted(self.endpoint.token, f"Bearer {self.headers.get('X-ClickHouse-Key', '')}")
        ):
            self._fail(
                403, 516, "missing or wrong token (send it as a bearer token or as the password)", close=body_unread
            )
        else:
            return True
        return False

    def _client_gone(self) -> bool:
        """Whether the client closed its connection: readable, yet nothing to read (or reset)."""
        try:
            # poll, not select: the agent holds hundreds of sysfs files, so a socket's descriptor may exceed 1,023
            poller = select.poll()
            poller.register(self.connection, select.POLLIN)
            return bool(poller.poll(0)) and self.connection.recv(1, socket.MSG_PEEK) == b""
        except OSError:
            return True

    def _fail(self, status: int, code: int, message: str, close: bool = False) -> None:
        self.reply(
            status,
            self.endpoint.error_body(code, message),
            "text/plain; charset=UTF-8",
            {"X-ClickHouse-Exception-Code": str(code)},
            close=close,
        )

    def _answer(self, body: bytes) -> None:
        url = urlsplit(self.path)
        params = dict(parse_qsl(url.query, keep_blank_values=True))
        try:
            if (self.headers.get_content_type() or "") == "multipart/form-data":
                params.update(httpd.form_fields(self.headers["Content-Type"], body))
                body = b""
        except ValueError as exc:
            self._fail(400, 36, f"cannot read the form: {exc}")
            return
        text = body.decode(errors="replace")  # an insert's binary data must still be refused as a write
        sql = "\n".join(part for part in (params.get("query", ""), text) if part)
        if not sql.strip():
            self.reply(200, b"Ok.\n", "text/plain; charset=UTF-8")  # what ClickHouse answers to a bare GET /
            return
        if text.encode() != body:
            self._fail(400, 36, "the query is not valid UTF-8")
            return
        query_params = {name[6:]: value for name, value in params.items() if name.startswith("param_")}
        if not self.endpoint.admit():
            limit = self.endpoint.limits.max_concurrent
            self.reply(
                503,
                self.endpoint.error_body(202, f"Too many simultaneous queries. Maximum: {limit}"),
                "text/plain; charset=UTF-8",
                {"X-ClickHouse-Exception-Code": "202", "Retry-After": "1"},
            )
            return
        started = time.monotonic_ns()
        try:
            answer = self.endpoint.run(
                sql,
                params.get("default_format") or "TabSeparated",
                query_params,
                params.get("database", ""),
                self._client_gone,
            )
        except Denied as exc:
            self._fail(403, exc.code, str(exc))
            return
        except Exception as exc:  # the engine's exception carries ClickHouse's code and message
            text = str(exc).strip() or type(exc).__name__
            match = _CODE.search(text)
            code = int(match[1]) if match else 0
            self.reply(
                _HTTP_STATUS.get(code, 500),
                text.encode() + b"\n",
                "text/plain; charset=UTF-8",
                {"X-ClickHouse-Exception-Code": str(code)},
            )
            return
        finally:
            self.endpoint.release()
        if answer is None:  # its client went away, or the agent is stopping: nobody to answer
            self.close_connection = True
            return
        result, fmt = answer
        data = result.bytes()
        summary = {
            "read_rows": str(result.rows_read()),
            "read_bytes": str(result.bytes_read()),
            "written_rows": "0",
            "written_bytes": "0",
            "result_bytes": str(len(data)),
            "elapsed_ns": str(time.monotonic_ns() - started),
        }
        self.reply(
            200,
            data,
            _content_type(fmt),
            {
                "X-ClickHouse-Format": fmt,
                "X-ClickHouse-Timezone": self.endpoint.timezone,
                "X-ClickHouse-Query-Id": params.get("query_id") or str(uuid.uuid4()),
                "X-ClickHouse-Summary": json.dumps(summary, separators=(",", ":")),
            },
        )


# --- discovery: agent.json in the store, read by open_store in other processes ----------------------------


def advertise(store_path: str, **endpoints) -> Path:
    """Record this process's endpoints in ``<store>/agent.json``, atomically."""
    path = Path(store_path) / AGENT_FILE
    partial = path.with_name(f".{AGENT_FILE}.{os.getpid()}")
    with os.fdopen(os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as out:  # the owner's alone
        out.write(json.dumps({"pid": os.getpid(), **endpoints}, indent=2) + "\n")
    partial.replace(path)
    return path


def withdraw(path: Path) -> None:
    """Remove the record, unless another agent has replaced it since."""
    try:
        if json.loads(path.read_text()).get("pid") == os.getpid():
            path.unlink()
    except (OSError, ValueError):
        pass


__all__ = ["DEFAULT_LISTEN", "QueryEndpoint", "QueryLimits", "advertise", "withdraw"]
