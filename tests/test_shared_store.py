"""A store shared by a fleet's services: neighbours never move a service's answers (issue 51).

One service's traffic (``rag``: a host on a stale index, a host whose all-reduce algorithm changed, a template
rolled out to every host) is analysed alone; then three neighbours are written into the same store, over the same
hours, and every answer for ``rag`` must stay what it was: stage, cause kind, name, value and baseline.
- a shadow deployment of another model on the same prompts (the same input digests), busier than ``rag``;
- a service with the same setting names and other values (another index, another all-reduce algorithm) and a
  rollout of its own under the same attribute name as ``rag``'s fault;
- a canary of the same model on the same host names, with a fault of its own and its own rollout of ``rag``'s
  template setting to another value.
Built from the class of case (docs/design.md#what-the-baseline-must-respect, "A store is shared, and faults
overlap"), not from any demo.
"""

from __future__ import annotations


import pytest

from tests import fleet

from stagetrace.analysis import divergences, live
from stagetrace.store import open_store

MINUTE, SECOND = fleet.MINUTE, fleet.SECOND
SINCE_NS = 24 * 3600 * SECOND
HOSTS = ["h1", "h2", "h3", "h4", "h5"]
STALE, ALGORITHM, TEMPLATE, INDEX = "h3", "h5", "context.template.version", "retrieval.index.version"


def first_service(fl: fleet.Fleet) -> None:
    """``rag``: h3 serves a stale index all along; h5's all-reduce moves to another algorithm at minute 40; the
    template t3 → t4 reaches the hosts one a minute from minute 30."""
    for i, t, host in fleet.timeline(fl.at(0), fl.at(60), 15 * SECOND, HOSTS):
        settings, differs = {}, {}
        if host == STALE:
            settings[INDEX], differs["retrieval"] = "v40", "v40"
        if t >= fl.at(30 + HOSTS.index(host)):
            settings[TEMPLATE], differs["context_assembly"] = "t4", "t4"
        if host == ALGORITHM and t >= fl.at(40):
            settings["allreduce.algorithm"], differs["allreduce"] = "tree", "tree"
        fl.request(f"rag-{i:04d}", t, host, prompt=i % 4, settings=settings, differs=differs)


def neighbours(store, t0: int) -> None:
    # (a) another model on the same prompts: the same input digests, other outputs, more of them than rag's
    shadow = fleet.Fleet(store, t0, service="rag-shadow", model="acme-8b")
    for i, t, host in fleet.timeline(shadow.at(0), shadow.at(60), 6 * SECOND, ["s1", "s2", "s3"]):
        shadow.request(f"shadow-{i:04d}", t, host, prompt=i % 4, differs={"decode": "8b"})
    # (b) the same setting names with other values, and a rollout of its own of the index rag's stale host lags on
    batch = fleet.Fleet(store, t0, service="batch")
    for i, t, host in fleet.timeline(batch.at(0), batch.at(60), 20 * SECOND, ["b1", "b2", "b3", "b4"]):
        index = "v8" if t >= batch.at(20 + ["b1", "b2", "b3", "b4"].index(host)) else "v7"
        batch.request(
            f"batch-{i:04d}",
            t,
            host,
            prompt=i % 4,
            settings={INDEX: index, "allreduce.algorithm": "tree", TEMPLATE: "t9"},
            differs={"retrieval": index, "context_assembly": "t9", "allreduce": "tree"},
        )
    # (c) a canary of the same model on rag's own host names: another KV-cache dtype on two of them, and its own
    # rollout of rag's template setting to another value, earlier than rag's
    canary = fleet.Fleet(store, t0, service="rag-canary")
    for i, t, host in fleet.timeline(canary.at(0), canary.at(60), 20 * SECOND, HOSTS):
        settings, differs = {}, {}
        if t >= canary.at(10 + HOSTS.index(host)):
            settings[TEMPLATE], differs["context_assembly"] = "t5", "t5"
        if host in ("h1", "h2"):
            settings["decode.kv_cache_dtype"], differs["decode"] = "fp8", "fp8"
        canary.request(f"canary-{i:04d}", t, host, prompt=i % 4, settings=settings, differs=differs)
    for fl in (shadow, batch, canary):
        fl.flush()


def answers(store, requests: list[str]) -> dict:
    """Every answer the analysis gives for ``rag``'s requests: explain's, divergences' entries, its rollouts and its
    lines of the tally."""
    explained = fleet.explained(store, requests)
    found = divergences.find(store, SINCE_NS, limit=None)
    entries = fleet.entries(found, lambda d: d["service"] == fleet.SERVICE)
    rolled = sorted(
        (r["stage"], r["name"], r["old"], r["new"], r["hosts"], r["of_hosts"], tuple(r["lagging"]), r["requests"])
        for r in found["rollouts"]
        if r["service"] == fleet.SERVICE
    )
    tally = sorted(
        (t["cause"], t["stage"], t["requests"], tuple(t["hosts"]))
        for t in found["tally"]
        if t["service"] == fleet.SERVICE
    )
    sentences = sorted((r["service"], r["summary"]) for r in found["rollouts"])  # every service's, neighbours' too
    return {"explain": explained, "divergences": entries, "rollouts": rolled, "tally": tally, "sentences": sentences}


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """(rag's answers alone, with the neighbours, the live analyser's rows with them, rag's request IDs)."""
    with open_store(f"chdb://{tmp_path_factory.mktemp('shared') / 'store'}") as store:
        fl = fleet.Fleet(store)
        first_service(fl)
        fl.flush()
        rag = sorted(fl.requests)[::3]  # explained one by one: a third of them, every host and prompt among them
        alone = answers(store, rag)
        neighbours(store, fl.t0)
        # the live analyser first, on the shared store: its rows, not those divergences.find writes after it
        live.Analyser(store, live.Schedule(settle_s=0, lookback_s=3 * 3600)).step()
        rows = store.client.query(
            "SELECT RequestId, FirstDivergentStage, TopCauseName, TopCauseValue, BaselineRequestId "
            "FROM {db:Identifier}.stagetrace_divergences FINAL",
            parameters={"db": store.database},
        ).result_rows
        together = answers(store, rag)
    return alone, together, {r[0]: r[1:] for r in rows}, fl


def test_the_first_service_alone_is_answered_right(shared):
    """The premise: alone, the stale host is named by its index, h5 by its algorithm, the rollout as one."""
    alone, _, _, fl = shared
    for rid, (diverged, stage, _, top) in alone["explain"].items():
        host, start = fl.requests[rid]["host"], fl.requests[rid]["start_ns"]
        if host == STALE:
            assert diverged and (stage, top[2], top[3]) == ("retrieval", INDEX, "v40"), (rid, stage, top)
        elif host == ALGORITHM and start >= fl.at(41) and fl.requests[rid]["prompt"] != 0:
            assert diverged and (stage, top[2], top[3]) == ("allreduce", "allreduce.algorithm", "tree"), (rid, top)
    assert [r[1:6] for r in alone["rollouts"]] == [(TEMPLATE, "t3", "t4", len(HOSTS), len(HOSTS))]
    by_cause = {(t[0], t[1]): t[2] for t in alone["tally"]}
    assert by_cause[(INDEX, "retrieval")] >= 40 and by_cause[("allreduce.algorithm", "allreduce")] >= 10


@pytest.mark.parametrize("view", ["explain", "divergences", "rollouts", "tally"])
def test_neighbours_never_move_an_answer(shared, view):
    alone, together, _, _ = shared
    if view in ("explain", "divergences"):
        moved = {
            rid: (alone[view].get(rid), together[view].get(rid))
            for rid in set(alone[view]) | set(together[view])
            if alone[view].get(rid) != together[view].get(rid)
        }
        assert not moved, f"{len(moved)} of {len(alone[view])} moved, e.g. {sorted(moved.items())[:3]}"
    else:
        assert together[view] == alone[view]


def test_a_rollout_names_its_service(shared):
    """Services in one store roll out settings under the same names: each rollout's sentence says whose it is."""
    _, together, _, _ = shared
    assert len({service for service, _ in together["sentences"]}) >= 2, together["sentences"]
    for service, sentence in together["sentences"]:
        assert f" hosts of {service} (expected change)" in sentence, sentence


def test_one_analysis_in_a_shared_store(shared):
    """explain, divergences and the live analyser give the same stage and cause for every deviating request."""
    _, together, rows, _ = shared
    compared = [rid for rid in together["divergences"] if rid in together["explain"]]
    assert len(compared) >= 20
    for rid in compared:
        stage, _, top = together["divergences"][rid]
        report = together["explain"][rid]
        assert (report[1], report[3][2] if report[3] else None) == (stage, top[2] if top else None), rid
        if rid in rows:
            assert (rows[rid][0], rows[rid][1]) == (stage, top[2] if top else ""), (rid, rows[rid])
