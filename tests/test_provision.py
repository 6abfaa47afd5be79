"""`stagetrace provision`: the file tree against Grafana's documented formats, the API provisioner against a
small local server that answers the endpoints it uses as Grafana documents them and records every request.
"""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml

from stagetrace import cli
from stagetrace.dashboards import _panels, alert_rules, build_all, render
from stagetrace.dashboards.grafana_api import Provisioner, connect
from stagetrace.dashboards.provisioning import ClickHouseSettings, ProvisionError, settings_from

TOKEN = "glsa_test-token-0123456789"
PASSWORD = "ch-s3cret-password"
SETTINGS = ClickHouseSettings("clickhouse.internal", 8123, "http", False, "grafana_reader", "stagetrace", PASSWORD)
DURATION = re.compile(r"^\d+[smhd]$")
RULE_UID = re.compile(r"^[A-Za-z0-9_-]{1,40}$")


# ---------------------------------------------------------------------------------------------
# A Grafana that answers the provisioner's endpoints


class FakeGrafana(ThreadingHTTPServer):
    """Folders, data sources, dashboards and rule groups in memory, answered with Grafana's bodies and codes."""

    daemon_threads = True

    def __init__(self):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.token = TOKEN
        self.requests: list[dict] = []
        self.folders: dict[str, dict] = {}
        self.datasources: dict[str, dict] = {}
        self.dashboards: dict[str, dict] = {}
        self.rule_groups: dict[tuple[str, str], dict] = {}
        self.forced: dict[tuple[str, str], tuple[int, dict]] = {}  # (method, path) -> answer
        self.lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def writes(self) -> list[tuple[str, str]]:
        return [(r["method"], r["path"]) for r in self.requests if r["method"] != "GET"]

    def answer(self, method: str, path: str, body) -> tuple[int, dict]:
        if (method, path) in self.forced:
            return self.forced[(method, path)]
        parts = path.strip("/").split("/")
        if parts[:2] == ["api", "folders"]:
            return self._folders(method, parts[2:], body)
        if parts[:2] == ["api", "datasources"]:
            return self._datasources(method, parts[2:], body)
        if parts[:2] == ["api", "dashboards"]:
            return self._dashboards(method, parts[2:], body)
        if parts[:4] == ["api", "v1", "provisioning", "folder"] and len(parts) == 7 and parts[5] == "rule-groups":
            return self._rule_group(method, parts[4], parts[6], body)
        return 404, {"message": "Not found"}

    def _folders(self, method, rest, body):
        if method == "GET" and len(rest) == 1:
            folder = self.folders.get(rest[0])
            return (200, folder) if folder else (404, {"message": "folder not found", "status": "not-found"})
        if method == "POST" and not rest:
            if any(f["title"] == body["title"] for f in self.folders.values()):
                return 409, {"message": "a folder with the same name already exists"}
            folder = {
                "id": len(self.folders) + 1,
                "uid": body["uid"],
                "title": body["title"],
                "url": f"/dashboards/f/{body['uid']}/",
                "version": 1,
                "hasAcl": False,
            }
            self.folders[body["uid"]] = folder
            return 200, folder
        if method == "PUT" and len(rest) == 1 and rest[0] in self.folders:
            self.folders[rest[0]] = {**self.folders[rest[0]], "title": body["title"]}
            return 200, self.folders[rest[0]]
        return 404, {"message": "folder not found"}

    def _datasources(self, method, rest, body):
        if rest[:1] == ["uid"] and len(rest) == 2:
            uid = rest[1]
            if uid not in self.datasources:
                return 404, {"message": "Data source not found"}
            if method == "GET":
                return 200, self.datasources[uid]
            if method == "PUT":
                stored = self._store_datasource(body, self.datasources[uid]["id"])
                return 200, {
                    "datasource": stored,
                    "id": stored["id"],
                    "message": "Datasource updated",
                    "name": stored["name"],
                }
        if method == "POST" and not rest:
            if any(ds["name"] == body["name"] for ds in self.datasources.values()):
                return 409, {"message": "data source with the same name already exists"}
            stored = self._store_datasource(body, len(self.datasources) + 1)
            return 200, {
                "datasource": stored,
                "id": stored["id"],
                "message": "Datasource added",
                "name": stored["name"],
            }
        return 404, {"message": "Not found"}

    def _store_datasource(self, body, id_):
        # Grafana keeps secrets write-only: it answers which secure fields are set, never their values
        secure = {k: True for k in body.get("secureJsonData", {})}
        previous = self.datasources.get(body["uid"], {}).get("secureJsonFields", {})
        stored = {
            "id": id_,
            "orgId": 1,
            "url": "",
            "basicAuth": False,
            "version": 1,
            "readOnly": False,
            **{k: v for k, v in body.items() if k != "secureJsonData"},
            "secureJsonFields": {**previous, **secure},
        }
        self.datasources[body["uid"]] = stored
        return stored

    def _dashboards(self, method, rest, body):
        if method == "GET" and rest[:1] == ["uid"]:
            found = self.dashboards.get(rest[1])
            return (200, found) if found else (404, {"message": "Dashboard not found"})
        if method == "POST" and rest == ["db"]:
            dashboard, folder = body["dashboard"], body.get("folderUid", "")
            for uid, other in self.dashboards.items():
                if (
                    uid != dashboard["uid"]
                    and other["dashboard"]["title"] == dashboard["title"]
                    and other["meta"]["folderUid"] == folder
                ):
                    return 412, {
                        "message": "A dashboard with the same name in the folder already exists",
                        "status": "name-exists",
                    }
            existing = self.dashboards.get(dashboard["uid"])
            if existing and not body.get("overwrite"):
                return 412, {"message": "The dashboard has been changed by someone else", "status": "version-mismatch"}
            version = existing["dashboard"]["version"] + 1 if existing else 1
            id_ = existing["dashboard"]["id"] if existing else len(self.dashboards) + 1
            slug = re.sub(r"[^a-z0-9]+", "-", dashboard["title"].lower()).strip("-")
            self.dashboards[dashboard["uid"]] = {
                "dashboard": {**dashboard, "id": id_, "version": version},
                "meta": {"type": "db", "slug": slug, "folderUid": folder, "version": version, "canSave": True},
            }
            return 200, {
                "id": id_,
                "uid": dashboard["uid"],
                "url": f"/d/{dashboard['uid']}/{slug}",
                "status": "success",
                "version": version,
                "slug": slug,
            }
        return 404, {"message": "Not found"}

    def _rule_group(self, method, folder, group, body):
        if method == "GET":
            found = self.rule_groups.get((folder, group))
            return (200, found) if found else (404, {"message": "rule group does not exist"})
        if method == "PUT":
            if folder not in self.folders:
                return 404, {"message": "folder does not exist"}
            # Grafana answers with its own fields added to each rule
            rules = [
                {
                    "id": n,
                    "updated": "2026-01-01T00:00:00Z",
                    "provenance": "api",
                    "notification_settings": None,
                    "record": None,
                    **rule,
                }
                for n, rule in enumerate(body["rules"], start=1)
            ]
            self.rule_groups[(folder, group)] = {**body, "rules": rules}
            return 200, self.rule_groups[(folder, group)]
        return 404, {"message": "Not found"}


class _Handler(BaseHTTPRequestHandler):
    server: FakeGrafana

    def _handle(self):
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        body = json.loads(raw) if raw else None
        with self.server.lock:
            self.server.requests.append(
                {"method": self.command, "path": self.path, "headers": dict(self.headers), "body": body}
            )
            if self.headers.get("Authorization") != f"Bearer {self.server.token}":
                status, answer = 401, {"message": "invalid API key"}
            else:
                status, answer = self.server.answer(self.command, self.path, body)
        data = json.dumps(answer).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = do_PUT = do_DELETE = _handle

    def log_message(self, *args):  # keep the test output clean
        pass


@pytest.fixture
def grafana():
    server = FakeGrafana()
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def provision(grafana: FakeGrafana, token: str = TOKEN, settings: ClickHouseSettings = SETTINGS) -> list[str]:
    lines: list[str] = []
    Provisioner(connect(grafana.url, token), grafana.url, settings, lines.append).run()
    return lines


# ---------------------------------------------------------------------------------------------
# The API provisioner


def test_first_run_creates_everything_with_the_documented_requests(grafana):
    lines = provision(grafana)
    dashboards = build_all()
    rule_group_path = f"/api/v1/provisioning/folder/{alert_rules.FOLDER_UID}/rule-groups/{alert_rules.GROUP}"
    expected = [
        ("GET", "/api/folders/stagetrace"),
        ("POST", "/api/folders"),
        ("GET", f"/api/datasources/uid/{_panels.DATASOURCE_UID}"),
        ("POST", "/api/datasources"),
    ]
    for uid in dashboards:
        expected += [("GET", f"/api/dashboards/uid/{uid}"), ("POST", "/api/dashboards/db")]
    expected += [("GET", rule_group_path), ("PUT", rule_group_path)]
    assert [(r["method"], r["path"]) for r in grafana.requests] == expected
    for request in grafana.requests:
        assert request["headers"]["Authorization"] == f"Bearer {TOKEN}"
        if request["method"] != "GET":
            assert request["headers"]["Content-Type"].startswith("application/json")

    writes = [r for r in grafana.requests if r["method"] != "GET"]
    assert writes[0]["body"] == {"title": "stagetrace", "uid": "stagetrace"}
    datasource = writes[1]["body"]
    assert datasource["uid"] == _panels.DATASOURCE_UID and datasource["type"] == "grafana-clickhouse-datasource"
    connection = {
        k: datasource["jsonData"][k] for k in ("host", "port", "protocol", "secure", "username", "defaultDatabase")
    }
    assert connection == {
        "host": "clickhouse.internal",
        "port": 8123,
        "protocol": "http",
        "secure": False,
        "username": "grafana_reader",
        "defaultDatabase": "stagetrace",
    }
    assert datasource["jsonData"]["traces"]["defaultTable"] == "otel_traces"
    assert datasource["secureJsonData"] == {"password": PASSWORD}
    for request, (uid, dashboard) in zip(writes[2:-1], dashboards.items()):
        assert request["body"] == {
            "dashboard": {**dashboard, "id": None},
            "folderUid": "stagetrace",
            "message": "provisioned by stagetrace",
            "overwrite": False,
        }
    assert writes[-1]["body"] == alert_rules.api_rule_group()
    assert lines == [
        "folder stagetrace: created",
        f"data source {_panels.DATASOURCE_UID}: created",
        *[f"dashboard {uid}: created" for uid in dashboards],
        f"alert rule group {alert_rules.GROUP}: created",
    ]


def test_second_run_changes_nothing(grafana):
    provision(grafana)
    state = copy.deepcopy((grafana.folders, grafana.datasources, grafana.dashboards, grafana.rule_groups))
    grafana.requests.clear()
    lines = provision(grafana)
    assert grafana.writes() == []
    assert all(line.endswith(": unchanged") for line in lines) and len(lines) == 3 + len(build_all())
    assert (grafana.folders, grafana.datasources, grafana.dashboards, grafana.rule_groups) == state


def test_only_what_drifted_is_written_back(grafana):
    provision(grafana)
    grafana.dashboards["stagetrace-gpu"]["dashboard"]["title"] = "edited in the UI"
    grafana.datasources[_panels.DATASOURCE_UID]["jsonData"]["host"] = "old-host"
    grafana.rule_groups[("stagetrace", alert_rules.GROUP)]["rules"][0]["for"] = "1h"
    grafana.requests.clear()
    lines = provision(grafana)
    rule_group_path = f"/api/v1/provisioning/folder/{alert_rules.FOLDER_UID}/rule-groups/{alert_rules.GROUP}"
    assert grafana.writes() == [
        ("PUT", f"/api/datasources/uid/{_panels.DATASOURCE_UID}"),
        ("POST", "/api/dashboards/db"),
        ("PUT", rule_group_path),
    ]
    (saved,) = [r["body"] for r in grafana.requests if r["path"] == "/api/dashboards/db"]
    assert saved["dashboard"]["uid"] == "stagetrace-gpu" and saved["overwrite"] is True
    assert grafana.dashboards["stagetrace-gpu"]["dashboard"]["title"] == build_all()["stagetrace-gpu"]["title"]
    assert "dashboard stagetrace-gpu: updated" in lines and "dashboard stagetrace-overview: unchanged" in lines


def test_a_password_grafana_lacks_is_sent_again(grafana):
    provision(grafana, settings=ClickHouseSettings("h", 8123, password=""))
    grafana.requests.clear()
    provision(grafana, settings=ClickHouseSettings("h", 8123, password=PASSWORD))
    (update,) = [r for r in grafana.requests if r["method"] == "PUT" and "/datasources/" in r["path"]]
    assert update["body"]["secureJsonData"] == {"password": PASSWORD}


def test_401_names_the_token_variables_and_not_the_token(grafana):
    with pytest.raises(ProvisionError) as raised:
        provision(grafana, token="glsa_wrong-token")
    message = str(raised.value)
    assert "401 Unauthorized" in message and "GRAFANA_TOKEN" in message and grafana.url in message
    assert "glsa_wrong-token" not in message and "\n" not in message


def test_403_says_which_permission_is_missing(grafana):
    grafana.forced[("POST", "/api/datasources")] = (
        403,
        {
            "message": "You'll need additional permissions to perform this action. Permissions needed: datasources:create",
            "accessErrorId": "ACE0000000000",
        },
    )
    with pytest.raises(ProvisionError) as raised:
        provision(grafana)
    message = str(raised.value)
    assert "403 Forbidden" in message and "datasources:create" in message and "Admin role" in message
    assert PASSWORD not in message and "\n" not in message


def test_409_for_a_data_source_of_the_same_name_under_another_uid(grafana):
    grafana.datasources["someone-elses"] = {
        "id": 9,
        "uid": "someone-elses",
        "name": _panels.DATASOURCE_NAME,
        "type": "grafana-clickhouse-datasource",
        "jsonData": {},
    }
    with pytest.raises(ProvisionError) as raised:
        provision(grafana)
    message = str(raised.value)
    assert message.startswith(f"cannot create data source '{_panels.DATASOURCE_NAME}'")
    assert "409 Conflict" in message and "data source with the same name already exists" in message


def test_412_for_a_dashboard_of_the_same_title_in_the_folder(grafana):
    overview = build_all()["stagetrace-overview"]
    grafana.dashboards["hand-made"] = {
        "dashboard": {"uid": "hand-made", "title": overview["title"], "id": 77, "version": 3},
        "meta": {"folderUid": "stagetrace"},
    }
    with pytest.raises(ProvisionError) as raised:
        provision(grafana)
    message = str(raised.value)
    assert "412 Precondition Failed" in message and "(name-exists)" in message and "stagetrace-overview" in message


def test_unreachable_grafana_is_one_line():
    with pytest.raises(ProvisionError, match=r"^cannot reach Grafana at http://127\.0\.0\.1:9 trying to read folder"):
        Provisioner(connect("http://127.0.0.1:9", TOKEN), "http://127.0.0.1:9", SETTINGS, lambda line: None).run()


# ---------------------------------------------------------------------------------------------
# The command line


def _cli(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("GRAFANA_", "STAGETRACE_"))}
    return subprocess.run(
        [sys.executable, "-m", "stagetrace", *args], capture_output=True, text=True, timeout=120, env={**clean, **env}
    )


def test_cli_provisions_with_the_token_from_a_file_and_never_prints_secrets(grafana, tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    env = {"GRAFANA_TOKEN_FILE": str(token_file), "STAGETRACE_CLICKHOUSE_PASSWORD": PASSWORD}
    args = ["provision", "--grafana-url", grafana.url, "--clickhouse-host", "ch.internal"]
    first = _cli(args, env)
    assert first.returncode == 0, first.stderr
    assert "dashboard stagetrace-trace-lookup: created" in first.stdout
    second = _cli(args, env)
    assert second.returncode == 0 and second.stdout.count(": unchanged") == 3 + len(build_all())
    refused = _cli(args, {**env, "GRAFANA_TOKEN_FILE": "", "GRAFANA_TOKEN": "glsa_revoked"})
    assert refused.returncode == 2 and refused.stdout == ""
    assert refused.stderr.startswith("stagetrace provision: Grafana at") and "401" in refused.stderr
    assert refused.stderr.count("\n") == 1 and "Traceback" not in refused.stderr
    for done in (first, second, refused):
        output = done.stdout + done.stderr
        assert TOKEN not in output and PASSWORD not in output and "glsa_revoked" not in output


@pytest.mark.parametrize(
    ("args", "env", "error"),
    [
        (
            ["--grafana-url", "http://grafana:3000", "--clickhouse-host", "ch"],
            {},
            "no Grafana token: set GRAFANA_TOKEN",
        ),
        (
            ["--grafana-url", "http://admin:admin@grafana:3000", "--clickhouse-host", "ch"],
            {"GRAFANA_TOKEN": "glsa_example_token"},
            "carries credentials",
        ),
        (
            ["--grafana-url", "http://grafana:3000", "--store", "chdb://memory"],
            {"GRAFANA_TOKEN": "glsa_example_token"},
            "--clickhouse-host",
        ),
        (
            ["--grafana-url", "http://grafana:3000", "--clickhouse-host", "ch"],
            {"GRAFANA_TOKEN_FILE": "/nonexistent/token"},
            "cannot read the token file",
        ),
    ],
)
def test_cli_errors_are_one_actionable_line(args, env, error):
    done = _cli(["provision", *args], env)
    assert done.returncode == 2
    assert done.stderr.startswith("stagetrace provision: ") and error in done.stderr
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr


def test_settings_come_from_flags_then_environment_then_the_store_dsn(monkeypatch):
    for name in list(os.environ):
        if name.startswith("STAGETRACE_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("STAGETRACE_STORE_PASSWORD", "writer-pw")
    server = settings_from(store="https://writer@ch.example:8443/metrics")
    assert (
        server.host,
        server.port,
        server.protocol,
        server.secure,
        server.user,
        server.database,
        server.password,
    ) == ("ch.example", 8443, "http", True, "writer", "metrics", "writer-pw")
    monkeypatch.setenv("STAGETRACE_CLICKHOUSE_USER", "reader")
    monkeypatch.setenv("STAGETRACE_CLICKHOUSE_PASSWORD", "reader-pw")
    reader = settings_from(store="https://writer@ch.example:8443/metrics", protocol="native")
    assert (reader.port, reader.protocol, reader.user, reader.password) == (9440, "native", "reader", "reader-pw")
    assert "reader-pw" not in repr(reader)
    # an embedded store: through the query endpoint the agent serves it at (none runs: its default address)
    embedded = settings_from(store="chdb:///tmp/no-agent-here")
    assert (embedded.host, embedded.port, embedded.protocol) == ("127.0.0.1", 8123, "http")
    assert "start `stagetrace agent --store chdb:///tmp/no-agent-here`" in embedded.through_agent
    with pytest.raises(ProvisionError, match="in-memory store cannot be shared"):
        settings_from(store="chdb://memory")


def test_a_password_is_mentioned_only_where_grafana_needs_one(tmp_path, monkeypatch, capsys):
    """Through an agent that asks for no token, Grafana needs no password, and `provision` says none; a server store
    (or an agent with a token) does."""
    monkeypatch.delenv("STAGETRACE_CLICKHOUSE_PASSWORD", raising=False)
    monkeypatch.delenv("STAGETRACE_CLICKHOUSE_PASSWORD_FILE", raising=False)
    assert cli.main(["provision", "--to-dir", str(tmp_path / "a"), "--store", f"chdb://{tmp_path / 'store'}"]) == 0
    out = capsys.readouterr().out
    assert "through the agent's query endpoint" in out and "data source password" not in out
    assert (
        cli.main(
            ["provision", "--to-dir", str(tmp_path / "b"), "--store", "http://grafana@ch.internal:8123/stagetrace"]
        )
        == 0
    )
    assert "password from $STAGETRACE_CLICKHOUSE_PASSWORD" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------
# The provisioning tree against Grafana's file formats


@pytest.fixture
def tree(tmp_path, monkeypatch, capsys) -> Path:
    monkeypatch.setenv("STAGETRACE_CLICKHOUSE_PASSWORD", PASSWORD)
    assert (
        cli.main(
            [
                "provision",
                "--to-dir",
                str(tmp_path),
                "--clickhouse-host",
                "ch.internal",
                "--clickhouse-user",
                "grafana_reader",
                "--provisioning-path",
                "/grafana/prov",
            ]
        )
        == 0
    )
    assert PASSWORD not in capsys.readouterr().out
    return tmp_path


def _load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def test_tree_layout_and_no_secret_in_any_file(tree):
    files = sorted(str(p.relative_to(tree)) for p in tree.rglob("*") if p.is_file())
    assert files == sorted(
        [
            "alerting/stagetrace.yaml",
            "dashboards/stagetrace.yaml",
            "datasources/stagetrace.yaml",
            *[f"dashboards/stagetrace/{uid}.json" for uid in build_all()],
        ]
    )
    for path in tree.rglob("*"):
        if path.is_file():
            assert PASSWORD not in path.read_text(), path


def test_datasource_file(tree):
    data = _load(tree / "datasources" / "stagetrace.yaml")
    assert data["apiVersion"] == 1
    (source,) = data["datasources"]
    assert {"name", "type"} <= set(source) and source["type"] == "grafana-clickhouse-datasource"
    assert source["uid"] == _panels.DATASOURCE_UID and source["access"] == "proxy"
    assert source["jsonData"]["host"] == "ch.internal" and source["jsonData"]["username"] == "grafana_reader"
    assert source["jsonData"]["protocol"] in ("http", "native") and isinstance(source["jsonData"]["port"], int)
    assert source["jsonData"]["defaultDatabase"] == "stagetrace"
    # Grafana expands ${VAR} in provisioning files from its own environment
    assert source["secureJsonData"] == {"password": "${STAGETRACE_CLICKHOUSE_PASSWORD}"}


def test_dashboard_provider_and_json(tree):
    data = _load(tree / "dashboards" / "stagetrace.yaml")
    assert data["apiVersion"] == 1
    (provider,) = data["providers"]
    assert provider["name"] and provider["type"] == "file" and provider["folderUid"] == alert_rules.FOLDER_UID
    assert provider["options"]["path"] == "/grafana/prov/dashboards/stagetrace"
    assert not provider["options"]["foldersFromFilesStructure"]  # it needs folder and folderUid empty
    uids = []
    for path in sorted((tree / "dashboards" / "stagetrace").glob("*.json")):
        dashboard = json.loads(path.read_text())
        uids.append(dashboard["uid"])
        assert path.read_text() == render(build_all()[dashboard["uid"]])
        assert dashboard.get("id") is None and dashboard["title"] and dashboard["panels"]
        variables = {v["name"]: v for v in dashboard["templating"]["list"]}
        assert variables["datasource"]["current"]["value"] == _panels.DATASOURCE_UID
        # provisioning does not expand environment variables inside dashboard JSON: none may be relied on
        assert "$__env" not in path.read_text()
    assert len(uids) == len(set(uids)) == len(build_all())


def test_alerting_file(tree):
    data = _load(tree / "alerting" / "stagetrace.yaml")
    assert data["apiVersion"] == 1
    (group,) = data["groups"]
    assert {"name", "folder", "interval", "rules"} <= set(group) and DURATION.match(group["interval"])
    dashboards = build_all()
    uids = [rule["uid"] for rule in group["rules"]]
    assert len(uids) == len(set(uids)) == len(alert_rules.RULES)
    for rule in group["rules"]:
        assert RULE_UID.match(rule["uid"]) and rule["title"], rule["uid"]
        refs = {item["refId"] for item in rule["data"]}
        assert rule["condition"] in refs
        assert rule["noDataState"] in ("NoData", "Alerting", "OK") and rule["execErrState"] in (
            "Error",
            "Alerting",
            "OK",
        )
        assert DURATION.match(rule["for"])
        for item in rule["data"]:
            assert {"refId", "datasourceUid", "model"} <= set(item) and item["model"]["refId"] == item["refId"]
            if item["datasourceUid"] == "__expr__":
                assert item["model"]["expression"] in refs - {item["refId"]}
            else:
                assert item["datasourceUid"] == _panels.DATASOURCE_UID
                window = item["relativeTimeRange"]
                assert window != {"from": 0, "to": 0} and window["from"] > window["to"] >= 0
                assert "$__timeFilter(" in item["model"]["rawSql"]
        panel_ids = {p["id"] for p in dashboards[rule["dashboardUid"]]["panels"]}
        assert rule["panelId"] in panel_ids
        # Grafana interpolates $VAR in alerting files except in data[].model and annotations
        outside = {k: v for k, v in rule.items() if k not in ("data", "annotations")}
        assert "$" not in json.dumps(outside), rule["uid"]
