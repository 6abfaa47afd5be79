import pytest

from stagetrace import schema


@pytest.mark.parametrize("cluster", [None, "gpu_fleet"])
def test_every_statement_parses_in_clickhouse(store, cluster):
    statements = schema.statements("stagetrace", cluster)
    for sql in statements:
        formatted = store.client.query("SELECT formatQuery({q:String})", parameters={"q": sql}).result_rows[0][0]
        assert formatted.startswith("CREATE")
    if cluster:
        assert all("ON CLUSTER `gpu_fleet`" in sql for sql in statements)
        engines = " ".join(statements)
        assert "ReplicatedMergeTree('/clickhouse/tables/{shard}/{database}/{table}', '{replica}')" in engines
        assert (
            "ReplicatedReplacingMergeTree('/clickhouse/tables/{shard}/{database}/{table}', '{replica}', DetectedAt)"
            in engines
        )
        for table in schema.TABLES:
            distributed = any(f"`{table.name}` ON CLUSTER" in s and "ENGINE = Distributed(" in s for s in statements)
            assert distributed is (table.engine != "Null"), table.name  # a Null table keeps nothing to distribute
        views = [s for s in statements if "MATERIALIZED VIEW" in s]
        assert views and all("`otel_traces_local`" in v or "`stagetrace_content_spans_local`" in v for v in views)


def test_schema_creation_is_idempotent_and_versioned(store):
    tables = set(store.client.query("SELECT name FROM system.tables WHERE database = 'stagetrace'").result_columns[0])
    assert set(schema.TABLE_NAMES) <= tables
    assert {"otel_traces_trace_id_ts_mv", "stagetrace_requests_mv"} <= tables
    assert schema.installed_version(store.client, "stagetrace") == schema.SCHEMA_VERSION
    assert schema.ensure_schema(store.client, "stagetrace") is False  # nothing left to do


def test_otel_traces_has_the_collector_columns(store):
    """The Collector's clickhouseexporter must be able to write the same table."""
    described = {
        r["name"]: r["type"] for r in store.client.query("DESCRIBE TABLE stagetrace.otel_traces").named_results()
    }
    assert described["Timestamp"] == "DateTime64(9)"
    assert described["Duration"] == "UInt64"
    assert described["SpanAttributes"] == "Map(LowCardinality(String), String)"
    assert described["Events.Timestamp"] == "Array(DateTime64(9))"
    assert described["Links.TraceId"] == "Array(String)"
    gauge = {
        r["name"]: r["type"] for r in store.client.query("DESCRIBE TABLE stagetrace.otel_metrics_sum").named_results()
    }
    assert gauge["TimeUnix"] == "DateTime64(9)" and gauge["IsMonotonic"] == "Bool"


@pytest.mark.parametrize("bad", ["", "1abc", "db; DROP TABLE x", "a`b", "x" * 65])
def test_identifiers_are_validated(bad):
    with pytest.raises(schema.SchemaError, match="invalid"):
        schema.statements(bad)


def test_upgrade_from_version_1_fills_the_stage_table_from_stored_spans(store):
    """A store made by version 1 has spans but no stagetrace_stages: the upgrade creates and backfills it."""
    import stagetrace

    stagetrace.configure(store=store, service_name="rag")
    with stagetrace.request("r-1", input="q"):
        for name in ("retrieval", "decode"):
            with stagetrace.stage(name, input=name) as st:
                st.set_output(name + "!")
    stagetrace.flush()
    store.client.command("DROP VIEW stagetrace.stagetrace_stages_mv")
    store.client.command("DROP TABLE stagetrace.stagetrace_stages")
    store.client.command("TRUNCATE TABLE stagetrace.stagetrace_schema_version")
    store.client.command("INSERT INTO stagetrace.stagetrace_schema_version (Version) VALUES (1)")
    assert schema.ensure_schema(store.client, "stagetrace") is True
    rows = store.client.query(
        "SELECT Stage, OutputDigest != '' FROM stagetrace.stagetrace_stages ORDER BY Start"
    ).result_rows
    assert rows == [("retrieval", True), ("decode", True)]
    assert schema.installed_version(store.client, "stagetrace") == schema.SCHEMA_VERSION


def test_upgrade_to_version_8_builds_the_trace_projection_from_stored_requests(store):
    """A store of version 7 has neither the trace-ordered nor the input-ordered projection of its requests: the
    upgrade adds them and builds them from the rows already there, so a lookup by trace ID reads them for old
    requests too."""
    import stagetrace
    from stagetrace import lookup

    stagetrace.configure(store=store, service_name="rag")
    with stagetrace.request("before-upgrade", input="q") as req:
        req.set_output("a")
    stagetrace.flush()
    for projection in ("by_trace", "by_input"):
        store.client.command(f"ALTER TABLE stagetrace.stagetrace_requests DROP PROJECTION {projection}")
    store.client.command("TRUNCATE TABLE stagetrace.stagetrace_schema_version")
    store.client.command("INSERT INTO stagetrace.stagetrace_schema_version (Version) VALUES (7)")
    assert schema.ensure_schema(store.client, "stagetrace") is True
    for projection in ("by_trace", "by_input"):
        built = store.client.command(
            "SELECT sum(rows) FROM system.projection_parts WHERE database = 'stagetrace' AND table = 'stagetrace_requests' "
            "AND name = {p:String} AND active",
            parameters={"p": projection},
        )
        assert int(built) == int(store.client.command("SELECT count() FROM stagetrace.stagetrace_requests")) > 0
    trace_id = lookup.by_request_id(store, "before-upgrade").trace_id
    assert lookup.by_trace_id(store, trace_id).request_id == "before-upgrade"


def test_an_embedded_stores_inserts_are_fsynced_before_they_return(store):
    """The spool drops a segment once its rows are inserted: on an embedded store an insert is durable by then, and
    so is a part a merge writes before the parts it merged go."""
    from stagetrace import schema

    for table in schema.DURABLE_TABLES:
        ddl = store.client.command(f"SHOW CREATE TABLE stagetrace.{table}")
        assert "fsync_after_insert = 1" in ddl and "fsync_part_directory = 1" in ddl, table
        assert "min_compressed_bytes_to_fsync_after_merge = 1" in ddl, table  # a merge's part too
    assert schema.make_durable(store.client, store.database) == []  # once is enough


def test_an_upgrade_keeps_every_row_of_every_table(store):
    """A store written by an older stagetrace (version 7 here: no projections, no otel_logs) is upgraded by `schema`
    with its rows intact: the count and a checksum of every row of every table are the same before and after."""
    import time

    from benchmarks import synthetic

    synthetic.fill(store, 2_000, time.time_ns() - 3600 * 10**9, seconds=3000)
    for projection in ("by_trace", "by_input"):
        store.client.command(f"ALTER TABLE stagetrace.stagetrace_requests DROP PROJECTION {projection}")
    store.client.command("DROP TABLE stagetrace.otel_logs")
    store.client.command("TRUNCATE TABLE stagetrace.stagetrace_schema_version")
    store.client.command("INSERT INTO stagetrace.stagetrace_schema_version (Version) VALUES (7)")
    tables = [t for t in schema.TABLE_NAMES if t not in ("otel_logs", "stagetrace_schema_version")]

    def fingerprint() -> dict:
        return {
            t: store.client.query(f"SELECT count(), sum(cityHash64(*)) FROM stagetrace.{t}").result_rows[0]
            for t in tables
        }

    before = fingerprint()
    assert before["otel_traces"][0] == 12_000 and before["stagetrace_requests"][0] == 2_000
    assert schema.ensure_schema(store.client, "stagetrace") is True
    assert fingerprint() == before
    assert int(store.client.command("SELECT count() FROM stagetrace.otel_logs")) == 0  # created, empty
