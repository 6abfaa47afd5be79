"""Settings that come from the environment, with their names and defaults in one place."""

from __future__ import annotations

import os
from pathlib import Path

ENV_STORE = "STAGETRACE_STORE"
ENV_STORE_USER = "STAGETRACE_STORE_USER"
ENV_STORE_PASSWORD = "STAGETRACE_STORE_PASSWORD"
ENV_STORE_PASSWORD_FILE = "STAGETRACE_STORE_PASSWORD_FILE"
ENV_SERVICE_NAME = "STAGETRACE_SERVICE_NAME"
ENV_RECORD_CONTENT = "STAGETRACE_RECORD_CONTENT"

DEFAULT_DATABASE = "stagetrace"
DEFAULT_QUERY_LISTEN = "127.0.0.1:8123"  # the agent's --query-listen: ClickHouse's own HTTP port, for Grafana
DEFAULT_SERVICE_NAME = "inference"


def default_store_path() -> Path:
    data_home = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return Path(data_home) / "stagetrace" / "store"


def store_dsn() -> str:
    return os.environ.get(ENV_STORE) or f"chdb://{default_store_path()}"


def store_password() -> str:
    """The server password from the environment or a file, so it never appears in ``ps`` output."""
    path = os.environ.get(ENV_STORE_PASSWORD_FILE)
    if path:
        return Path(path).read_text().strip()
    return os.environ.get(ENV_STORE_PASSWORD, "")


def service_name() -> str:
    return os.environ.get(ENV_SERVICE_NAME) or os.environ.get("OTEL_SERVICE_NAME") or DEFAULT_SERVICE_NAME


def record_content() -> bool:
    return os.environ.get(ENV_RECORD_CONTENT, "").strip().lower() in ("1", "true", "yes", "on")
