"""Divergence → cause on requests recorded with the span API into a real embedded store.

Each test builds a small population of requests with the same input, makes some deviate in a known
way (a stage, an attribute the analysis has never heard of, a counter on a device), and checks what
``explain`` and ``divergences`` conclude. Hardware samples are written in the metric writer's layout.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import pytest

import stagetrace
from stagetrace import lookup
from stagetrace.analysis import divergences
from stagetrace.analysis.explain import Explainer
from stagetrace.analysis.hardware import context
from stagetrace.exporters.clickhouse import SUM_COLUMNS
from stagetrace.tracing import PIPELINE_STAGES

PROMPT = {"prompt": "why is the sky blue?", "seed": 7, "model": "m"}


def record(
    store,
    request_id: str,
    host: str = "node-a",
    deviate_at: str | None = None,
    attributes: dict | None = None,
    gpu: str = "GPU-a",
    prompt=PROMPT,
) -> None:
    """One five-stage request; from ``deviate_at`` on, every stage's output differs from the agreeing ones'."""
    stagetrace.configure(store=store, host_name=host, service_name="rag")
    attributes = attributes or {}
    with stagetrace.request(request_id, input=prompt) as req:
        data, diverged = prompt["prompt"], False
        for name in PIPELINE_STAGES:
            attrs = {
                "acme.shard.layout": "rows",
                **({"gpu.uuid": gpu} if name == "decode" else {}),
                **({"net.rdma.devices": ["mlx5_0"]} if name == "allreduce" else {}),
                **attributes.get(name, {}),
            }
            with stagetrace.stage(name, input=data, attributes=attrs) as st:
                diverged = diverged or name == deviate_at
                data = f"{name}({data})" + ("*" if diverged else "")
                st.set_output(data)
        req.set_output(data)
    stagetrace.flush()


def sample(store, host: str, name: str, labels: dict, value: float, t_ns: int | None = None) -> None:
    t_ns = t_ns or time.time_ns()
    row = (
        {"host.name": host},
        "stagetrace-agent",
        "stagetrace.collectors",
        "",
        name,
        "",
        "",
        labels,
        t_ns - 10**12,
        t_ns,
        float(value),
        2,
        True,
    )
    store.client.insert("otel_metrics_sum", [row], column_names=SUM_COLUMNS, database=store.database)


def explain(store, request_id, against=None) -> dict:
    return Explainer(store).explain(request_id, against).to_json()


@pytest.mark.parametrize("stage", PIPELINE_STAGES)
def test_each_stage_as_origin_with_an_attribute_never_heard_of(store, stage):
    for i in range(4):
        record(store, f"ok-{i}", attributes={stage: {"acme.shard.layout": "rows"}})
    record(store, "odd", deviate_at=stage, attributes={stage: {"acme.shard.layout": "columns"}})
    report = explain(store, "odd")
    assert report["diverged"] and report["first_divergent_stage"] == stage
    assert report["baseline"]["how"] == "majority" and report["baseline"]["support"] == 4
    top = report["causes"][0]
    assert (top["kind"], top["stage"], top["name"], top["value"], top["baseline_value"]) == (
        "attribute",
        stage,
        "acme.shard.layout",
        "columns",
        "rows",
    )
    assert report["summary"] == (
        f"{stage} diverged: acme.shard.layout columns vs rows "
        f"(baseline: request {report['baseline']['request_id']}, 4 of 5 requests)"
    )
    assert not report["stage_input_differed"]


def test_hardware_only_cause_on_the_same_device(store):
    """No attribute differs: the XID counter rose on the request's GPU in its window, not in the baseline's."""
    labels = {"gpu": "0", "uuid": "GPU-a", "model": "H200", "xid": "48"}
    sample(store, "node-a", "gpu_energy_joules_total", {"gpu": "0", "uuid": "GPU-a", "model": "H200"}, 1)  # a scrape
    for i in range(3):
        record(store, f"ok-{i}")
    sample(store, "node-a", "gpu_energy_joules_total", {"gpu": "0", "uuid": "GPU-a", "model": "H200"}, 2)
    time.sleep(0.01)
    sample(store, "node-a", "gpu_xid_errors_total", labels, 1)  # the series is born at its first event
    sample(store, "node-a", "gpu_energy_joules_total", {"gpu": "0", "uuid": "GPU-a", "model": "H200"}, 3)
    record(store, "odd", deviate_at="decode")
    sample(store, "node-a", "gpu_xid_errors_total", labels, 1)
    report = explain(store, "odd")
    assert report["first_divergent_stage"] == "decode"
    assert [c["kind"] for c in report["causes"]] == ["hardware"], "no attribute differs"
    top = report["causes"][0]
    assert (top["name"], top["value"], top["baseline_value"], top["device"]) == (
        "gpu_xid_errors_total",
        "+1",
        "+0",
        "GPU-a",
    )
    # the XID's first sample was written before "odd" started: the sentence says so, not "while it ran"
    assert re.match(
        r"decode diverged: gpu_xid_errors_total rose by 1 in the [\d.]+ m?s before decode started "
        r"on GPU-a \(node-a\), not for the baseline",
        report["summary"],
    ), report["summary"]
    # the trace lookup shows the same hardware context, and none for a request before the XID
    [rise] = context(store, lookup.by_request_id(store, "odd"))
    assert (rise["stage"], rise["device"], rise["metric"], rise["labels"]["xid"], rise["increase"]) == (
        "decode",
        "GPU-a",
        "gpu_xid_errors_total",
        "48",
        1.0,
    )
    assert context(store, lookup.by_request_id(store, "ok-0")) == []


def test_counter_reset_inside_the_window_is_not_a_negative_increase(store):
    nic = {"device": "mlx5_0", "port": "1"}
    for i in range(3):
        record(store, f"ok-{i}", host="node-b")
    sample(store, "node-a", "rdma_local_ack_timeout_err_total", nic, 4_294_967_290)  # a 32-bit counter near its wrap
    sample(store, "node-a", "rdma_local_ack_timeout_err_total", nic, 4_294_967_292)
    record(store, "odd", host="node-a", deviate_at="allreduce")
    sample(store, "node-a", "rdma_local_ack_timeout_err_total", nic, 3)  # wrapped (or the driver reloaded)
    report = explain(store, "odd")
    hardware = [c for c in report["causes"] if c["kind"] == "hardware"]
    assert [(c["name"], c["value"]) for c in hardware] == [("rdma_local_ack_timeout_err_total", "+5")]  # 2 + 3
    assert report["causes"][0]["name"] == "rdma_local_ack_timeout_err_total"


def test_agreeing_request_says_so(store):
    for i in range(3):
        record(store, f"ok-{i}")
    report = explain(store, "ok-1")
    assert report["diverged"] is False and report["causes"] == []
    assert report["baseline"]["how"] == "majority"
    assert (
        report["summary"]
        == f"the output agrees with the baseline (baseline: request {report['baseline']['request_id']}, 3 of 3 requests)"
    )


def test_request_with_no_peers(store):
    record(store, "alone", prompt={**PROMPT, "prompt": "something nobody else asked"})
    record(store, "other")
    report = explain(store, "alone")
    assert report["diverged"] is False and report["baseline"] is None
    assert "nothing to compare" in report["summary"]


def test_against_an_explicit_request_and_the_nearest_earlier_one(store):
    record(store, "first")
    record(store, "second", deviate_at="cache", attributes={"cache": {"cache.policy": "lru"}})
    explicit = explain(store, "second", against="first")
    assert explicit["baseline"] == {"request_id": "first", "how": "explicit", "support": 1, "group_size": 1}
    assert explicit["first_divergent_stage"] == "cache"
    assert explicit["causes"][0]["name"] == "cache.policy"
    nearest = explain(store, "second")  # one each: no majority
    assert nearest["baseline"]["how"] == "nearest_earlier" and nearest["baseline"]["request_id"] == "first"
    with pytest.raises(lookup.NotFound, match="--against"):
        explain(store, "second", against="nope")


def test_divergences_groups_and_persists(store):
    for i in range(4):
        record(store, f"ok-{i}")
    record(store, "odd", deviate_at="context_assembly", attributes={"context_assembly": {"context.max_tokens": 512}})
    found = divergences.find(store, 3600 * 10**9)
    assert found["deviating"] == 1
    [group] = found["groups"]
    [item] = group["deviating"]
    assert (group["support"], group["requests"], item["request_id"], item["first_divergent_stage"]) == (
        4,
        5,
        "odd",
        "context_assembly",
    )
    assert item["top_cause"]["name"] == "context.max_tokens"
    rows = store.client.query(
        "SELECT RequestId, FirstDivergentStage, TopCauseName, TopCauseValue, BaselineHow FROM {db:Identifier}.stagetrace_divergences FINAL",
        parameters={"db": store.database},
    ).result_rows
    assert rows == [("odd", "context_assembly", "context.max_tokens", "512", "majority")]
    divergences.find(store, 3600 * 10**9)
    count = store.client.command(
        "SELECT count() FROM {db:Identifier}.stagetrace_divergences FINAL", parameters={"db": store.database}
    )
    assert count == 1, "re-running replaces the rows"


def _cli(*args, store_dsn):
    return subprocess.run(
        [sys.executable, "-m", "stagetrace", *args, "--store", store_dsn], capture_output=True, text=True, timeout=120
    )


def test_cli_explain_json_unknown_id_and_agreeing(store_dsn):
    from stagetrace.store import open_store

    with open_store(store_dsn) as store:
        for i in range(3):
            record(store, f"ok-{i}")
        record(store, "odd", deviate_at="retrieval", attributes={"retrieval": {"retrieval.index.version": "v2"}})
        stagetrace.shutdown()
    done = _cli("explain", "odd", "--json", store_dsn=store_dsn)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert set(report) >= {
        "request_id",
        "trace_id",
        "baseline",
        "diverged",
        "first_divergent_stage",
        "causes",
        "summary",
    }
    assert report["causes"][0]["name"] == "retrieval.index.version"
    text = _cli("explain", "odd", store_dsn=store_dsn)
    assert text.returncode == 0 and "retrieval diverged: retrieval.index.version v2 vs (unset)" in text.stdout
    agreeing = _cli("explain", "ok-0", store_dsn=store_dsn)
    assert agreeing.returncode == 0 and "agrees" in agreeing.stdout
    unknown = _cli("explain", "no-such-request", store_dsn=store_dsn)
    assert unknown.returncode == 1 and "no request with id 'no-such-request'" in unknown.stderr
    assert len(unknown.stderr.strip().splitlines()) == 1
    bad = _cli("divergences", "--since", "yesterday", store_dsn=store_dsn)
    assert bad.returncode == 2 and "--since" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1


def test_divergences_with_nothing_in_its_window_names_the_since_that_finds_the_older_requests(store_dsn):
    """A store whose requests ran two and a half hours ago: the default hour shows 0 deviating requests and says, in
    one line on stderr, how old the latest is and which --since covers it (the latest and an hour before it, where
    its peers are); with that --since the deviating one is found.
    Neighbour: a window that holds requests which all agree gets no such line (0 is then the answer)."""
    from stagetrace.store import open_store
    from tests.fleet import Fleet

    with open_store(store_dsn) as store:
        fleet = Fleet(store, start_ns=time.time_ns() - 151 * 60 * 10**9)  # the latest 2.5 h ago: off an hour's edge
        for i in range(4):
            fleet.request(f"old-{i}", fleet.at(0, 10 * i), "node-a")
        fleet.request("old-odd", fleet.at(1), "node-a", differs={"decode": "x"})
        fleet.flush()
    empty = _cli("divergences", store_dsn=store_dsn)
    assert empty.returncode == 0 and empty.stdout.startswith("0 deviating requests in the last 1h"), empty.stdout
    [hint] = empty.stderr.strip().splitlines()
    found = re.fullmatch(
        r"stagetrace divergences: no request in the last 1h; the store's latest started "
        r"([\d.]+) h ago: try --since (\d+)h",
        hint,
    )
    assert found and 2.4 <= float(found[1]) <= 2.6 and found[2] == "4", hint
    wider = _cli("divergences", "--since", f"{found[2]}h", "--json", store_dsn=store_dsn)
    assert wider.returncode == 0 and wider.stderr == "", wider.stderr
    assert [i["request_id"] for g in json.loads(wider.stdout)["groups"] for i in g["deviating"]] == ["old-odd"]

    with open_store(store_dsn) as store:
        recent = Fleet(store, start_ns=time.time_ns() - 10 * 60 * 10**9)
        for i in range(3):
            recent.request(f"new-{i}", recent.at(0, 10 * i), "node-b")
        recent.flush()
    agreeing = _cli("divergences", store_dsn=store_dsn)
    assert agreeing.returncode == 0 and agreeing.stderr == "", agreeing.stderr
