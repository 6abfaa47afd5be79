"""A newcomer's first steps: ``stagetrace demo``, then ``examples/quickstart.py`` into the same store. The
quickstart's requests (another service, its own host, the demo's setting names with values of its own) move none of
the demo's answers (issue 51)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from stagetrace.analysis import divergences
from stagetrace.analysis.explain import Explainer
from stagetrace.store import open_store

ROOT = Path(__file__).resolve().parents[1]
SINCE_NS = 10 * 24 * 3600 * 10**9


def _top(cause: dict | None) -> tuple | None:
    return (cause["kind"], cause["stage"], cause["name"], cause["value"], cause["baseline_value"]) if cause else None


def _answers(dsn: str, explained: list[str], service: str) -> dict:
    with open_store(dsn) as store:
        found = divergences.find(store, SINCE_NS, limit=None)
        explainer = Explainer(store)
        reports = {rid: explainer.explain(rid).to_json() for rid in explained}
    return {
        "deviating": sum(t["requests"] for t in found["tally"] if t["service"] == service),
        "entries": {
            d["request_id"]: (d["first_divergent_stage"], d["baseline_request_id"], _top(d["top_cause"]))
            for g in found["groups"]
            for d in g["deviating"]
            if d["service"] == service
        },
        "rollouts": [r["summary"] for r in found["rollouts"] if r["service"] == service],
        "tally": sorted(
            (t["cause"], t["stage"], t["requests"], tuple(t["hosts"]))
            for t in found["tally"]
            if t["service"] == service
        ),
        "explain": {
            rid: (
                r["diverged"],
                r["first_divergent_stage"],
                r["baseline"]["request_id"] if r["baseline"] else None,
                _top(next((c for c in r["causes"] if not c["weak"]), None)),
            )
            for rid, r in reports.items()
        },
    }


def test_the_quickstart_beside_the_demo_moves_none_of_its_answers(tmp_path):
    dsn = f"chdb://{tmp_path / 'store'}"
    done = subprocess.run(
        [sys.executable, "-m", "stagetrace", "demo", "--requests", "300", "--store", dsn, "--json"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    truth = json.loads(done.stdout)["truth"]
    with open_store(dsn) as store:
        # the demo's pipeline: the service of most of its ground truth's requests
        (service,) = store.client.query(
            "SELECT ServiceName FROM {db:Identifier}.stagetrace_requests WHERE RequestId IN {ids:Array(String)} "
            "GROUP BY ServiceName ORDER BY count() DESC LIMIT 1",
            parameters={"db": store.database, "ids": [t["request_id"] for t in truth]},
        ).result_rows[0]
        every = [
            r
            for (r,) in store.client.query(
                "SELECT DISTINCT RequestId FROM {db:Identifier}.stagetrace_requests WHERE ServiceName = {s:String} "
                "ORDER BY RequestId",
                parameters={"db": store.database, "s": service},
            ).result_rows
        ]
    # every request the demo made deviate, and some that it did not
    faulty = [t["request_id"] for t in truth if t["request_id"] in set(every)]
    others = [r for r in every if r not in set(faulty)][::10]
    alone = _answers(dsn, faulty + others, service)
    assert alone["deviating"] > 20 and alone["rollouts"]

    quickstart = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "quickstart.py")],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "STAGETRACE_STORE": dsn},
    )
    assert quickstart.returncode == 0, quickstart.stderr
    together = _answers(dsn, faulty + others, service)
    for view in alone:
        assert together[view] == alone[view], view
