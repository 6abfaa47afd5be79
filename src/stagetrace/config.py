"""Settings that come from the environment: the store, the span API's, the peer key and the agent's token.

The variables' names, defaults and grammar are registered in ``stagetrace.environment_variables``; this module reads
them.
"""

from __future__ import annotations

import os
from pathlib import Path

from stagetrace.environment_variables import (
    STAGETRACE_AGENT_TOKEN,
    STAGETRACE_AGENT_TOKEN_FILE,
    STAGETRACE_PEER_KEY,
    STAGETRACE_RECORD_CONTENT,
    STAGETRACE_SERVICE_NAME,
    STAGETRACE_STORE,
    STAGETRACE_STORE_PASSWORD,
    STAGETRACE_STORE_PASSWORD_FILE,
)

# the names the command line, the agent's clients and tests still import from here
ENV_STORE, ENV_STORE_PASSWORD = STAGETRACE_STORE, STAGETRACE_STORE_PASSWORD
ENV_STORE_PASSWORD_FILE, ENV_PEER_KEY = STAGETRACE_STORE_PASSWORD_FILE, STAGETRACE_PEER_KEY
ENV_TOKEN, ENV_TOKEN_FILE = STAGETRACE_AGENT_TOKEN, STAGETRACE_AGENT_TOKEN_FILE

DEFAULT_DATABASE = "stagetrace"
DEFAULT_QUERY_LISTEN = "127.0.0.1:8123"  # the agent's --query-listen: ClickHouse's own HTTP port, for Grafana
DEFAULT_SERVICE_NAME = "inference"


def default_store_path() -> Path:
    data_home = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return Path(data_home) / "stagetrace" / "store"


def store_dsn() -> str:
    return os.environ.get(STAGETRACE_STORE) or f"chdb://{default_store_path()}"


def store_password() -> str:
    """The server password from the environment or a file, so it never appears in ``ps`` output."""
    path = os.environ.get(STAGETRACE_STORE_PASSWORD_FILE)
    if path:
        return Path(path).read_text().strip()
    return os.environ.get(STAGETRACE_STORE_PASSWORD, "")


def service_name() -> str:
    return os.environ.get(STAGETRACE_SERVICE_NAME) or os.environ.get("OTEL_SERVICE_NAME") or DEFAULT_SERVICE_NAME


def peer_key(text: str | None = None) -> tuple[str, ...]:
    """The peer key from ``text``, else ``$STAGETRACE_PEER_KEY``, else ``conventions.DEFAULT_PEER_KEY``; ValueError
    names a part that is not one of ``conventions.PEER_KEY_PARTS``."""
    from stagetrace import conventions

    text = os.environ.get(STAGETRACE_PEER_KEY, "") if text is None else text
    if not text.strip():
        return conventions.DEFAULT_PEER_KEY
    parts = tuple(p.strip() for p in text.split(",") if p.strip() and p.strip() != "none")
    unknown = [p for p in parts if p not in conventions.PEER_KEY_PARTS]
    if unknown:
        raise ValueError(
            f"{STAGETRACE_PEER_KEY}: {', '.join(unknown)} is not a peer key part; use a comma-separated subset "
            f"of {', '.join(conventions.PEER_KEY_PARTS)}, or none"
        )
    return tuple(p for p in conventions.PEER_KEY_PARTS if p in parts)


def record_content() -> bool:
    return os.environ.get(STAGETRACE_RECORD_CONTENT, "").strip().lower() in ("1", "true", "yes", "on")


class TokenError(Exception):
    """The token file cannot be read or is empty; the message is one line a person can act on."""


def load_token(path: str | Path | None = None) -> str | None:
    """The token from ``path``, else ``$STAGETRACE_AGENT_TOKEN_FILE``, else ``$STAGETRACE_AGENT_TOKEN``; None if unset."""
    path = path or os.environ.get(STAGETRACE_AGENT_TOKEN_FILE)
    if path:
        try:
            mode = Path(path).stat().st_mode & 0o777
            token = Path(path).read_text().strip()
        except OSError as exc:
            raise TokenError(f"cannot read the token file {path}: {exc.strerror or exc}") from None
        if mode & 0o077:  # as ssh refuses a private key others can read
            raise TokenError(f"the token file {path} can be read by other users (mode {mode:o}): chmod 600 {path}")
        if not token:
            raise TokenError(f"the token file {path} is empty: write the token into it, or leave the option out")
        return token
    return os.environ.get(STAGETRACE_AGENT_TOKEN, "").strip() or None
