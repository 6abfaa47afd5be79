"""Alert rules: Prometheus rules under promtool, Grafana-managed rules on the demo's data, metric names.

The Prometheus rules are checked and unit-tested by Debian's promtool; the Grafana-managed rules run
against ClickHouse after the data source's macro expansion, as Grafana's alerting backend sends them.
"""

from __future__ import annotations

import importlib
import json
import re
import shutil
import subprocess
from datetime import timedelta, timezone
from pathlib import Path

import pytest
import yaml

from stagetrace import store_health
from stagetrace.analysis import live
from stagetrace.collectors import MODULES as COLLECTOR_MODULES
from stagetrace.collectors import gpm, gpu_tenants
from stagetrace.collectors.base import MetricSpec
from stagetrace.dashboards import alert_rules, build_all
from tests.grafana_macros import QueryContext, expand

RULES_DIR = Path(alert_rules.__file__).parent / "prometheus"
RULES = RULES_DIR / "hardware.rules.yml"
RULE_TESTS = RULES_DIR / "hardware.rules.test.yml"
EXPECTED_SCRAPE = Path(__file__).parent / "fixtures" / "node" / "expected.prom"
NUMERIC = re.compile(r"^(Nullable\()?(U?Int\d+|Float\d+)\)?$")
STRING = re.compile(r"^(LowCardinality\()?String\)?$")


def _rules() -> list[dict]:
    return [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]


def _alerts() -> dict[str, dict]:
    return {rule["alert"]: rule for rule in _rules() if "alert" in rule}


def _records() -> dict[str, dict]:
    """Recording rules (``level:metric:operations``), which the alerts read."""
    return {rule["record"]: rule for rule in _rules() if "record" in rule}


# ---------------------------------------------------------------------------------------------
# Prometheus rules


def test_promtool_checks_the_rules(component):
    promtool = component("promtool", package="prometheus")
    done = subprocess.run([promtool, "check", "rules", RULES], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"SUCCESS: {len(_alerts()) + len(_records())} rules found" in done.stdout


def test_promtool_unit_tests_pass(component):
    promtool = component("promtool", package="prometheus")
    done = subprocess.run(
        [promtool, "test", "rules", RULE_TESTS.name], cwd=RULES_DIR, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_every_rule_has_a_firing_and_a_non_firing_case():
    asked = {
        "StagetraceGpuLost",
        "StagetraceGpuXidError",
        "StagetraceGpuEccUncorrected",
        "StagetraceGpuThermalThrottling",
        "StagetraceRdmaAckTimeouts",
        "StagetraceRdmaRetransmitRate",
        "StagetraceRdmaPortDown",
        "StagetraceRdmaLinkDowned",
        "StagetraceNicPauseStorm",
        "StagetraceNicPfcPaused",
        "StagetraceMpsClientsHigh",
        "StagetraceCollectorFailing",
        "StagetraceRdmaRailsUnbalanced",
        "StagetraceRdmaLinkBelowPeers",
        "StagetraceRdmaLinkRenegotiatedDown",
        "StagetraceNodeDown",
        "StagetraceGpuAllocatedBeyondSharing",
        "StagetraceGpuDevicesDoubleCounted",
        "StagetraceDeviatingOutputs",
        "StagetraceAnalysisLagging",
        "StagetraceStoreBrokenParts",
        "StagetraceStoreRowsLost",
        "StagetraceGpuHung",
        "StagetraceGpuBeganDifferences",
    }
    assert set(_alerts()) == asked
    cases = [case for test in yaml.safe_load(RULE_TESTS.read_text())["tests"] for case in test["alert_rule_test"]]
    for alert in asked:
        outcomes = {bool(case["exp_alerts"]) for case in cases if case["alertname"] == alert}
        assert outcomes == {True, False}, f"{alert} needs a case where it fires and one where it does not"


def test_the_xid_case_fails_with_a_rule_that_only_uses_increase(component, tmp_path):
    """gpu_xid_errors_total series appear at their first event (value 1): increase() alone misses it."""
    promtool = component("promtool", package="prometheus")
    shutil.copy(RULE_TESTS, tmp_path)
    rules = yaml.safe_load(RULES.read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            if rule.get("alert") == "StagetraceGpuXidError":
                rule["expr"] = "increase(gpu_xid_errors_total[10m]) > 0"
    (tmp_path / RULES.name).write_text(yaml.safe_dump(rules))
    done = subprocess.run(
        [promtool, "test", "rules", RULE_TESTS.name], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert done.returncode != 0
    assert "alertname: StagetraceGpuXidError, time: 20m" in done.stdout + done.stderr


def test_the_began_differences_case_fails_with_a_rule_that_only_uses_increase(component, tmp_path):
    """A GPU's stagetrace_deviations_began_total series appears with its first requests already counted: increase()
    alone undercounts the hour that begins with it (GPU-b1's 4 requests read as 2)."""
    promtool = component("promtool", package="prometheus")
    shutil.copy(RULE_TESTS, tmp_path)
    rules = yaml.safe_load(RULES.read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            if rule.get("alert") == "StagetraceGpuBeganDifferences":
                rule["expr"] = "sum by (gpu, gpu_host) (increase(stagetrace_deviations_began_total[1h])) >= 3"
    (tmp_path / RULES.name).write_text(yaml.safe_dump(rules))
    done = subprocess.run(
        [promtool, "test", "rules", RULE_TESTS.name], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert done.returncode != 0
    assert "alertname: StagetraceGpuBeganDifferences, time: 21m" in done.stdout + done.stderr


# ---------------------------------------------------------------------------------------------
# Metric names: every name a rule or a dashboard uses is one the collectors expose


def collector_metric_names() -> set[str]:
    """Names of every MetricSpec in the collector modules' tables (dicts and tuples of specs included)."""
    names: set[str] = set()

    def walk(value, depth: int = 0) -> None:
        if isinstance(value, MetricSpec):
            names.add(value.name)
        elif depth < 3 and isinstance(value, dict):
            for item in value.values():
                walk(item, depth + 1)
        elif depth < 3 and isinstance(value, (tuple, list)):
            for item in value:
                walk(item, depth + 1)

    modules = [importlib.import_module(f"stagetrace.collectors.{m}") for m in ("base", *COLLECTOR_MODULES)]
    modules.append(gpu_tenants)  # the gpu collector's per-process and per-pod series
    names |= {metric.spec.name for metric in gpm.GPM_METRICS}  # the gpu collector's GPM series
    modules.append(live)  # the live analyser's own series
    modules.append(store_health)  # the store's health, which the agent checks
    for module in modules:
        for value in vars(module).values():
            walk(value)
    rdma = importlib.import_module("stagetrace.collectors.rdma")
    # hw_counters/<file> specs are made per file the driver has; the known mlx5 ones are described
    names |= {rdma.hw_counter_spec(file).name for file in rdma.HW_COUNTER_HELP}
    return names


def promql_metric_names(expr: str) -> set[str]:
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    expr = re.sub(r"\{[^}]*\}|\[[^\]]*\]", " ", expr)
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", expr)
    expr = re.sub(r"\boffset\s+\w+", " ", expr)
    words = set(re.findall(r"\b([a-zA-Z_:][a-zA-Z0-9_:]*)\b(?!\s*\()", expr))
    return words - {"and", "or", "unless", "bool"}


def sql_metric_names(sql: str) -> set[str]:
    found = set()
    for single, listed in re.findall(r"MetricName (?:= '([a-z0-9_]+)'|IN \(([^)]*)\))", sql):
        found |= {single} if single else set(re.findall(r"'([a-z0-9_]+)'", listed))
    return found


def test_promql_name_extraction():
    expr = (
        "(gpu_xid_errors_total unless gpu_xid_errors_total offset 10m) or "
        'max by (host, gpu) (rate(rdma_x_total{device=~"a|b"}[5m])) / on(host) y_total > 0.5'
    )
    assert promql_metric_names(expr) == {"gpu_xid_errors_total", "rdma_x_total", "y_total"}


PROMETHEUS_OWN = {"up"}


def _names_used() -> dict[str, set[str]]:
    rules = {**_alerts(), **_records()}
    # the names of recording rules are defined right there: the collectors' names are what they read
    # `up` is Prometheus' own: the scrape's outcome, which no exporter exposes
    used = {
        f"rule {name}": promql_metric_names(rule["expr"]) - set(_records()) - PROMETHEUS_OWN
        for name, rule in rules.items()
    }
    for uid, dashboard in build_all().items():
        sql = [v["query"]["rawSql"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
        sql += [t["rawSql"] for p in dashboard["panels"] for t in p.get("targets", [])]
        used[f"dashboard {uid}"] = set().union(*map(sql_metric_names, sql))
    return used


def test_every_metric_name_used_exists_in_the_collectors_specs():
    specs = collector_metric_names()
    used = _names_used()
    assert sum(map(len, used.values())) > 40  # the extraction found the names
    missing = {where: sorted(names - specs) for where, names in used.items() if names - specs}
    assert not missing, f"metric names no collector exposes: {missing}"


def test_every_metric_name_used_is_in_the_expected_scrape():
    if not EXPECTED_SCRAPE.exists():
        pytest.skip(f"{EXPECTED_SCRAPE} does not exist yet")
    scraped = {
        line.split("{")[0].split(" ")[0]
        for line in EXPECTED_SCRAPE.read_text().splitlines()
        if line and not line.startswith("#")
    }
    # Scrape durations are left out of the expected file as non-deterministic; their spec is checked above.
    scraped.add("stagetrace_collector_duration_seconds")
    # The live analyser's series join the agent's scrape when it analyses (tests/test_live_analysis.py scrapes them),
    # the store's health when the agent holds a store (tests/test_store_health.py scrapes it)
    for module in (live, store_health):
        scraped |= {spec.name for spec in vars(module).values() if isinstance(spec, MetricSpec)}
    # GPM's series are computed between two samples a scrape apart, and `collect --once` takes one: the fixture
    # node's scrape has gpu_gpm_supported alone (tests/test_collector_gpu_activity.py scrapes the series twice)
    scraped |= {metric.spec.name for metric in gpm.GPM_METRICS}
    missing = {where: sorted(names - scraped) for where, names in _names_used().items() if names - scraped}
    assert not missing, f"metric names missing from {EXPECTED_SCRAPE.name}: {missing}"


# ---------------------------------------------------------------------------------------------
# Grafana-managed rules on the demo's data


def _evaluate(store, rule: alert_rules.PipelineRule, later_s: int = 0) -> tuple[list[str], list[str], list[list]]:
    """The rule's query as Grafana's alerting sends it: its relative range ending now (the demo's end, or
    ``later_s`` after it)."""
    ((last,),) = store.client.query("SELECT max(Timestamp) FROM otel_traces").result_rows
    now = last.replace(tzinfo=timezone.utc) + timedelta(seconds=1 + later_s)
    sql = expand(rule.sql, QueryContext(now - timedelta(seconds=rule.window_s), now, interval_ms=1000))
    result = json.loads(store.client.raw_query(sql, fmt="JSONCompact"))
    return [c["name"] for c in result["meta"]], [c["type"] for c in result["meta"]], result["data"]


@pytest.fixture(scope="module")
def analysed(demo_store):
    """The demo's store after one pass of the live analyser, as a running agent makes it by itself."""
    done = live.Analyser(demo_store, live.Schedule(settle_s=0, lookback_s=7200)).step()
    assert done is not None and done.analysed > 0
    return demo_store


@pytest.mark.parametrize("rule", alert_rules.RULES, ids=lambda r: r.uid)
def test_grafana_rule_returns_labels_and_one_number(rule, analysed):
    assert not re.search(r"\$(?!__)\w|\$__conditionalAll", rule.sql), "alerting expands no dashboard variables"
    names, types, rows = _evaluate(analysed, rule)
    numeric = [n for n, t in zip(names, types) if NUMERIC.match(t)]
    labels = [n for n, t in zip(names, types) if STRING.match(t)]
    assert len(numeric) == 1 and len(labels) == len(names) - 1, dict(zip(names, types))
    assert rows, "the demo's traffic is enough to evaluate every rule"


@pytest.mark.parametrize("uid", ["stagetrace-deviating-outputs", "stagetrace-new-deviation-cause"])
def test_deviation_rules_name_stage_cause_and_an_example_request_of_it(uid, analysed):
    """One instance per (service, first divergent stage, top cause); its example request is one the demo's ground
    truth puts at that stage, and the trace lookup it links to finds it."""
    (rule,) = [r for r in alert_rules.RULES if r.uid == uid]
    names, _, rows = _evaluate(analysed, rule)
    found = [dict(zip(names, row)) for row in rows]
    assert len({(f["service"], f["stage"], f["cause"]) for f in found}) == len(found)
    truth = {
        request: stage
        for request, stage in analysed.client.query(
            "SELECT RequestId, Stage FROM stagetrace_demo_truth WHERE NOT Expected AND NOT Nondeterministic"
        ).result_rows
    }
    causes = {f["cause"] for f in found}
    assert {"retrieval.index.version", "model.weights.step", "allreduce.algorithm"} <= causes, causes
    placed = [f for f in found if truth.get(f["example_request"]) == f["stage"]]
    assert len(placed) >= 0.8 * len(found), found
    assert float(sum(float(f["deviating"]) for f in found)) > rule.threshold
    if uid == "stagetrace-deviating-outputs":
        index = next(f for f in found if f["cause"] == "retrieval.index.version")
        assert {index["value"], index["baseline_value"]} == {"v41", "v42"} and index["hosts"].startswith("gpu-node-")
        assert "{{ $labels.example_request }}" in rule.description and "{{ $labels.value }}" in rule.summary


def test_the_deviating_outputs_alert_keeps_its_labels_while_the_range_slides(analysed):
    """Grafana makes a rule's text columns labels, and new labels a new alert (and a new notification). One cause
    going on for a quarter of an hour: evaluated a minute apart, while its first request leaves the 15-minute
    range, it keeps the same labels (its example request and values are its first of the day)."""
    from stagetrace.analysis.divergences import COLUMNS

    (rule,) = [r for r in alert_rules.RULES if r.uid == "stagetrace-deviating-outputs"]
    store = analysed  # the session's demo store (one embedded store a process): three days after the demo, alone
    ((last,),) = store.client.query("SELECT max(Timestamp) FROM otel_traces").result_rows
    now = last.replace(tzinfo=timezone.utc, microsecond=0) + timedelta(days=3)
    rows = [
        (
            0,
            f"req-{m}",
            "t",
            int((now - timedelta(minutes=m)).timestamp() * 1e9),
            "chat",
            "gpu-c",
            "in",
            "b",
            "majority",
            "decode",
            "attribute",
            "engine.kv_cache_dtype",
            "fp8",
            "auto",
            0.9,
            "[]",
            "s",
            "GPU-c",
            "1",
            "GPU-c",
            "gpu-c1",
        )
        for m in (14, 5)
    ]
    store.client.insert("stagetrace_divergences", rows, column_names=COLUMNS, database=store.database)

    def labels(at: datetime) -> list:
        sql = expand(rule.sql, QueryContext(at - timedelta(seconds=rule.window_s), at, interval_ms=1000))
        return [row[:-1] for row in json.loads(store.client.raw_query(sql, fmt="JSONCompact"))["data"]]

    first, later = labels(now), labels(now + timedelta(minutes=2))  # req-14 is out of the range by then
    assert (
        first
        == later
        == [
            [
                "chat",
                "decode",
                "engine.kv_cache_dtype",
                "fp8",
                "auto",
                "gpu-c",
                "GPU-c",
                "rank 1 (GPU-c, gpu-c1)",
                "req-14",
            ]
        ]
    )
