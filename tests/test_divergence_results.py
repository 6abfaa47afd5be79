"""The divergence analysis' results are data (``analysis.results``): ``divergences.compute`` returns them and stores
nothing, ``divergences.record`` stores one row per analysed request, and ``divergences.find``'s JSON (what
``stagetrace divergences --json`` prints) is the report's own ``to_json``.

The class of case: two faults at once in one fleet, each the other's neighbour (a stale index on one host, other
weights on another, later), so each request's fields must carry its own stage and cause. The fleet is recorded
through the span exporter into a real store (``tests/fleet.py``); what is asserted is derived from how it was built.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

from stagetrace.analysis import divergences

_spec = importlib.util.spec_from_file_location("stagetrace_tests_fleet", Path(__file__).with_name("fleet.py"))
fleet = sys.modules.get(_spec.name) or importlib.util.module_from_spec(_spec)
if _spec.name not in sys.modules:
    sys.modules[_spec.name] = fleet
    _spec.loader.exec_module(fleet)

INDEX, STEP = "retrieval.index.version", "model.weights.step"
STORED_SQL = """
SELECT RequestId, FirstDivergentStage, TopCauseName, BaselineRequestId
FROM {db:Identifier}.stagetrace_divergences FINAL"""


def _two_faults(store):
    """Hosts a..d, two prompts served three times a minute per host for six minutes: host a's index is stale in
    minutes 0-2 (retrieval differs), host c serves other weights in minutes 3-5 (decode differs). (the fleet, the
    request IDs of each fault)."""
    fl = fleet.Fleet(store)
    stale, weights = [], []
    n = 0
    for minute in range(6):
        for k in range(3):
            for host in "abcd":
                for prompt in range(2):
                    request_id = f"q{n}"
                    if host == "a" and minute < 3:
                        settings, differs = {INDEX: "v40"}, {"retrieval": "stale"}
                        stale.append(request_id)
                    elif host == "c" and minute >= 3:
                        settings, differs = {STEP: 1100}, {"decode": "w"}
                        weights.append(request_id)
                    else:
                        settings, differs = None, None
                    fl.request(
                        request_id,
                        fl.at(minute, seconds=20 * k + n % 20),
                        host,
                        prompt=prompt,
                        settings=settings,
                        differs=differs,
                    )
                    n += 1
    fl.flush()
    return fl, stale, weights


def _stored(store) -> set[tuple]:
    return set(store.client.query(STORED_SQL, parameters={"db": store.database}).result_rows)


def test_the_report_is_data_that_record_stores_and_find_prints(store):
    fl, stale, weights = _two_faults(store)
    until = max(r["end_ns"] for r in fl.requests.values()) + fleet.MINUTE
    since = until - fl.t0 + fleet.MINUTE

    report = divergences.compute(store, since, until_ns=until, limit=None)
    by_id = {d.request_id: d for d in report.requests}
    assert set(by_id) == set(stale) | set(weights)
    assert report.analysed == len(by_id) == report.deviating
    assert {(by_id[r].stage, by_id[r].top.name, by_id[r].host) for r in stale} == {("retrieval", INDEX, "a")}
    assert {(by_id[r].stage, by_id[r].top.name, by_id[r].host) for r in weights} == {("decode", STEP, "c")}
    assert all(
        d in next(g for g in report.groups if g.input_digest == d.input_digest).deviating for d in report.requests
    )  # each request is in its input's group
    assert _stored(store) == set()  # computing stores nothing

    divergences.record(store, report)
    assert _stored(store) == {(d.request_id, d.stage, d.top.name, d.baseline.request_id) for d in report.requests}

    printed = divergences.find(store, since, until_ns=until, limit=None)
    assert json.dumps(printed) == json.dumps(report.to_json())  # the same keys, in the same order
    assert [i["request_id"] for g in printed["groups"] for i in g["deviating"]] == [
        d.request_id for g in report.groups for d in g.deviating
    ]
