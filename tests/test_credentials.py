"""No credential given by environment or file shows in a log line, an error, ``--help`` or a command line.

Every credential the suite takes — the store password, the agent's token, the Grafana token, the data
source password — is given a distinctive value, and every text the commands produce is searched for it.
"""

import http.server
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest

SYSFS = Path(__file__).parent / "fixtures" / "node" / "sys"
SECRETS = {
    "STAGETRACE_STORE_PASSWORD": "store-pw-3f9a1c",
    "STAGETRACE_AGENT_TOKEN": "agent-token-7d2e88",
    "GRAFANA_TOKEN": "glsa_grafana-token-51b0aa",
    "STAGETRACE_CLICKHOUSE_PASSWORD": "ds-pw-c4e7d2",
}
FILE_SECRETS = {
    "STAGETRACE_STORE_PASSWORD_FILE": "store-file-pw-0b1d",
    "STAGETRACE_AGENT_TOKEN_FILE": "agent-file-token-9e4f",
    "GRAFANA_TOKEN_FILE": "grafana-file-token-2a6c",
    "STAGETRACE_CLICKHOUSE_PASSWORD_FILE": "ds-file-pw-8c3b",
}
ALL = [*SECRETS.values(), *FILE_SECRETS.values()]


def leaks(text: str) -> list[str]:
    return [secret for secret in ALL if secret in text]


@pytest.fixture(params=["env", "file"])
def env(request, tmp_path):
    base = {k: v for k, v in os.environ.items() if k not in SECRETS and k not in FILE_SECRETS}
    base["STAGETRACE_HOST"] = "node-a"
    if request.param == "env":
        return {**base, **SECRETS}
    for name, secret in FILE_SECRETS.items():
        path = tmp_path / name.lower()
        path.write_text(secret + "\n")
        path.chmod(0o600)  # the agent refuses a token file others can read
        base[name] = str(path)
    return base


def stagetrace(env, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "stagetrace", *args], capture_output=True, text=True, env=env, timeout=120
    )


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_help_never_shows_a_credential(env):
    commands = ["", "demo", "trace", "explain", "divergences", "agent", "collect", "schema", "provision"]
    for command in commands:
        result = stagetrace(env, *command.split(), "--help")
        assert result.returncode == 0, result.stderr
        assert not leaks(result.stdout + result.stderr), command


def test_errors_about_an_unreachable_server_never_show_its_password(env):
    port = closed_port()
    for args in (
        ["trace", "r1", "--store", f"http://alice@127.0.0.1:{port}/db"],
        [
            "agent",
            "--store",
            f"http://alice@127.0.0.1:{port}/db",
            "--collectors",
            "rdma",
            "--sysfs",
            str(SYSFS),
            "--otlp",
            "none",
            "--otlp-grpc",
            "none",
            "--query-listen",
            "none",
            "--listen",
            "127.0.0.1:0",
        ],
        # a password in the DSN itself is the user's choice to put on a command line; errors still hide it
        ["schema", "--store", f"http://alice:{SECRETS['STAGETRACE_STORE_PASSWORD']}@127.0.0.1:{port}/db"],
    ):
        result = stagetrace(env, *args)
        assert result.returncode != 0
        assert "alice@127.0.0.1" in result.stderr, result.stderr  # it names the server, without the password
        assert not leaks(result.stdout + result.stderr), (args, result.stderr)
        assert "Traceback" not in result.stderr


def test_the_running_agent_shows_its_token_nowhere(env, tmp_path):
    log = tmp_path / "agent.log"
    agent = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "stagetrace",
            "agent",
            "--collectors",
            "rdma",
            "--sysfs",
            str(SYSFS),
            "--store",
            f"chdb://{tmp_path / 'store'}",
            "--listen",
            "127.0.0.1:0",
            "--interval",
            "200ms",
            "--otlp",
            "127.0.0.1:0",
            "--otlp-grpc",
            "127.0.0.1:0",
            "--query-listen",
            "127.0.0.1:0",
        ],
        stdout=subprocess.DEVNULL,
        stderr=log.open("w"),
        env=env,
    )
    try:
        urls = _wait_for_urls(log, agent)
        cmdline = Path(f"/proc/{agent.pid}/cmdline").read_bytes().decode()
        assert not leaks(cmdline)
        token = (
            SECRETS["STAGETRACE_AGENT_TOKEN"]
            if "STAGETRACE_AGENT_TOKEN" in env
            else FILE_SECRETS["STAGETRACE_AGENT_TOKEN_FILE"]
        )
        answers = []
        for url, body in ((urls["otlp"] + "/v1/traces", b"{}"), (urls["query"] + "/?query=SELECT%201", None)):
            for header in (None, "Bearer wrong", f"Bearer {token}x", f"Basic {token}"):
                answers.append(_request(url, body, header))
            assert _request(url, body, f"Bearer {token}")[0] == 200
        assert {status for status, _ in answers} <= {401, 403}
        assert not any(leaks(text) for _, text in answers)
    finally:
        agent.send_signal(signal.SIGTERM)
        agent.wait(timeout=60)
    assert agent.returncode == 0
    text = log.read_text()
    assert "serving" in text and not leaks(text)


def _wait_for_urls(log: Path, agent: subprocess.Popen) -> dict:
    import time

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and agent.poll() is None:
        text = log.read_text()
        otlp = re.search(r"receiving OTLP/HTTP at (http://\S+)/v1/traces", text)
        query = re.search(r"sharing the store read-only at (http://\S+)", text)
        if otlp and query:
            return {"otlp": otlp[1], "query": query[1]}
        time.sleep(0.1)
    pytest.fail(f"the agent did not start: {log.read_text()}")


def _request(url: str, body: bytes | None, authorization: str | None) -> tuple[int, str]:
    request = urllib.request.Request(url, data=body, method="POST" if body is not None else "GET")
    if body is not None:
        request.add_header("Content-Type", "application/json")
    if authorization:
        request.add_header("Authorization", authorization)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read().decode(errors="replace") + str(response.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace") + str(exc.headers)


class _EchoingGrafana(http.server.BaseHTTPRequestHandler):
    """A Grafana stand-in at its worst: it refuses, and quotes the credentials it got in its answer."""

    status = 403

    def _answer(self):
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        body = json.dumps({"message": f"access denied for {self.headers.get('Authorization')}"}).encode()
        self.send_response(self.status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = do_PUT = _answer

    def log_message(self, *args):
        pass


@pytest.mark.parametrize("status", [401, 403, 500])
def test_provisioning_errors_never_show_the_grafana_token(env, status):
    handler = type("Handler", (_EchoingGrafana,), {"status": status})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        result = stagetrace(
            env,
            "provision",
            "--grafana-url",
            f"http://127.0.0.1:{server.server_address[1]}",
            "--store",
            "http://alice@127.0.0.1:8123/db",
        )
    finally:
        server.shutdown()
        server.server_close()
    assert result.returncode != 0 and "Traceback" not in result.stderr, result.stderr
    assert not leaks(result.stdout + result.stderr), result.stderr


def test_provisioning_files_name_the_password_variable_not_the_password(env, tmp_path):
    result = stagetrace(env, "provision", "--to-dir", str(tmp_path / "out"), "--store", "http://alice@ch:8123/db")
    assert result.returncode == 0, result.stderr
    assert not leaks(result.stdout + result.stderr)
    for path in (tmp_path / "out").rglob("*"):
        if path.is_file():
            assert not leaks(path.read_text()), path
