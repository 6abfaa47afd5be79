"""otel-config.yaml: a well-formed Collector config whose ClickHouse exporter writes the tables `stagetrace schema` creates."""

import re
from pathlib import Path

import yaml

from stagetrace import schema
from stagetrace.exporters.clickhouse import AGENT_SERVICE
from stagetrace.exporters.otlp import DEFAULT_LISTEN as AGENT_OTLP
from stagetrace.exporters.otlp_grpc import DEFAULT_GRPC_LISTEN as AGENT_OTLP_GRPC
from stagetrace.exporters.prometheus import DEFAULT_LISTEN as AGENT_METRICS
from stagetrace.store import parse_dsn

CONFIG = yaml.safe_load((Path(__file__).resolve().parents[1] / "otel-config.yaml").read_text())
SECTIONS = {"receivers": "receivers", "processors": "processors", "exporters": "exporters"}


def test_every_pipeline_names_only_defined_components_and_every_component_is_used():
    pipelines = CONFIG["service"]["pipelines"]
    assert set(pipelines) == {"traces", "metrics", "logs"}
    used = {section: set() for section in SECTIONS}
    for name, pipeline in pipelines.items():
        assert pipeline["receivers"] and pipeline["exporters"], name
        for section in SECTIONS:
            for component in pipeline.get(section, []):
                assert component in CONFIG[section], f"pipeline {name} names undefined {section} {component}"
                used[section].add(component)
    for section in SECTIONS:
        assert used[section] == set(CONFIG[section]), f"defined but unused {section}"


def test_memory_limiter_first_and_batch_last_in_every_pipeline():
    for name, pipeline in CONFIG["service"]["pipelines"].items():
        assert pipeline["processors"][0] == "memory_limiter", name
        assert pipeline["processors"][-1] == "batch", name


def test_the_clickhouse_exporter_writes_the_database_and_tables_stagetrace_schema_creates():
    exporter = CONFIG["exporters"]["clickhouse"]
    created = set(re.findall(r"CREATE TABLE IF NOT EXISTS `(\w+)`\.`(\w+)`", ";".join(schema.statements())))
    database = parse_dsn("chdb:///tmp/x").database
    assert exporter["database"] == database == "stagetrace"
    assert exporter["create_schema"] is False
    written = {
        exporter["traces_table_name"],
        exporter["logs_table_name"],
        *(table["name"] for table in exporter["metrics_tables"].values()),
    }
    assert written == {"otel_traces", "otel_logs", "otel_metrics_gauge", "otel_metrics_sum"}
    assert {(database, table) for table in written} <= created
    assert exporter["metrics_tables"]["gauge"]["name"] == "otel_metrics_gauge"
    assert exporter["metrics_tables"]["sum"]["name"] == "otel_metrics_sum"
    # in cluster mode the canonical names are the Distributed tables, so the same config writes a fleet
    clustered = ";".join(schema.statements(cluster="fleet"))
    for table in written:
        assert re.search(
            rf"CREATE TABLE IF NOT EXISTS `stagetrace`\.`{table}` ON CLUSTER `fleet` .*Distributed", clustered
        )


def test_metric_types_without_a_table_are_dropped_before_the_exporter():
    metrics = CONFIG["service"]["pipelines"]["metrics"]["processors"]
    assert "filter/gauges_and_sums" in metrics
    dropped = CONFIG["processors"]["filter/gauges_and_sums"]["metrics"]["metric"]
    assert set(dropped) == {
        f"type == METRIC_DATA_TYPE_{kind}" for kind in ("HISTOGRAM", "EXPONENTIAL_HISTOGRAM", "SUMMARY")
    }
    assert not {"otel_metrics_histogram", "otel_metrics_summary", "otel_metrics_exp_histogram"} & set(
        schema.TABLE_NAMES
    )


def test_it_scrapes_the_agent_and_takes_otlp_where_senders_send_it():
    (job,) = CONFIG["receivers"]["prometheus"]["config"]["scrape_configs"]
    assert job["job_name"] == AGENT_SERVICE  # the ServiceName the agent's own writer gives its samples
    assert job["static_configs"][0]["targets"] == [AGENT_METRICS]
    # the agent's own ports, so the agent runs --otlp none --otlp-grpc none
    assert CONFIG["receivers"]["otlp"]["protocols"]["http"]["endpoint"] == AGENT_OTLP
    assert CONFIG["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"] == AGENT_OTLP_GRPC
    for protocol in CONFIG["receivers"]["otlp"]["protocols"].values():
        assert protocol["endpoint"].startswith("127.0.0.1:")  # loopback by default, as the agent
