"""Divergence analysis against the demo's ground truth, across several seeds.

The demo records which fault changed which request's output (and in which stage); ``divergences``
and ``explain`` must find the same stage and name the injected cause first. Two kinds of ground truth
are no deviation and must not be reported as one: the expected changes of the context template's
rollout wave, and the requests of the tenant that samples without a seed. The confusion table is
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

SEEDS = (1, 2, 3, 4, 5)
REQUESTS = 800
DEVIATION_CAUSES = 10  # the seven original faults, a stale weight step, sequence errors on a remote TP host's NIC,
# another attention backend
SINCE_NS = 10 * 24 * 3600 * 10**9


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """seed → (store DSN, request ID → truth row); the seeds' demos run side by side."""
    started = {}
    for seed in SEEDS:
        dsn = f"chdb://{tmp_path_factory.mktemp(f'seed{seed}') / 'store'}"
        started[seed] = (
            dsn,
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "stagetrace",
                    "demo",
                    "--requests",
                    str(REQUESTS),
                    "--seed",
                    str(seed),
                    "--json",
                    "--store",
                    dsn,
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            ),
        )
    out = {}
    for seed, (dsn, proc) in started.items():
        stdout, stderr = proc.communicate(timeout=600)
        assert proc.returncode == 0, stderr
        out[seed] = (dsn, {t["request_id"]: t for t in json.loads(stdout)["truth"]})
    return out


def _deviations(truth: dict) -> dict:
    return {rid: t for rid, t in truth.items() if not (t["expected"] or t["nondeterministic"])}


@pytest.fixture(scope="module")
def found(runs):
    """seed → request ID → what ``divergences`` reported for it."""
    out = {}
    for seed, (dsn, _) in runs.items():
        with open_store(dsn) as store:
            groups = divergences.find(store, SINCE_NS, limit=None)["groups"]
        out[seed] = {d["request_id"]: d for g in groups for d in g["deviating"]}
    return out


def test_first_stage_and_top_cause_match_the_ground_truth(runs, found):
    confusion: Counter = Counter()
    stage_right = cause_right = total = off = 0
    wrong_sets = []
    for seed, (_, truth) in runs.items():
        deviations = _deviations(truth)
        items = found[seed]
        missed, extra = set(deviations) - set(items), set(items) - set(deviations)
        for request_id, expected in deviations.items():
            got = items.get(request_id, {})
            top = (got.get("top_cause") or {}).get("name")
            stage_right += got.get("first_divergent_stage") == expected["stage"]
            cause_right += top == expected["cause"]
            confusion[(expected["cause"], top if request_id in items else "(not reported)")] += 1
            total += 1
        for request_id in extra:
            label = truth[request_id]["cause"] if request_id in truth else "(no fault)"
            confusion[(label + (" (expected)" if truth.get(request_id, {}).get("expected") else ""), "(reported)")] += 1
        off += len(missed) + len(extra)
        if missed or extra:
            wrong_sets.append(
                f"seed {seed}: {len(missed)} missed {dict(Counter(deviations[r]['cause'] for r in missed))}, "
                f"{len(extra)} reported without a fault"
            )
    print(
        f"\n{total} deviating requests over seeds {SEEDS}: first stage {stage_right / total:.1%}, top cause {cause_right / total:.1%}"
    )
    for (expected, got), n in sorted(confusion.items(), key=lambda kv: -kv[1]):
        print(f"  injected {expected:34} ranked first {got!s:34} {n}")
    # The demo's clock is simulated, so this is the same on every run of a seed. The truth says the fleet moved
    # with the first request of the host that made a rollout most hosts; the analysis dates the move by that
    # request's stage span but puts requests in epochs by their root span, which starts a few ms earlier, so that
    # one request is compared with the old epoch (seed 2: one request of the small-context host, at the template's
    # move, missed); nothing else may differ.
    assert off <= 0.01 * total, "the deviating requests are those with an injected fault: " + "; ".join(wrong_sets)
    assert len({cause for cause, got in confusion if got != "(reported)"}) == DEVIATION_CAUSES, (
        "every kind of fault is in the test"
    )
    assert stage_right / total >= 0.98
    assert cause_right / total >= 0.95


def test_rollout_and_unseeded_requests_are_no_deviations(runs, found):
    for seed, (_, truth) in runs.items():
        expected = {rid for rid, t in truth.items() if t["expected"]}
        nondeterministic = {rid for rid, t in truth.items() if t["nondeterministic"]}
        assert expected and nondeterministic, f"seed {seed}: the run has both kinds"
        # the template's wave, and on the index the lagging host's first requests after the fleet moved (the
        # wave's slower half, ``analysis.rollouts``)
        assert "context.template.version" in {truth[rid]["cause"] for rid in expected}
        assert {truth[rid]["cause"] for rid in expected} <= {"context.template.version", "retrieval.index.version"}
        assert not expected & set(found[seed]), f"seed {seed}: expected changes of the rollout reported as deviations"
        assert not nondeterministic & set(found[seed]), f"seed {seed}: requests sampled without a seed reported"


def test_explain_agrees_with_divergences_on_one_request_of_each_cause(runs):
    dsn, truth = runs[SEEDS[0]]
    per_cause = {}
    for request_id, expected in _deviations(truth).items():
        per_cause.setdefault(expected["cause"], request_id)
    with open_store(dsn) as store:
        explainer = Explainer(store)
        for cause, request_id in per_cause.items():
            report = explainer.explain(request_id).to_json()
            assert report["diverged"] and report["first_divergent_stage"] == truth[request_id]["stage"]
            assert report["causes"][0]["name"] == cause, report["summary"]


def test_explain_calls_a_rollout_wave_expected_and_unseeded_sampling_nondeterministic(runs):
    dsn, truth = runs[SEEDS[0]]
    rollout = next(rid for rid, t in truth.items() if t["expected"] and t["cause"] == "context.template.version")
    unseeded = next(rid for rid, t in truth.items() if t["nondeterministic"])
    with open_store(dsn) as store:
        explainer = Explainer(store)
        report = explainer.explain(rollout).to_json()
        assert report["expected"] is True, report["summary"]
        assert (report["causes"][0]["kind"], report["causes"][0]["name"]) == ("rollout", "context.template.version")
        report = explainer.explain(unseeded).to_json()
        assert report["nondeterministic"] is True, report["summary"]
