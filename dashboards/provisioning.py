"""What stagetrace provisions into Grafana, and the provisioning tree Grafana reads from files.

``write_tree(DIR)`` writes what to mount at ``/etc/grafana/provisioning``::

    datasources/stagetrace.yaml        the ClickHouse data source (uid stagetrace-clickhouse)
    dashboards/stagetrace.yaml         the dashboard provider, pointing at the JSON below
    dashboards/stagetrace/<uid>.json   the five dashboards
    alerting/stagetrace.yaml           the Grafana-managed pipeline alert rules

The data source password is never written: the file names an environment variable that Grafana
expands when it provisions (``${STAGETRACE_CLICKHOUSE_PASSWORD}``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import yaml

from stagetrace import config, through_agent
from stagetrace.environment_variables import (
    STAGETRACE_CA_FILE,
    STAGETRACE_CLICKHOUSE_HOST,
    STAGETRACE_CLICKHOUSE_PASSWORD,
    STAGETRACE_CLICKHOUSE_PASSWORD_FILE,
    STAGETRACE_CLICKHOUSE_PORT,
    STAGETRACE_CLICKHOUSE_PROTOCOL,
    STAGETRACE_CLICKHOUSE_USER,
)
from stagetrace.dashboards import _panels as p
from stagetrace.dashboards import alert_rules, build_all, render
from stagetrace.store import StoreError, parse_dsn

DEFAULT_PROVISIONING_PATH = "/etc/grafana/provisioning"
PROVIDER_NAME = "stagetrace"
ORG_ID = 1
# ClickHouse's own defaults (the data source's docs): native 9000/9440 TLS, HTTP 8123/8443 TLS
DEFAULT_PORTS = {("native", False): 9000, ("native", True): 9440, ("http", False): 8123, ("http", True): 8443}
PROTOCOLS = ("native", "http")


class ProvisionError(Exception):
    """An expected failure; its message is one line a person can act on."""


@dataclass(frozen=True)
class ClickHouseSettings:
    """Where Grafana's ClickHouse data source connects: usually a read-only user on the store's server."""

    host: str
    port: int
    protocol: str = "http"
    secure: bool = False
    user: str = "default"
    database: str = config.DEFAULT_DATABASE
    password: str = field(default="", repr=False)
    # an embedded store: Grafana reads it through the agent's query endpoint; what to tell the operator
    through_agent: str = ""
    ca_file: str = ""  # the CA Grafana verifies the server's certificate against ($STAGETRACE_CA_FILE)
    password_needed: bool = True  # False: through an agent that asks for no token

    def secure_json_data(self, password: str) -> dict:
        """The secrets: the password, and the CA certificate (the file's contents) when one is named."""
        return {"password": password, **({"tlsCACert": Path(self.ca_file).read_text()} if self.ca_file else {})}

    def json_data(self) -> dict:
        return {
            "host": self.host,
            "port": self.port,
            "protocol": self.protocol,
            "secure": self.secure,
            "username": self.user,
            "defaultDatabase": self.database,
            # a secure connection is always verified: against the CA given, else Grafana's system CAs
            **({"tlsSkipVerify": False, "tlsAuthWithCACert": bool(self.ca_file)} if self.secure else {}),
            # the plugin's trace view over the collector-compatible otel_traces table
            "traces": {
                "defaultDatabase": self.database,
                "defaultTable": "otel_traces",
                "otelEnabled": True,
                "otelVersion": "latest",
                "durationUnit": "nanoseconds",
            },
            # and its logs view ("View logs" on a trace) over the Collector's otel_logs
            "logs": {
                "defaultDatabase": self.database,
                "defaultTable": "otel_logs",
                "otelEnabled": True,
                "otelVersion": "latest",
            },
        }


def settings_from(
    *,
    store: str | None = None,
    host: str | None = None,
    port: int | None = None,
    protocol: str | None = None,
    secure: bool | None = None,
    user: str | None = None,
    database: str | None = None,
) -> ClickHouseSettings:
    """Settings from flags, then ``STAGETRACE_CLICKHOUSE_*``, then the store DSN when it names a server."""
    try:
        location = parse_dsn(store)
    except StoreError as exc:
        raise ProvisionError(str(exc)) from None
    server = None if location.embedded else location
    host = host or os.environ.get(STAGETRACE_CLICKHOUSE_HOST) or (server.host if server else None)
    note, needed = "", True
    if not host:
        if not location.path:
            raise ProvisionError(
                "an in-memory store cannot be shared with Grafana: give --store chdb:///path (served by `stagetrace "
                "agent`), a server store with --store http(s)://host:8123/db, or --clickhouse-host (or "
                f"{STAGETRACE_CLICKHOUSE_HOST})"
            )
        host, port, note, agent_tls, needed = _through_agent(location, port)
        secure = agent_tls if secure is None else secure
    protocol = protocol or os.environ.get(STAGETRACE_CLICKHOUSE_PROTOCOL) or "http"
    if protocol not in PROTOCOLS:
        raise ProvisionError(f"ClickHouse protocol {protocol!r}: use native or http")
    if secure is None:
        secure = bool(server and server.scheme == "https")
    if port is None:
        port = _port(os.environ.get(STAGETRACE_CLICKHOUSE_PORT)) or (
            server.port if server and protocol == "http" else DEFAULT_PORTS[(protocol, secure)]
        )
    user = user or os.environ.get(STAGETRACE_CLICKHOUSE_USER) or (server.username if server else "default")
    password = _password()
    if password is None:  # the store's own credentials when Grafana connects as the same user
        password = server.password if server and server.username == user else ""
    ca_file = os.environ.get(STAGETRACE_CA_FILE, "") if secure else ""
    if ca_file and not Path(ca_file).is_file():
        raise ProvisionError(
            f"{STAGETRACE_CA_FILE}={ca_file} is not a file: name the CA that signed the server's certificate"
        )
    return ClickHouseSettings(
        host,
        port,
        protocol,
        secure,
        user,
        database or location.database,
        password,
        note,
        ca_file,
        needed or bool(password),
    )


def _through_agent(location, port: int | None) -> tuple[str, int, str, bool, bool]:
    """Grafana reads an embedded store through the query endpoint of the agent that holds it: the address it
    advertises, else the agent's default one; what the operator needs to know about it; whether it speaks TLS;
    whether it asks for its token (Grafana's data source password)."""
    record = through_agent.advertised(location)
    url = urlsplit(f"http://{config.DEFAULT_QUERY_LISTEN}" if record is None else record["query"])
    host, port = url.hostname or "127.0.0.1", port or url.port or 8123
    state = (
        f"the agent (pid {record.get('pid')}) serves it at {host}:{port}"
        if record
        else f"start `stagetrace agent --store chdb://{location.path}`, which serves it at {host}:{port}"
    )
    token = (
        f"; the agent needs its token: give Grafana it as {STAGETRACE_CLICKHOUSE_PASSWORD}"
        if record and record.get("token")
        else ""
    )
    reach = (
        "run Grafana on this host's network (docker run --network host ...)"
        if host in ("127.0.0.1", "::1", "localhost")
        else f"Grafana must reach {host}:{port}"
    )
    note = f"the store is embedded: Grafana reads it through the agent's query endpoint; {state}; {reach}{token}"
    return host, port, note, url.scheme == "https", bool(token)


def _port(text: str | None) -> int | None:
    if not text:
        return None
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise ProvisionError(f"{STAGETRACE_CLICKHOUSE_PORT}={text!r} is not a port number")
    return int(text)


def _password() -> str | None:
    path = os.environ.get(STAGETRACE_CLICKHOUSE_PASSWORD_FILE)
    if path:
        try:
            return Path(path).read_text().strip()
        except OSError as exc:
            raise ProvisionError(
                f"cannot read the file {STAGETRACE_CLICKHOUSE_PASSWORD_FILE} names: {exc.strerror}"
            ) from None
    return os.environ.get(STAGETRACE_CLICKHOUSE_PASSWORD)


def datasource(settings: ClickHouseSettings) -> dict:
    """The data source's fields, as both the API and the provisioning file take them (no secrets)."""
    return {
        "name": p.DATASOURCE_NAME,
        "type": p.DATASOURCE_TYPE,
        "uid": p.DATASOURCE_UID,
        "access": "proxy",
        "isDefault": False,
        "jsonData": settings.json_data(),
    }


def datasources_file(settings: ClickHouseSettings) -> dict:
    secrets = {"password": f"${{{STAGETRACE_CLICKHOUSE_PASSWORD}}}"}
    if settings.ca_file:  # Grafana reads the file when it provisions: the CA's text is not copied here
        secrets["tlsCACert"] = f"$__file{{{settings.ca_file}}}"
    entry = {**datasource(settings), "orgId": ORG_ID, "editable": False, "secureJsonData": secrets}
    return {"apiVersion": 1, "datasources": [entry]}


def dashboards_provider_file(provisioning_path: str) -> dict:
    return {
        "apiVersion": 1,
        "providers": [
            {
                "name": PROVIDER_NAME,
                "orgId": ORG_ID,
                "folder": alert_rules.FOLDER_TITLE,
                "folderUid": alert_rules.FOLDER_UID,
                "type": "file",
                "disableDeletion": False,
                "allowUiUpdates": False,  # dashboards are code: changes go through the builders
                "updateIntervalSeconds": 60,
                "options": {
                    "path": f"{provisioning_path.rstrip('/')}/dashboards/{PROVIDER_NAME}",
                    "foldersFromFilesStructure": False,
                },
            }
        ],
    }


def _yaml(data: dict) -> str:
    return "# Written by `stagetrace provision --to-dir`; regenerate rather than edit.\n" + yaml.safe_dump(
        data, sort_keys=False, allow_unicode=True, width=1000
    )


def write_tree(
    directory: Path, settings: ClickHouseSettings, provisioning_path: str = DEFAULT_PROVISIONING_PATH
) -> list[Path]:
    """Write the provisioning tree under ``directory``; files already there are replaced. Returns what was written."""
    files: dict[Path, str] = {
        Path("datasources", "stagetrace.yaml"): _yaml(datasources_file(settings)),
        Path("dashboards", "stagetrace.yaml"): _yaml(dashboards_provider_file(provisioning_path)),
        Path("alerting", "stagetrace.yaml"): _yaml(alert_rules.file_provisioning()),
    }
    for uid, dashboard in build_all().items():
        files[Path("dashboards", PROVIDER_NAME, f"{uid}.json")] = render(dashboard)
    written = []
    try:
        for relative, text in files.items():
            path = directory / relative
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            written.append(path)
    except OSError as exc:
        raise ProvisionError(f"cannot write the provisioning tree under {directory}: {exc.strerror}") from None
    return written
