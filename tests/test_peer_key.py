"""The peer key (issue 51): which requests are compared with each other besides the input digest, and how an
operator changes it (``STAGETRACE_PEER_KEY``); the SQL twin of the candidate rule the contrast explains away with."""

from __future__ import annotations


import pytest

from tests import fleet

from stagetrace import config, conventions
from stagetrace.analysis import divergences
from stagetrace.analysis.explain import Explainer

SECOND = fleet.SECOND


def test_the_key_is_read_from_the_environment_and_checked(monkeypatch):
    monkeypatch.delenv(config.ENV_PEER_KEY, raising=False)
    assert config.peer_key() == conventions.DEFAULT_PEER_KEY == ("service.name", "gen_ai.request.model")
    assert config.peer_key(" gen_ai.request.model ") == ("gen_ai.request.model",)
    assert config.peer_key("gen_ai.request.model,service.name") == conventions.DEFAULT_PEER_KEY  # in one order
    assert config.peer_key("none") == ()
    monkeypatch.setenv(config.ENV_PEER_KEY, "service.name")
    assert config.peer_key() == ("service.name",)
    with pytest.raises(ValueError, match="host.name is not a peer key part"):
        config.peer_key("host.name")


def _pool(store) -> fleet.Fleet:
    """Two services on one model pool: ``chat`` on three hosts, ``search`` on one whose index is stale."""
    chat = fleet.Fleet(store, service="chat")
    for i, t, host in fleet.timeline(chat.at(0), chat.at(20), 10 * SECOND, ["a", "b", "c"]):
        chat.request(f"chat-{i:03d}", t, host, prompt=i % 4)
    search = fleet.Fleet(store, chat.t0, service="search")
    for i, t, host in fleet.timeline(search.at(0), search.at(20), 30 * SECOND, ["d"]):
        search.request(
            f"search-{i:03d}",
            t,
            host,
            prompt=i % 4,
            settings={"retrieval.index.version": "v40"},
            differs={"retrieval": "v40"},
        )
    chat.flush()
    search.flush()
    return search


def test_services_are_not_each_others_peers_unless_the_key_says_so(store, monkeypatch):
    search = _pool(store)
    rid = sorted(search.requests)[5]
    monkeypatch.delenv(config.ENV_PEER_KEY, raising=False)
    report = Explainer(store).explain(rid).to_json()
    assert not report["diverged"] and report["baseline"]["request_id"].startswith("search-")
    found = divergences.find(store, 24 * 3600 * SECOND, limit=None)
    assert found["deviating"] == 0 and not found["tally"]

    monkeypatch.setenv(config.ENV_PEER_KEY, "gen_ai.request.model")  # one model pool: its services are peers
    report = Explainer(store).explain(rid).to_json()
    top = report["causes"][0]
    assert report["diverged"] and report["baseline"]["request_id"].startswith("chat-")
    assert (report["first_divergent_stage"], top["name"], top["value"]) == (
        "retrieval",
        "retrieval.index.version",
        "v40",
    )
    found = divergences.find(store, 24 * 3600 * SECOND, limit=None)
    assert found["deviating"] == len(search.requests)
    assert [(t["service"], t["cause"], t["requests"]) for t in found["tally"]] == [
        ("search", "retrieval.index.version", len(search.requests))
    ]


def test_the_candidate_rule_in_sql_is_the_roles_in_python(store):
    keys = [
        "gpu.model",
        "engine.attention.impl",
        "host.name",
        "gpu.uuid",
        "retrieval.doc_ids",
        "decode.ttft_ms",
        "gen_ai.usage.input_tokens",
        "stagetrace.stage",
        "telemetry.sdk.version",
        "process.pid",
        "cache.hit",
        "stagetrace.request.id",
        "input.value",
        "retrieval.documents.0.document.id",
        "allreduce.bytes",
        "parallel.tp_rank",
        "model.weights.step",
        "acme.whatever",
    ]
    rows = store.client.query(
        f"SELECT k, {conventions.candidate_sql('k')} FROM (SELECT arrayJoin({{keys:Array(String)}}) AS k)",
        parameters={"keys": keys},
    ).result_rows
    assert {k: bool(v) for k, v in rows} == {
        k: conventions.is_comparable(k) and not conventions.is_measurement(k) for k in keys
    }
    assert {"gpu.model", "engine.attention.impl", "host.name", "acme.whatever"} <= {k for k, v in rows if v}
