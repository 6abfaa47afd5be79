"""A request's model named only on a child span, not on its root (issue 51).

An application's root span often names no model, and the engine's or framework's span below it does (OpenInference's
LLM span under a chain, a decode span under an app's request). The model is part of a request's peer key, so it is
read from the root rows, else from the decode span, else the earliest stage span naming one
(``conventions.requests_sql``). Built from the class of case: one service serving two models on the same prompts
(a shadow deployment: the same input digests), each model named only on its decode span; the second is busier and
answers differently by design. No request takes its baseline from the other model, and every answer for the first
equals its answer with the store holding it alone.
"""

from __future__ import annotations

import pytest

from tests import fleet

from stagetrace import conventions
from stagetrace.analysis import divergences, live, population
from stagetrace.store import open_store

SECOND = fleet.SECOND
SINCE_NS = 24 * 3600 * SECOND
SERVICE, LARGE, SMALL = "gen", "acme-70b", "acme-8b"
HOSTS, STALE, INDEX = ["h1", "h2", "h3", "h4"], "h3", "retrieval.index.version"


def answers(store, requests: list[str], of: set[str]) -> dict:
    """explain's answer for ``requests`` and divergences' entries for the requests in ``of``."""
    explained = fleet.explained(store, requests)
    found = divergences.find(store, SINCE_NS, limit=None)
    entries = fleet.entries(found, lambda d: d["request_id"] in of)
    baselines = {d["request_id"]: d["baseline_request_id"] for g in found["groups"] for d in g["deviating"]}
    return {"explain": explained, "divergences": entries, "baselines": baselines}


def _large(large: fleet.Fleet) -> fleet.Fleet:
    """The large model's traffic on ``large``: one request every 15 s over 40 minutes across the hosts, the stale
    host's answering otherwise from retrieval on (its index setting differs)."""
    for i, t, host in fleet.timeline(large.at(0), large.at(40), 15 * SECOND, HOSTS):
        stale = {INDEX: "v40"} if host == STALE else {}
        large.request(
            f"large-{i:04d}",
            t,
            host,
            prompt=(i // len(HOSTS)) % 4,
            settings=stale,
            differs={"retrieval": "v40"} if stale else {},
        )
    large.flush()
    return large


@pytest.fixture(scope="module")
def shadowed(tmp_path_factory):
    """(the large model's answers alone, with the shadow, the live analyser's rows, both fleets)."""
    with open_store(f"chdb://{tmp_path_factory.mktemp('child-model') / 'store'}") as store:
        large = _large(fleet.Fleet(store, service=SERVICE, model=LARGE, model_on="decode"))
        mine = set(large.requests)
        sample = sorted(mine)[::3]
        alone = answers(store, sample, mine)
        # the shadow: the same service, the same prompts (the input digest leaves the model out), another model
        # named on its decode span only, three times as busy and answering otherwise at decode
        small = fleet.Fleet(store, large.t0, service=SERVICE, model=SMALL, model_on="decode")
        for i, t, host in fleet.timeline(small.at(0), small.at(40), 5 * SECOND, ["s1", "s2", "s3"]):
            small.request(f"small-{i:04d}", t, host, prompt=i % 4, differs={"decode": "8b"})
        small.flush()
        live.Analyser(store, live.Schedule(settle_s=0, lookback_s=3 * 3600)).step()
        rows = dict(
            store.client.query(
                "SELECT RequestId, BaselineRequestId FROM {db:Identifier}.stagetrace_divergences FINAL",
                parameters={"db": store.database},
            ).result_rows
        )
        models = {d.request_id: d.model for d in population.deviations(store, large.at(-60), large.at(60))}
        together = answers(store, sample, mine)
    return alone, together, rows, models, large, small


def test_the_model_alone_is_answered_right(shadowed):
    """The premise: alone, the stale host's requests deviate at retrieval, named by their index."""
    alone, _, _, _, large, _ = shadowed
    stale = [rid for rid in alone["explain"] if large.requests[rid]["host"] == STALE]
    assert stale
    for rid in stale:
        diverged, stage, _, top = alone["explain"][rid]
        assert diverged and (stage, top[2], top[3]) == ("retrieval", INDEX, "v40"), (rid, stage, top)


def test_the_model_is_read_from_the_child_span(shadowed):
    _, _, _, models, large, small = shadowed
    assert models, "no deviation found"
    for rid, model in models.items():
        assert model == (LARGE if rid in large.requests else SMALL), (rid, model)


def _assert_unmoved(alone: dict, together: dict) -> None:
    """Every request's answer with the neighbours in the store is its answer alone."""
    moved = {
        rid: (alone.get(rid), together.get(rid))
        for rid in set(alone) | set(together)
        if alone.get(rid) != together.get(rid)
    }
    assert not moved, f"{len(moved)} of {len(alone)} moved, e.g. {sorted(moved.items())[:3]}"


@pytest.mark.parametrize("view", ["explain", "divergences"])
def test_the_shadow_model_never_moves_an_answer(shadowed, view):
    alone, together, _, _, _, _ = shadowed
    _assert_unmoved(alone[view], together[view])


def test_no_baseline_is_the_other_models(shadowed):
    """divergences', explain's and the live analyser's baselines are all of the request's own model."""
    _, together, rows, _, large, _ = shadowed

    def same_model(rid: str, baseline: str | None) -> bool:
        return not baseline or (rid in large.requests) == (baseline in large.requests)

    pairs = [*together["baselines"].items(), *rows.items(), *((rid, e[2]) for rid, e in together["explain"].items())]
    assert len(pairs) > 20
    crossed = [(rid, base) for rid, base in pairs if not same_model(rid, base)]
    assert not crossed, crossed[:5]


def test_the_sql_rule_is_the_python_twin(store):
    """The root's model wins over a child span's; without one, the decode span's wins over an earlier span's, else
    the earliest: ``request_model`` and ``requests_sql(model=True)`` agree."""
    cases = {  # request ID -> (model on the root, extra attributes of stage spans)
        "root-wins": ("on-root", {"decode": {"gen_ai.request.model": "on-decode"}}),
        "decode-wins": (
            None,
            {"retrieval": {"llm.model_name": "embedder"}, "decode": {"gen_ai.response.model": "on-decode"}},
        ),
        "earliest-else": (None, {"cache": {"llm.model_name": "second"}, "retrieval": {"llm.model_name": "first"}}),
        "none": (None, {}),
    }
    fl = fleet.Fleet(store, model_on="none-of-its-stages")
    for i, (rid, (root, extra)) in enumerate(cases.items()):
        fl.request(rid, fl.at(i), "h1", root={"gen_ai.request.model": root} if root else None, extra=extra)
    fl.flush()
    sql = conventions.requests_sql("1", "{db:Identifier}.stagetrace_requests", model=True)
    found = dict(
        store.client.query(f"SELECT RequestId, Model FROM ({sql})", parameters={"db": store.database}).result_rows
    )
    # the same rule for a set of traces, as the contrast reads it
    traces = "SELECT TraceId FROM {db:Identifier}.stagetrace_requests"
    by_trace = dict(
        store.client.query(
            f"SELECT r.RequestId, m.Model FROM ({sql}) AS r LEFT JOIN ("
            f"{conventions.trace_models_sql(traces, '1', '{db:Identifier}.stagetrace_requests')}) AS m USING (TraceId)",
            parameters={"db": store.database},
        ).result_rows
    )
    assert by_trace == found
    for rid, (root, extra) in cases.items():
        recorded = fl.requests[rid]
        stages = [
            (s["stage"], recorded["start_ns"] + k, {str(a): str(v) for a, v in s["attributes"].items()}, {})
            for k, s in enumerate(recorded["stages"])
        ]
        twin = conventions.request_model([({"gen_ai.request.model": root} if root else {}, {})], stages)
        assert found[rid] == twin, (rid, found[rid], twin)
    assert [found[r] for r in cases] == ["on-root", "on-decode", "first", ""]


# An application's root of one service above an engine's span of another service that names the model: the model is
# counted under the request's service (the root's), not the engine's. The application serves two models on the same
# prompts (a shadow deployment), each named only on its engine's decode span, the second busier and answering
# otherwise from retrieval on by design; a neighbour service names its own model on its root and records the same
# setting names with values of its own.
APP, NEIGHBOUR = "chat", "search"


def _contrast(store, fl):
    """The retrieval contrast of the first model's requests (their peer key), as explain reads it, and the models
    counted under each service."""
    found = population.models_by_service(store, fl.at(-60), fl.at(60))
    contrast = population.contrast(store, "retrieval", [INDEX], fl.at(-60), fl.at(60), peer=(APP, LARGE))
    return contrast, {service: set(models) for service, models in found.items()}


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    """(the large model's answers and contrast alone, the same with the shadow and the neighbour, the large fleet)."""
    with open_store(f"chdb://{tmp_path_factory.mktemp('engine-model') / 'store'}") as store:
        large = _large(fleet.Fleet(store, service=APP, model=LARGE, model_on="decode", model_service="vllm-large"))
        mine = set(large.requests)
        sample = sorted(mine)[::3]
        alone = answers(store, sample, mine), *_contrast(store, large)
        small = fleet.Fleet(store, large.t0, service=APP, model=SMALL, model_on="decode", model_service="sglang-small")
        for i, t, host in fleet.timeline(small.at(0), small.at(40), 5 * SECOND, ["s1", "s2", "s3"]):
            small.request(f"small-{i:04d}", t, host, prompt=i % 4, differs={"retrieval": "8b", "decode": "8b"})
        small.flush()
        neighbour = fleet.Fleet(store, large.t0, service=NEIGHBOUR, model="other-13b")
        for i, t, host in fleet.timeline(neighbour.at(0), neighbour.at(40), 10 * SECOND, ["n1", "n2"]):
            neighbour.request(f"search-{i:04d}", t, host, prompt=i % 4, settings={INDEX: "s7"})
        neighbour.flush()
        together = answers(store, sample, mine), *_contrast(store, large)
    return alone, together, large


def test_the_engines_model_alone_is_answered_right(engines):
    """The premise: alone, the stale host's requests deviate at retrieval, named by their index, and the contrast of
    the request's peer key (its application's service and the engine's model) is found."""
    (alone, contrast, _), _, large = engines
    stale = [rid for rid in alone["explain"] if large.requests[rid]["host"] == STALE]
    assert stale and contrast is not None
    assert contrast.counts[(INDEX, "v40")][1] > 0, contrast.counts
    for rid in stale:
        diverged, stage, _, top = alone["explain"][rid]
        assert diverged and (stage, top[2], top[3]) == ("retrieval", INDEX, "v40"), (rid, stage, top)


def test_the_engines_other_model_is_no_peer(engines):
    """The contrast counts the first model's spans only: the same spans, diverged or not, as alone."""
    (_, alone, _), (_, together, _), _ = engines
    assert together is not None
    assert (together.counts, together.prior, together.explained) == (alone.counts, alone.prior, alone.explained)


@pytest.mark.parametrize("view", ["explain", "divergences"])
def test_the_engines_other_model_never_moves_an_answer(engines, view):
    (alone, _, _), (together, _, _), _ = engines
    _assert_unmoved(alone[view], together[view])


def test_a_model_is_counted_under_the_requests_service(engines):
    """The application's service counts the models its requests resolve to, though only the engines' spans name
    them; an engine's service counts the model its spans name."""
    (_, _, alone), (_, _, together), _ = engines
    assert alone == {APP: {LARGE}, "vllm-large": {LARGE}}
    assert together == {APP: {LARGE, SMALL}, "vllm-large": {LARGE}, "sglang-small": {SMALL}, NEIGHBOUR: {"other-13b"}}


def test_a_service_whose_requests_name_one_model_below_the_root_has_one(store):
    """Every request names its model on its decode span only: the service has one model, not the roots' '' beside
    it (the contrast then reads no span's model); a service whose requests name none has ''."""
    below = fleet.Fleet(store, service=SERVICE, model=LARGE, model_on="decode")
    rooted = fleet.Fleet(store, below.t0, service=NEIGHBOUR, model=SMALL)
    unnamed = fleet.Fleet(store, below.t0, service="plain", model_on="none-of-its-stages")
    for i, fl in enumerate((below, rooted, unnamed) * 3):
        fl.request(f"{fl.service}-{i}", below.at(i), "h1")
    for fl in (below, rooted, unnamed):
        fl.flush()
    found = population.models_by_service(store, below.at(-60), below.at(60))
    assert {s: set(m) for s, m in found.items()} == {SERVICE: {LARGE}, NEIGHBOUR: {SMALL}, "plain": {""}}
