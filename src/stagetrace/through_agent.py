"""The client half of the single-node hub: reading a store the agent holds, through its query endpoint.

chdb locks an embedded store to one process. ``stagetrace agent`` shares the store it holds over a read-only
query endpoint (``stagetrace.hub``, the server half) and records it in ``<store>/agent.json``; ``open_store``
asks this module for a client to it when the store is locked. Writes are refused here before they are sent,
with a message that says where spans can go instead, and again by the endpoint. This module sits below
``stagetrace.store`` (it imports only ``errors`` and ``config``), so neither half imports the other's caller.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from urllib.parse import urlsplit

from stagetrace import config
from stagetrace.errors import StoreError, StoreLockedError, first_line

AGENT_FILE = "agent.json"

READ_STATEMENTS = frozenset({"SELECT", "WITH", "SHOW", "DESC", "DESCRIBE", "EXISTS"})
READ_ONLY_MESSAGE = (
    "the stagetrace agent's query endpoint is read-only: it runs one SELECT, WITH, SHOW, DESCRIBE or EXISTS "
    "statement per request, without INTO OUTFILE"
)

# Strings, quoted identifiers and comments first, so a keyword or ';' inside them is not taken for code. Anything
# unterminated falls through to single characters and is read as code: the check errs on the side of refusing.
_TOKENS = re.compile(
    r"""(?P<skip>\s+|--[^\n]*|/\*.*?\*/)
      | (?P<string>'(?:[^'\\]|\\.|'')*'|"(?:[^"\\]|\\.|"")*"|`(?:[^`\\]|\\.|``)*`)
      | (?P<word>[A-Za-z_][A-Za-z0-9_$]*)
      | (?P<other>.)""",
    re.S | re.X,
)


class Refused(Exception):
    """A query the endpoint does not run; the message says why."""


def read_only_format(sql: str) -> str | None:
    """Check that ``sql`` is one read statement; return its trailing ``FORMAT`` name, if any. Refused otherwise."""
    tokens = [(m.lastgroup, m.group()) for m in _TOKENS.finditer(sql) if m.lastgroup != "skip"]
    while tokens and tokens[-1][1] == ";":
        tokens.pop()
    words = [text.upper() for kind, text in tokens if kind == "word"]
    first = next((text for kind, text in tokens if text != "("), "")
    if not tokens:
        raise Refused("empty query")
    if first.upper() not in READ_STATEMENTS or any(text == ";" for _, text in tokens):
        raise Refused(READ_ONLY_MESSAGE)
    if "OUTFILE" in words or "INFILE" in words:
        raise Refused(READ_ONLY_MESSAGE)
    if len(tokens) >= 2 and tokens[-2][1].upper() == "FORMAT" and tokens[-1][0] == "word":
        return tokens[-1][1]
    return None


# --- the client, in other processes ------------------------------------------------------------------------


def advertised(location) -> dict | None:
    """What the agent serving the embedded store at ``location`` records of itself (``pid``, ``query`` URL,
    ``token``: whether one is needed, ``otlp``...), or None when no agent recorded itself there."""
    try:
        record = json.loads((Path(location.path) / AGENT_FILE).read_text())
        urlsplit(record["query"]).port  # noqa: B018 - a record without a usable URL is no record
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return record if isinstance(record, dict) else None


def client(location, locked: StoreLockedError) -> ReadOnlyClient:
    """A read-only client to the query endpoint of the agent holding ``location``; raises ``locked`` when none does."""
    record = advertised(location)
    if record is None:
        raise locked
    url = urlsplit(record["query"])
    host, port = url.hostname, url.port
    if locked.pid is not None and record.get("pid") != locked.pid:
        raise locked from None  # a record left behind by an agent that is gone; the holder is another process
    holder = f"store {location.redacted()} is held by the stagetrace agent (pid {record.get('pid')})"
    try:
        token = config.load_token()
    except config.TokenError as exc:
        raise StoreError(f"{holder}: {exc}") from None
    if record.get("token") and token is None:
        raise StoreError(
            f"{holder}, whose query endpoint needs a token: set {config.ENV_TOKEN} or {config.ENV_TOKEN_FILE}"
        )
    connection = AgentClient(host, port, token, location.database, scheme=url.scheme)
    try:
        connection.command("SELECT 1")
    except Exception as exc:
        reason = first_line(exc)
        raise StoreError(f"{holder}, but its query endpoint {url.geturl()} does not answer: {reason}") from None
    sinks = ([f"{record['otlp']}/v1/traces"] if record.get("otlp") else []) + (
        [f"{record['otlp_grpc']} (gRPC)"] if record.get("otlp_grpc") else []
    )
    otlp = f", or send spans over OTLP to {' or '.join(sinks)}" if sinks else ""
    refusal = f"{holder}, which shares it read-only: stop the agent to write to it{otlp}"
    return ReadOnlyClient(connection, refusal)


class QueryResult:
    """What the commands read of a query's answer, as clickhouse-connect's ``QueryResult`` has it."""

    def __init__(self, column_names: tuple[str, ...], result_rows: list[tuple]):
        self.column_names = column_names
        self.result_rows = result_rows


class AgentClient:
    """The agent's query endpoint through the standard library's HTTP client: reads only, bound parameters, the
    answer as JSON converted by column type. The commands that read (``trace``, ``explain``, ``divergences``)
    need no more, and loading no driver keeps them quick to start (clickhouse-connect takes 0.2 s to import)."""

    def __init__(
        self, host: str, port: int, token: str | None, database: str, timeout_s: float = 60.0, scheme: str = "http"
    ):
        import http.client

        if scheme == "https":  # verified against $STAGETRACE_CA_FILE (else the system's CAs)
            from stagetrace.web_config import client_context

            self._connection = http.client.HTTPSConnection(host, port, timeout=timeout_s, context=client_context())
        else:
            self._connection = http.client.HTTPConnection(host, port, timeout=timeout_s)
        self._headers = {
            "Content-Type": "text/plain; charset=utf-8",
            "Connection": "keep-alive",
            **({"Authorization": f"Bearer {token}"} if token else {}),
        }
        self.database = database

    def query(self, sql: str, parameters: dict | None = None, settings: dict | None = None) -> QueryResult:
        import http.client
        from urllib.parse import urlencode

        params = {"database": self.database, **{f"param_{k}": _param_text(v) for k, v in (parameters or {}).items()}}
        body = f"{sql.rstrip().rstrip(';')}\nFORMAT JSONCompact".encode()
        path = f"/?{urlencode(params)}"
        try:
            status, answer = self._post(path, body)
        except TimeoutError:
            raise  # a slow query: sent again, it would take as long once more
        except (ConnectionError, OSError, http.client.HTTPException):
            self._connection.close()  # a kept-alive connection the endpoint closed meanwhile: opened again, once
            status, answer = self._post(path, body)
        if status != 200:
            raise StoreError(
                f"the agent's query endpoint answered {status}: "
                f"{answer.decode(errors='replace').strip().splitlines()[0] if answer.strip() else ''}"
            )
        try:
            result = json.loads(answer)
        except ValueError:
            raise StoreError(
                f"the agent's query endpoint answered with {len(answer)} bytes that are not JSON"
            ) from None
        types = [_converter(column["type"]) for column in result["meta"]]
        rows = [tuple(convert(value) for convert, value in zip(types, row)) for row in result["data"]]
        return QueryResult(tuple(column["name"] for column in result["meta"]), rows)

    def _post(self, path: str, body: bytes) -> tuple[int, bytes]:
        self._connection.request("POST", path, body, self._headers)
        response = self._connection.getresponse()
        return response.status, response.read()

    def command(self, sql: str, parameters: dict | None = None, settings: dict | None = None):
        """One value for one cell, the first row's values for several, as clickhouse-connect's ``command``."""
        rows = self.query(sql, parameters, settings).result_rows
        if not rows:
            return ""
        return rows[0][0] if len(rows[0]) == 1 else list(rows[0])

    def close(self) -> None:
        self._connection.close()


def _param_text(value) -> str:
    """A bound parameter's value as the HTTP interface parses it (TSV escaping; arrays as literals)."""
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_literal(v) for v in value) + "]"
    if isinstance(value, bool):
        return "1" if value else "0"
    text = str(value)
    return text.replace("\\", "\\\\").replace("\t", "\\t").replace("\n", "\\n")


def _literal(value) -> str:
    if isinstance(value, str):
        return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"
    return str(value)


def _converter(type_name: str):
    """JSON value -> Python value for a ClickHouse type, as clickhouse-connect returns it (64-bit integers come
    quoted; DateTime as naive UTC)."""
    inner = type_name
    for wrapper in ("LowCardinality(", "Nullable("):
        if inner.startswith(wrapper):
            inner = inner[len(wrapper) : -1]
    if inner.startswith("Array("):
        element = _converter(inner[6:-1])
        return lambda v: None if v is None else [element(x) for x in v]
    if inner.startswith("Map("):
        value_type = _converter(_split_top(inner[4:-1])[1])
        return lambda v: None if v is None else {k: value_type(x) for k, x in v.items()}
    if inner.startswith("Tuple("):
        parts = _split_top(inner[6:-1])
        if all(re.match(r"[A-Za-z_]\w* [A-Z]", part) for part in parts):  # named: a dict, as clickhouse-connect has it
            named = [(name, _converter(kind)) for name, kind in (part.split(" ", 1) for part in parts)]
            return lambda v: None if v is None else {name: c(v[name]) for name, c in named}
        elements = [_converter(part) for part in parts]
        return lambda v: None if v is None else tuple(c(x) for c, x in zip(elements, v))
    if inner.startswith(("Int", "UInt")):
        return lambda v: None if v is None else int(v)
    if inner.startswith(("Float", "Decimal")):
        return lambda v: None if v is None else float(v)
    if inner == "Bool":
        return lambda v: None if v is None else bool(v)
    if inner.startswith(("DateTime", "Date")):
        from datetime import datetime

        return lambda v: None if v is None else datetime.fromisoformat(v[:26] if "." in v else v)
    return lambda v: v


def _split_top(text: str) -> list[str]:
    """``String, Array(String)`` -> its two top-level parts."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(text):
        depth += char == "("
        depth -= char == ")"
        if char == "," and depth == 0:
            parts.append(text[start:i].strip())
            start = i + 1
    parts.append(text[start:].strip())
    return parts


class ReadOnlyClient:
    """A client to the agent; writes fail here, before they are sent, with ``refusal``."""

    def __init__(self, client, refusal: str):
        self._client = client
        self.refusal = refusal

    def __getattr__(self, name: str):
        if name.startswith(("insert", "raw_insert")):
            return self._refuse
        return getattr(self._client, name)

    def command(self, cmd: str, *args, **kwargs):
        try:
            read_only_format(cmd)
        except Refused:
            raise StoreError(self.refusal) from None
        return self._client.command(cmd, *args, **kwargs)

    def _refuse(self, *args, **kwargs):
        raise StoreError(self.refusal)


__all__ = [
    "AGENT_FILE",
    "READ_ONLY_MESSAGE",
    "AgentClient",
    "QueryResult",
    "advertised",
    "ReadOnlyClient",
    "Refused",
    "client",
    "read_only_format",
]
