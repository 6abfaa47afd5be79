"""Shared fixtures: a real embedded store per test, and real components from Debian's packages.

Tests that need a component (promtool, node_exporter, ethtool, ip) ask for it with
``component("promtool", package="prometheus")``: it is installed with apt when the tests run as
root with apt available; otherwise the test skips with the reason, except under ``CI=true``,
where a missing component fails the run.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

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
        subprocess.run(["apt-get", "install", "-y", "-qq", package], check=True, env=env, capture_output=True, timeout=900)
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
def store_dsn(tmp_path):
    return f"chdb://{tmp_path / 'store'}"


@pytest.fixture
def store(store_dsn):
    """A real embedded ClickHouse store with the schema, closed after the test (chdb allows one path per process)."""
    with open_store(store_dsn) as s:
        yield s


@pytest.fixture(autouse=True)
def _reset_tracing():
    yield
    stagetrace.shutdown()


@pytest.fixture(scope="session")
def demo_dsn(tmp_path_factory):
    """A store filled once per test session by ``stagetrace demo --requests 300`` (the dashboards' and rules' data)."""
    dsn = f"chdb://{tmp_path_factory.mktemp('demo') / 'store'}"
    done = subprocess.run([sys.executable, "-m", "stagetrace", "demo", "--requests", "300", "--store", dsn, "--json"],
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    assert done.returncode == 0, done.stderr
    return dsn


@pytest.fixture(scope="module")
def demo_store(demo_dsn):
    """The demo's store, open for one test module, with the data source's default database set."""
    with open_store(demo_dsn) as store:
        store.client.database = store.database
        yield store
