"""The client half of the single-node hub: reading a store the agent holds, through its query endpoint.

chdb locks an embedded store to one process. ``stagetrace agent`` shares the store it holds over a read-only
query endpoint (``stagetrace.hub``, the server half) and records it in ``<store>/agent.json``; ``open_store``
asks this module for a client to it when the store is locked. Writes are refused here before they are sent,
with a message that says where spans can go instead, and again by the endpoint. This module sits below
``stagetrace.store`` (it imports only ``errors`` and ``httpd``), so neither half imports the other's caller.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from urllib.parse import urlsplit

from stagetrace import config, httpd
from stagetrace.errors import StoreError, StoreLockedError

AGENT_FILE = "agent.json"
DEFAULT_QUERY_LISTEN = config.DEFAULT_QUERY_LISTEN

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
        token = httpd.load_token()
    except httpd.TokenError as exc:
        raise StoreError(f"{holder}: {exc}") from None
    if record.get("token") and token is None:
        raise StoreError(f"{holder}, whose query endpoint needs a token: set {httpd.ENV_TOKEN} or {httpd.ENV_TOKEN_FILE}")
    import clickhouse_connect

    try:
        connection = clickhouse_connect.get_client(host=host, port=port, access_token=token, database=location.database,
                                               connect_timeout=5, compress=False, autogenerate_session_id=False)  # fmt: skip
    except Exception as exc:
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise StoreError(f"{holder}, but its query endpoint {url.geturl()} does not answer: {reason}") from None
    sinks = ([f"{record['otlp']}/v1/traces"] if record.get("otlp") else []) + (
        [f"{record['otlp_grpc']} (gRPC)"] if record.get("otlp_grpc") else [])  # fmt: skip
    otlp = f", or send spans over OTLP to {' or '.join(sinks)}" if sinks else ""
    refusal = f"{holder}, which shares it read-only: stop the agent to write to it{otlp}"
    return ReadOnlyClient(connection, refusal)


class ReadOnlyClient:
    """clickhouse-connect's client to the agent; writes fail here, before they are sent, with ``refusal``."""

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




__all__ = ["AGENT_FILE", "DEFAULT_QUERY_LISTEN", "READ_ONLY_MESSAGE", "advertised", "ReadOnlyClient", "Refused", "client", "read_only_format"]
