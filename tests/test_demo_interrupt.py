"""``stagetrace demo`` interrupted by a real Ctrl-C (SIGINT to its whole process group, as a terminal sends it), and
``--fresh`` beside another service's requests: what a person sees, and what the store holds afterwards.

Every run goes through the real command line into a real embedded store, next to the quickstart example's requests.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from stagetrace.demo import RUNS_TABLE, SERVICES
from stagetrace.demo.pipeline import SERVICE_NAME
from stagetrace.store import open_store

ROOT = Path(__file__).resolve().parents[1]
SMALL = ("--requests", "40", "--nodes", "2")


@pytest.fixture
def home(tmp_path):
    """A user's environment whose default store holds the quickstart's three requests (service ``quickstart``)."""
    env = {**os.environ, "XDG_DATA_HOME": str(tmp_path / "data"), "HOME": str(tmp_path)}
    env.pop("STAGETRACE_STORE", None)
    done = subprocess.run(
        [sys.executable, ROOT / "examples" / "quickstart.py"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    return env, f"chdb://{tmp_path / 'data' / 'stagetrace' / 'store'}"


def _stagetrace(env, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "stagetrace", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        cwd=env["HOME"],
    )


def _group(pgid: int) -> list[int]:
    """The live processes of a process group (zombies left to init to reap are not running)."""
    live = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(fields[2]) == pgid and fields[0] != "Z":
            live.append(int(entry.name))
    return live


def _interrupt(env, when: str, *args: str) -> tuple[subprocess.Popen, str, float]:
    """Start a demo of 1000 requests in a process group of its own, Ctrl-C it ``when`` ("starting": 0.3 s in, while
    it imports and opens the store; "serving": once its nodes and their TP ranks run), and return the process, its
    stderr, and the seconds from the signal to its exit."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "stagetrace", "demo", "--requests", "1000", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=env["HOME"],
        start_new_session=True,
    )
    if when == "starting":
        time.sleep(0.3)
    else:  # the parent, its nodes and the fabric process, and the ranks the nodes fork
        deadline = time.monotonic() + 120
        while len(_group(proc.pid)) < 8 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        assert proc.poll() is None, "the demo ended before it was interrupted"
        time.sleep(0.5)
    sent = time.monotonic()
    os.killpg(proc.pid, signal.SIGINT)
    try:
        _, stderr = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    took = time.monotonic() - sent
    deadline = time.monotonic() + 2
    while _group(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _group(proc.pid) == [], "a process of the demo outlived it"
    return proc, stderr, took


def _pipeline_requests(dsn: str) -> int:
    with open_store(dsn) as store:
        return store.client.command(
            "SELECT count() FROM stagetrace.stagetrace_requests WHERE ServiceName = {s:String}",
            parameters={"s": SERVICE_NAME},
        )


def _quickstart_is_there(env) -> None:
    found = _stagetrace(env, "trace", "quickstart-0001", "--json")
    assert found.returncode == 0, found.stderr
    assert json.loads(found.stdout)["service"] == "quickstart"


@pytest.mark.parametrize("when", ["starting", "serving"])
def test_ctrl_c_is_one_line_130_and_the_next_demo_runs_without_fresh(home, when):
    env, dsn = home
    proc, stderr, took = _interrupt(env, when)
    assert proc.returncode == 130, stderr  # the exit status, not the death by SIGINT (which a shell shows as 130 too)
    assert took < 2, f"{took:.2f} s from Ctrl-C to exit"
    assert len(stderr.splitlines()) == 1 and stderr.startswith("stagetrace demo: interrupted"), stderr
    assert "Traceback" not in stderr
    with open_store(dsn) as store:
        states = (
            store.client.query(
                f"SELECT Run, argMax(State, Updated) FROM stagetrace.{RUNS_TABLE} GROUP BY Run"
            ).result_rows
            if when == "serving"
            else []
        )
    if when == "serving":  # the store says what the rows it holds are
        assert [state for _, state in states] == ["interrupted"]
        assert "marks this run as interrupted" in stderr
    again = _stagetrace(env, "demo", *SMALL, "--json")
    assert again.returncode == 0, again.stderr
    if when == "serving":
        assert again.stderr.strip() == "stagetrace demo: removed the data of 1 earlier demo run that did not complete"
    assert _pipeline_requests(dsn) == 40  # nothing of the interrupted run is left beside the new one
    with open_store(dsn) as store:
        tagged = store.client.command(
            "SELECT uniqExact(ResourceAttributes['stagetrace.demo.run']) FROM "
            "stagetrace.otel_traces WHERE ServiceName != 'quickstart'"
        )
    assert tagged == 1
    _quickstart_is_there(env)


def test_python_m_exits_with_the_status_after_an_interrupt_handled_inside_code_built_from_a_string(tmp_path):
    """A Ctrl-C that lands while a dataclass or namedtuple builds its methods (``exec`` of a string, during the
    imports) leaves a KeyboardInterrupt that CPython marks unhandled even once caught; ``python -m stagetrace`` still
    exits with the command's status, not by SIGINT. The interrupt is raised where such a Ctrl-C raises it, as its
    timing cannot be chosen."""
    (tmp_path / "interrupted_entry.py").write_text(
        "import contextlib, io, sys\n"
        "from stagetrace.__main__ import run\n"
        "sys.argv = ['stagetrace', 'schema', '--print']\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    run()  # imports what the command uses: their own code built from strings clears the mark\n"
        "try:\n"
        "    exec('raise KeyboardInterrupt')\n"
        "except KeyboardInterrupt:\n"
        "    pass\n"
        "sys.exit(run())\n"
    )
    done = subprocess.run(
        [sys.executable, "-m", "interrupted_entry"], capture_output=True, text=True, timeout=120, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    assert "CREATE TABLE" in done.stdout


def test_an_interrupted_appended_run_leaves_the_complete_earlier_run(home):
    env, dsn = home
    first = _stagetrace(env, "demo", *SMALL, "--json")
    assert first.returncode == 0, first.stderr
    proc, stderr, took = _interrupt(env, "serving", "--append")
    assert proc.returncode == 130 and took < 2 and len(stderr.splitlines()) == 1, stderr
    refused = _stagetrace(env, "demo", *SMALL)  # the earlier run is whole, and still refused without a flag
    assert refused.returncode == 2 and "already holds a demo run" in refused.stderr
    appended = _stagetrace(env, "demo", *SMALL, "--append", "--json")
    assert appended.returncode == 0, appended.stderr
    assert _pipeline_requests(dsn) == 80  # the earlier 40 and the appended 40: the interrupted run's are gone


def test_fresh_removes_only_the_demos_own_data(home):
    env, dsn = home
    with open_store(dsn) as store:
        before = store.client.query("SELECT count() FROM stagetrace.otel_traces").result_rows[0][0]
    assert _stagetrace(env, "demo", *SMALL).returncode == 0
    refused = _stagetrace(env, "demo", *SMALL)
    assert refused.returncode == 2
    assert (
        "add --fresh to remove it first (the demo's own spans, samples and ground truth; other services' data "
        "stays)" in refused.stderr
    )  # the refusal says what --fresh removes
    fresh = _stagetrace(env, "demo", *SMALL, "--fresh")
    assert fresh.returncode == 0, fresh.stderr
    _quickstart_is_there(env)
    assert _pipeline_requests(dsn) == 40
    with open_store(dsn) as store:
        quickstart = store.client.command("SELECT count() FROM stagetrace.otel_traces WHERE ServiceName = 'quickstart'")
        requests = store.client.command(
            "SELECT count() FROM stagetrace.stagetrace_requests WHERE ServiceName = 'quickstart'"
        )
        runs = store.client.command(f"SELECT uniqExact(Run) FROM stagetrace.{RUNS_TABLE}")
    assert quickstart == before and requests == 3 and runs == 1


def test_fresh_refuses_an_older_demos_rows_beside_other_data_and_names_it(home):
    """An older demo wrote no run ID: its rows are told from others' only by names another service may use too."""
    env, dsn = home
    assert _stagetrace(env, "demo", *SMALL).returncode == 0
    with open_store(dsn) as store:  # as an older demo left it: no runs table, no run IDs
        store.client.command(f"DROP TABLE stagetrace.{RUNS_TABLE}")
        for table in ("otel_traces", "otel_metrics_gauge", "otel_metrics_sum"):
            store.client.command(
                f"ALTER TABLE stagetrace.{table} UPDATE ResourceAttributes = "
                "mapFilter((k, v) -> k != 'stagetrace.demo.run', ResourceAttributes) WHERE 1",
                settings={"mutations_sync": 2},
            )
    refused = _stagetrace(env, "demo", *SMALL, "--fresh")
    assert refused.returncode == 2 and refused.stdout == ""
    line = refused.stderr.strip()
    assert len(line.splitlines()) == 1 and "quickstart (3 traces)" in line and "--fresh would not know" in line
    assert not any(f"{service} (" in line for service in SERVICES)  # only what is not the demo's is named
    _quickstart_is_there(env)
