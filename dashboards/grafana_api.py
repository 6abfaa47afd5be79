"""Provision a running Grafana over its HTTP API (grafana-client): folder, data source, dashboards, alert rules.

Idempotent: each object is read first and written only when it is missing or differs, so a second run
makes no change. The token comes from ``GRAFANA_TOKEN`` or the file ``GRAFANA_TOKEN_FILE`` names, never
from the command line; neither it nor the ClickHouse password appears in any message.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit

import niquests
from grafana_client import GrafanaApi, TokenAuth
from grafana_client.client import GrafanaException

from stagetrace.dashboards import _panels as p
from stagetrace.dashboards import alert_rules, build_all
from stagetrace.dashboards.provisioning import ClickHouseSettings, ProvisionError, datasource

ENV_TOKEN = "GRAFANA_TOKEN"
ENV_TOKEN_FILE = "GRAFANA_TOKEN_FILE"
TIMEOUT_S = 10.0
MESSAGE = "provisioned by stagetrace"


def token_from_environment() -> str:
    path = os.environ.get(ENV_TOKEN_FILE)
    if path:
        try:
            token = Path(path).read_text().strip()
        except OSError as exc:
            raise ProvisionError(f"cannot read the token file {ENV_TOKEN_FILE} names: {exc.strerror}") from None
    else:
        token = os.environ.get(ENV_TOKEN, "").strip()
    if not token:
        raise ProvisionError(
            f"no Grafana token: set {ENV_TOKEN}, or {ENV_TOKEN_FILE} to a file holding a service-account token"
        )
    return token


def connect(url: str, token: str) -> GrafanaApi:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ProvisionError(f"--grafana-url {url!r}: give the Grafana base URL, e.g. http://grafana:3000")
    if parts.username or parts.password:
        raise ProvisionError(f"--grafana-url carries credentials: remove them and set {ENV_TOKEN} instead")
    return GrafanaApi.from_url(url.rstrip("/"), credential=TokenAuth(token), timeout=TIMEOUT_S)


def _subset(ours, theirs) -> bool:
    """Every field we set has the same value in Grafana's copy (which adds ids, versions, defaults)."""
    if isinstance(ours, dict):
        return isinstance(theirs, dict) and all(k in theirs and _subset(v, theirs[k]) for k, v in ours.items())
    if isinstance(ours, list):
        return isinstance(theirs, list) and len(ours) == len(theirs) and all(map(_subset, ours, theirs))
    return ours == theirs


def _detail(exc: GrafanaException) -> str:
    """Grafana's own words: its ``message`` (and ``status`` for 412s), else the first line of the body."""
    if isinstance(exc.response, dict):
        message, status = exc.response.get("message", ""), exc.response.get("status")
        return f"{message} ({status})" if status else message
    text = str(exc.response or exc.message or "").strip()
    return text.splitlines()[0] if text else ""


class Provisioner:
    """Brings one Grafana organisation to stagetrace's folder, data source, dashboards and rule group."""

    def __init__(self, api: GrafanaApi, url: str, settings: ClickHouseSettings, report: Callable[[str], None] = print):
        self.api = api
        self.url = url
        self.settings = settings
        self.report = report

    def run(self) -> None:
        self.folder()
        self.datasource()
        for dashboard in build_all().values():
            self.dashboard(dashboard)
        self.rule_group()

    # -- one Grafana call, with its failure in one line

    def _call(self, action: str, function, *args, missing_ok: bool = False):
        try:
            return function(*args)
        except GrafanaException as exc:
            if missing_ok and exc.status_code == 404:
                return None
            raise ProvisionError(self._explain(exc, action)) from None
        except niquests.exceptions.RequestException as exc:
            reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise ProvisionError(f"cannot reach Grafana at {self.url} trying to {action}: {reason}") from None

    def _explain(self, exc: GrafanaException, action: str) -> str:
        detail = _detail(exc)
        status = exc.status_code
        if status == 401:
            return (
                f"Grafana at {self.url} rejected the token trying to {action} (401 Unauthorized): "
                f"check {ENV_TOKEN} or {ENV_TOKEN_FILE}"
            )
        if status == 403:
            return (
                f"the token may not {action} (403 Forbidden: {detail}): give its service account the Admin role "
                "in this organisation (data sources need it), or Editor plus data-source permissions"
            )
        if status == 409:
            return (
                f"cannot {action}: {detail} (409 Conflict): rename or remove the existing object in Grafana, "
                "then run again"
            )
        if status == 412:
            return (
                f"cannot {action}: {detail} (412 Precondition Failed): another dashboard in the folder has "
                "this title, or it changed while provisioning; remove or rename the other one, then run again"
            )
        if status == 0:
            return f"cannot reach Grafana at {self.url} trying to {action}: {exc.message}"
        return f"Grafana at {self.url} answered {status} trying to {action}: {detail}"

    # -- the objects

    def folder(self) -> None:
        uid, title = alert_rules.FOLDER_UID, alert_rules.FOLDER_TITLE
        existing = self._call(f"read folder {uid}", self.api.folder.get_folder, uid, missing_ok=True)
        if existing is None:
            self._call(f"create folder {title!r}", self.api.folder.create_folder, title, uid)
            self.report(f"folder {uid}: created")
        elif existing.get("title") != title:
            self._call(f"rename folder {uid}", lambda: self.api.folder.update_folder(uid, title=title, overwrite=True))
            self.report(f"folder {uid}: updated")
        else:
            self.report(f"folder {uid}: unchanged")

    def datasource(self) -> None:
        uid = p.DATASOURCE_UID
        body = datasource(self.settings)
        existing = self._call(
            f"read data source {uid}", self.api.datasource.get_datasource_by_uid, uid, missing_ok=True
        )
        password = self.settings.password
        secrets = self.settings.secure_json_data(password) if password or self.settings.ca_file else {}
        with_password = {**body, "secureJsonData": {k: v for k, v in secrets.items() if v}} if secrets else body
        if existing is None:
            self._call(f"create data source {body['name']!r}", self.api.datasource.create_datasource, with_password)
            self.report(f"data source {uid}: created")
            return
        # Grafana never returns secrets: a password counts as changed only when Grafana holds none.
        password_missing = bool(self.settings.password) and not existing.get("secureJsonFields", {}).get("password")
        if _subset(body, existing) and not password_missing:
            self.report(f"data source {uid}: unchanged")
            return
        self._call(f"update data source {uid}", self.api.datasource.update_datasource_by_uid, uid, with_password)
        self.report(f"data source {uid}: updated")

    def dashboard(self, dashboard: dict) -> None:
        uid = dashboard["uid"]
        existing = self._call(f"read dashboard {uid}", self.api.dashboard.get_dashboard, uid, missing_ok=True)
        if existing is not None:
            stored = {k: v for k, v in existing.get("dashboard", {}).items() if k not in ("id", "version")}
            ours = {k: v for k, v in dashboard.items() if k != "version"}
            if stored == ours and existing.get("meta", {}).get("folderUid") == alert_rules.FOLDER_UID:
                self.report(f"dashboard {uid}: unchanged")
                return
        body = {
            "dashboard": {**dashboard, "id": None},
            "folderUid": alert_rules.FOLDER_UID,
            "message": MESSAGE,
            "overwrite": existing is not None,
        }
        self._call(f"save dashboard {uid}", self.api.dashboard.update_dashboard, body)
        self.report(f"dashboard {uid}: {'updated' if existing is not None else 'created'}")

    def rule_group(self) -> None:
        folder, group = alert_rules.FOLDER_UID, alert_rules.GROUP
        body = alert_rules.api_rule_group()
        existing = self._call(
            f"read alert rule group {group}",
            self.api.alertingprovisioning.get_rule_group,
            folder,
            group,
            missing_ok=True,
        )
        if existing is not None and _subset(body, existing):
            self.report(f"alert rule group {group}: unchanged")
            return
        self._call(
            f"save alert rule group {group}", self.api.alertingprovisioning.update_rule_group, folder, group, body
        )
        self.report(f"alert rule group {group}: {'updated' if existing is not None else 'created'}")


def provision(url: str, settings: ClickHouseSettings, report: Callable[[str], None] = print) -> None:
    """Provision the Grafana at ``url`` with the token from the environment."""
    token = token_from_environment()
    try:
        Provisioner(connect(url, token), url, settings, report).run()
    except ProvisionError as exc:
        # Grafana, or a proxy in front of it, may quote the request (its Authorization header, the data
        # source's password) in an error detail: never pass a credential on into the message
        message = str(exc)
        for secret in (token, settings.password):
            if secret:
                message = message.replace(secret, "***")
        raise ProvisionError(message) from None
