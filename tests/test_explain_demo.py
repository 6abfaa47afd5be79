"""Divergence analysis against the demo's ground truth, across several seeds.

The demo records which fault changed which request's output (and in which stage); ``divergences``
and ``explain`` must find the same stage and name the injected cause first. The confusion table is
printed (``pytest -s`` shows it).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter

import pytest

from stagetrace.analysis import divergences
from stagetrace.analysis.explain import Explainer
from stagetrace.store import open_store

SEEDS = (1, 2, 3)
REQUESTS = 800


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = {}
    for seed in SEEDS:
        dsn = f"chdb://{tmp_path_factory.mktemp(f'seed{seed}') / 'store'}"
        done = subprocess.run([sys.executable, "-m", "stagetrace", "demo", "--requests", str(REQUESTS), "--seed",
                               str(seed), "--json", "--store", dsn], capture_output=True, text=True, timeout=300)  # fmt: skip
        assert done.returncode == 0, done.stderr
        out[seed] = (dsn, {t["request_id"]: t for t in json.loads(done.stdout)["truth"]})
    return out


def test_first_stage_and_top_cause_match_the_ground_truth(runs):
    confusion: Counter = Counter()
    stage_right = cause_right = total = 0
    for dsn, truth in runs.values():
        with open_store(dsn) as store:
            found = divergences.find(store, 10 * 24 * 3600 * 10**9, limit=None)
        items = {d["request_id"]: d for g in found["groups"] for d in g["deviating"]}
        assert set(items) == set(truth), "the deviating requests are exactly those with an injected fault"
        for request_id, expected in truth.items():
            got = items[request_id]
            top = (got["top_cause"] or {}).get("name")
            stage_right += got["first_divergent_stage"] == expected["stage"]
            cause_right += top == expected["cause"]
            confusion[(expected["cause"], top)] += 1
            total += 1
    print(f"\n{total} deviating requests over seeds {SEEDS}: first stage {stage_right / total:.1%}, top cause {cause_right / total:.1%}")
    for (expected, got), n in sorted(confusion.items(), key=lambda kv: -kv[1]):
        print(f"  injected {expected:34} ranked first {got!s:34} {n}")
    assert len({cause for cause, _ in confusion}) == 7, "every kind of fault is in the test"
    assert stage_right / total >= 0.95
    assert cause_right / total >= 0.90


def test_explain_agrees_with_divergences_on_one_request_of_each_cause(runs):
    dsn, truth = runs[SEEDS[0]]
    per_cause = {}
    for request_id, expected in truth.items():
        per_cause.setdefault(expected["cause"], request_id)
    with open_store(dsn) as store:
        explainer = Explainer(store)
        for cause, request_id in per_cause.items():
            report = explainer.explain(request_id)
            assert report["diverged"] and report["first_divergent_stage"] == truth[request_id]["stage"]
            assert report["causes"][0]["name"] == cause, report["summary"]
