"""Shared fixtures: a real embedded store per test, and real components from Debian's packages.

Tests that need a component (promtool, node_exporter, ethtool, ip) ask for it with
``component("promtool", package="prometheus")``: it is installed with apt when the tests run as
root with apt available; otherwise the test skips with the reason, except under ``CI=true``,
where a missing component fails the run.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

import stagetrace
from stagetrace.store import open_store

_apt_updated = False


def _install(package: str) -> str | None:
    """Install a Debian package; return why it could not be, or None."""
    global _apt_updated
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        return "not root or no apt-get"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    try:
        if not _apt_updated:
            subprocess.run(["apt-get", "update", "-qq"], check=True, env=env, capture_output=True, timeout=600)
            _apt_updated = True
        subprocess.run(
            ["apt-get", "install", "-y", "-qq", package], check=True, env=env, capture_output=True, timeout=900
        )
    except (subprocess.SubprocessError, OSError) as exc:
        return f"apt-get install {package} failed: {exc}"
    return None


@pytest.fixture(scope="session")
def component():
    def need(command: str, package: str) -> str:
        path = shutil.which(command)
        if path is None:
            why = _install(package)
            path = shutil.which(command)
            if path is None:
                message = f"{command} (Debian package {package}) is missing: {why or 'installed but not on PATH'}"
                if os.environ.get("CI") == "true":
                    pytest.fail(message)
                pytest.skip(message)
        return path

    return need


@pytest.fixture
def kubelet():
    """``kubelet(answers_dir)`` starts a PodResources gRPC server on a unix socket answering with the recorded
    answers in ``answers_dir`` (``List.json``, ``GetAllocatableResources.json``) and returns the socket's path.
    The sockets get a short directory of their own: a unix socket's path may not exceed 107 bytes."""
    from stagetrace.collectors.podresources import RecordedKubelet

    directory = Path(tempfile.mkdtemp(prefix="kubelet-"))
    servers: list[RecordedKubelet] = []

    def start(answers: Path) -> Path:
        servers.append(RecordedKubelet(directory / f"{len(servers)}.sock", answers).start())
        return servers[-1].socket_path

    yield start
    for server in servers:
        server.stop()
    shutil.rmtree(directory, ignore_errors=True)


def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "views_row_for_row: after each test, the rows the store's views wrote are "
        "compared with those schema 10's views write from the same spans",
    )


@pytest.fixture
def store_dsn(tmp_path, request):
    dsn = f"chdb://{tmp_path / 'store'}"
    yield dsn
    # the tests of a module marked views_row_for_row are the views' corpus too (issue 32): whatever spans a test
    # stored, the views must have written the rows schema 10's views write from them
    marker = request.node.get_closest_marker("views_row_for_row")  # compare=False: the test empties a view's table
    if marker and marker.kwargs.get("compare", True) and (tmp_path / "store" / "metadata").is_dir():
        from tests.views_reference import assert_same_rows

        with open_store(dsn, create_schema=False) as s:
            assert_same_rows(s)


@pytest.fixture
def store(store_dsn):
    """A real embedded ClickHouse store with the schema, closed after the test (chdb allows one path per process)."""
    with open_store(store_dsn) as s:
        yield s


@pytest.fixture
def spans():
    """What the span API records, in memory: stagetrace configured with the SDK's in-memory exporter."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    memory = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    stagetrace.configure(tracer_provider=provider)
    return memory


@pytest.fixture(autouse=True)
def _reset_tracing():
    yield
    stagetrace.shutdown()


@pytest.fixture(scope="session")
def demo_dsn(tmp_path_factory):
    """A store filled once per test session by ``stagetrace demo --requests 300`` (the dashboards' and rules' data)."""
    dsn = f"chdb://{tmp_path_factory.mktemp('demo') / 'store'}"
    done = subprocess.run(
        [sys.executable, "-m", "stagetrace", "demo", "--requests", "300", "--store", dsn, "--json"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    return dsn


@pytest.fixture(scope="session")
def cli_demo(tmp_path_factory):
    """(DSN, the JSON it printed) of a ``stagetrace demo --requests 300`` store that tests read only through the
    CLI, in other processes: this one never opens it, so they never find it locked."""
    dsn = f"chdb://{tmp_path_factory.mktemp('cli-demo') / 'store'}"
    done = subprocess.run(
        [sys.executable, "-m", "stagetrace", "demo", "--requests", "300", "--store", dsn, "--json"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    return dsn, json.loads(done.stdout)


@pytest.fixture(scope="module")
def demo_store(demo_dsn):
    """The demo's store, open for one test module, with the data source's default database set."""
    with open_store(demo_dsn) as store:
        store.client.database = store.database
        yield store


def _check_verdict(report: dict) -> None:
    """What every ``explain`` report in the suite must hold: the causes are ranked strong first, each group by
    score, all with support; what is ranked first is never a stage's output, a measurement or an identifier unless
    labelled weak; and a verdict with nothing strong says that nothing recorded explains it."""
    from stagetrace import conventions

    from stagetrace.analysis.causes import TIE

    causes = report.get("causes") or []
    assert all(c["score"] > 0 for c in causes), causes
    assert [c["weak"] for c in causes] == sorted(c["weak"] for c in causes), causes
    for weak in (False, True):  # each best first; an identity may follow a setting that separates as well (TIE)
        scores = [c["score"] for c in causes if c["weak"] == weak]
        assert all(b <= a + TIE for a, b in zip(scores, scores[1:])), causes
    if causes and causes[0]["kind"] == "attribute" and not causes[0]["weak"]:
        name = causes[0]["name"]
        assert conventions.is_comparable(name) and not conventions.is_measurement(name), report["summary"]
    if report.get("baseline"):
        assert report["baseline"]["request_id"] in report["summary"], report["summary"]
    if report.get("diverged") and causes and all(c["weak"] for c in causes) and report["first_divergent_stage"]:
        assert "no recorded setting or hardware signal differs" in report["summary"], report["summary"]


@pytest.fixture(autouse=True)
def _every_explanation_is_checked(monkeypatch):
    """Every report that any test gets from ``Explainer.explain`` is checked with ``_check_verdict``."""
    from stagetrace.analysis.explain import Explainer

    explain = Explainer.explain

    def checked(self, *args, **kwargs):
        report = explain(self, *args, **kwargs)
        _check_verdict(report.to_json())
        return report

    monkeypatch.setattr(Explainer, "explain", checked)
