"""A tensor-parallel group whose host fails mid-run: the Grafana rule and the Fabric dashboard's TP panels.

The class of case: a TP=4 group over two hosts (ranks 0-1 on one, 2-3 on the other) serves requests; then one
host stops reporting and the group's requests carry only the other host's rank spans. Spans are written by the
plain OpenTelemetry SDK through ``ClickHouseSpanExporter`` into a real embedded store, each host with its own
resource, and the queries run as Grafana sends them (``tests.grafana_macros.expand``).
"""

from __future__ import annotations

import json
from datetime import datetime, timedelta, timezone

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from stagetrace import conventions as st
from stagetrace.dashboards import alert_rules, build_all
from tests.grafana_macros import ALL, QueryContext, Variable, expand
from stagetrace.exporters.clickhouse import ClickHouseSpanExporter

T0 = datetime(2026, 12, 1, 12, 0, tzinfo=timezone.utc)
RULE = next(rule for rule in alert_rules.RULES if rule.uid == "stagetrace-tp-group-degraded")


def serve(store, minutes: int, start: datetime, hosts_alive: tuple[str, ...]) -> None:
    """A request every 5 s for ``minutes``; each runs its all-reduce on ranks 0-1 (node-a) and 2-3 (node-b),
    of which only the ranks of ``hosts_alive`` report. Exported in one batch."""
    exporter = InMemorySpanExporter()
    providers = {}
    for host in ("node-a", "node-b"):
        providers[host] = TracerProvider(resource=Resource.create({"service.name": "tp-svc", "host.name": host}))
        providers[host].add_span_processor(SimpleSpanProcessor(exporter))
    root_tracer = providers["node-a"].get_tracer("app")
    for second in range(0, minutes * 60, 5):
        at = int((start + timedelta(seconds=second)).timestamp() * 1e9)
        root = root_tracer.start_span(
            "inference.request", start_time=at, attributes={st.REQUEST_ID: f"tp-{start:%H%M}-{second}"}
        )
        context = trace.set_span_in_context(root)
        for rank, host in enumerate(("node-a", "node-a", "node-b", "node-b")):
            if host in hosts_alive:
                span = (
                    providers[host]
                    .get_tracer("app")
                    .start_span(
                        "allreduce",
                        context=context,
                        start_time=at + 1000,
                        attributes={st.STAGE: "allreduce", st.TP_RANK: rank, st.TP_SIZE: 4},
                    )
                )
                span.end(end_time=at + 2_000_000)
        root.end(end_time=at + 5_000_000)
    writer = ClickHouseSpanExporter(store=store, spool_dir=False, create_schema=False)
    assert writer.export(exporter.get_finished_spans()).name == "SUCCESS"
    for provider in providers.values():
        provider.shutdown()


def rows(store, sql: str, since: datetime, until: datetime) -> list[dict]:
    hosts = Variable(ALL, options=("node-a", "node-b"))  # the dashboard's host variable at "All"
    sql = expand(sql, QueryContext(since, until), {"host": hosts})
    result = json.loads(store.client.raw_query(sql, fmt="JSONCompact"))
    names = [column["name"] for column in result["meta"]]
    return [dict(zip(names, row)) for row in result["data"]]


def test_a_host_that_fails_mid_run_degrades_its_tp_group_and_is_last_seen_first(store):
    store.client.database = store.database  # as the data source connects: its default database
    serve(store, 5, T0, ("node-a", "node-b"))
    failed_at = T0 + timedelta(minutes=5)
    serve(store, 5, failed_at, ("node-a",))  # node-b is gone: its ranks' spans no longer arrive

    healthy = rows(store, RULE.sql, failed_at - timedelta(seconds=RULE.window_s), failed_at)
    assert healthy == [{"service": "tp-svc", "head": "node-a", "hosts": "node-a node-b", "missing_ranks": 0}]
    assert all(r["missing_ranks"] <= RULE.threshold for r in healthy)  # no alert while the group is whole

    degraded = rows(
        store,
        RULE.sql,
        failed_at + timedelta(minutes=5) - timedelta(seconds=RULE.window_s),
        failed_at + timedelta(minutes=5),
    )
    assert degraded == [
        {"service": "tp-svc", "head": "node-a", "hosts": "node-a", "missing_ranks": 1}
    ]  # fires: above 0.01

    panels = {panel["title"]: panel for panel in build_all()["stagetrace-fabric"]["panels"]}
    last_seen = rows(store, panels["TP hosts, last seen"]["targets"][0]["rawSql"], T0, failed_at + timedelta(minutes=5))
    assert [r["host"] for r in last_seen] == ["node-b", "node-a"]  # the failed host is the one last seen first
    assert last_seen[0]["last_seen"] < failed_at.strftime("%Y-%m-%d %H:%M:%S") <= last_seen[1]["last_seen"]
    assert (last_seen[0]["ranks"], last_seen[1]["ranks"]) == ("2 3", "0 1")
    missing = rows(
        store, panels["Requests missing TP ranks"]["targets"][0]["rawSql"], T0, failed_at + timedelta(minutes=5)
    )
    before = {r["host"]: r["missing"] for r in missing if r["time"] < failed_at.strftime("%Y-%m-%d %H:%M:%S")}
    after = {r["host"]: r["missing"] for r in missing if r["time"] >= failed_at.strftime("%Y-%m-%d %H:%M:%S")}
    assert before == {"node-a": 0, "node-b": 0} and after == {"node-a": 1}
