"""The dashboards and the Grafana alert rules on a store whose tables the Collector created, in each generation.

Grafana runs their SQL without stagetrace, so they must work on either generation of the Collector's tables as
they are (``tests/test_collector_generations.py`` says what differs). The demo writes its spans and samples into a
store where the Collector's DDL of one generation created the span, trace-ID and metric tables first (samples
become whole seconds in the current one), or of its JSON attribute layout (``json: true``, tests/fixtures/collector_json); then every query of every dashboard, expanded as the data source does,
and every Grafana-managed rule, after one pass of the live analyser, runs on it with the checks the tests of a
store stagetrace created apply (``tests/test_dashboards.py``, ``tests/test_alert_rules.py``).
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from datetime import timedelta, timezone
from pathlib import Path

import pytest

from stagetrace.analysis import live
from stagetrace.dashboards import alert_rules, build_all
from tests.grafana_macros import QueryContext, expand
from stagetrace.store import open_store


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"stagetrace_tests_{name}", Path(__file__).with_name(f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


generations = _load("test_collector_generations")
dashboard_checks = _load("test_dashboards")
rule_checks = _load("test_alert_rules")
DASHBOARDS = build_all()


@pytest.fixture(scope="module", params=(*generations.GENERATIONS, "json"))
def collector_demo(request, tmp_path_factory):
    """The demo's store on the Collector's tables of one generation, after one pass of the live analyser."""
    dsn = f"chdb://{tmp_path_factory.mktemp(request.param) / 'store'}"
    with open_store(dsn, create_schema=False) as bare:
        bare.client.command("CREATE DATABASE IF NOT EXISTS stagetrace")
        for statement in generations.collector_statements(request.param):
            bare.client.command(statement)
    done = subprocess.run(
        [sys.executable, "-m", "stagetrace", "demo", "--requests", "300", "--store", dsn, "--json"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    with open_store(dsn) as store:
        store.client.database = store.database
        want = "DateTime64(9)" if request.param == "previous" else "DateTime"  # json: the current Map metric tables
        assert generations.column_type(store, "otel_metrics_gauge", "TimeUnix") == want
        assert live.Analyser(store, live.Schedule(settle_s=0, lookback_s=7200)).step().analysed > 0
        yield store


def test_every_dashboard_query_runs_on_each_generation(collector_demo):
    ((first, last),) = collector_demo.client.query("SELECT min(Timestamp), max(Timestamp) FROM otel_traces").result_rows
    window = QueryContext(
        first.replace(tzinfo=timezone.utc) - timedelta(minutes=1),
        last.replace(tzinfo=timezone.utc) + timedelta(minutes=1),
        interval_ms=1000,
    )
    metrics = {
        r[0]
        for r in collector_demo.client.query(
            "SELECT DISTINCT MetricName FROM otel_metrics_gauge UNION DISTINCT SELECT DISTINCT MetricName FROM otel_metrics_sum"
        ).result_rows
    }
    request_id = dashboard_checks.truth_request(collector_demo, "gpu_xid_errors_total")
    failures, ran = [], 0
    for uid, dashboard in sorted(DASHBOARDS.items()):
        for what, kind, sql, item in dashboard_checks.queries(dashboard):
            try:
                names, types, rows = dashboard_checks.run(
                    collector_demo, expand(sql, window, dashboard_checks.all_selected(request_id))
                )
            except Exception as exc:
                failures.append(f"{uid} / {what}: {str(exc).splitlines()[0]}")
                continue
            ran += 1
            failures += [f"{uid} / {what}: {p}" for p in dashboard_checks.column_problems(kind, names, types, item)]
            if not rows and not dashboard_checks.may_be_empty(sql, metrics):
                failures.append(f"{uid} / {what}: no rows, although the demo wrote the data it reads")
    assert ran > 50 and not failures, "\n".join(failures)


@pytest.mark.parametrize("rule", alert_rules.RULES, ids=lambda r: r.uid)
def test_every_grafana_rule_runs_on_each_generation(rule, collector_demo):
    names, types, rows = rule_checks._evaluate(collector_demo, rule)
    numeric = [n for n, t in zip(names, types) if rule_checks.NUMERIC.match(t)]
    assert len(numeric) == 1 and rows, (names, types)
