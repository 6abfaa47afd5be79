"""The store's views since issue 32 (cheaper digest rules, one view per table) write the rows the views of schema 10
wrote, row for row: on the spans of stagetrace's span API, of OpenInference apps with content, of
the synthetic generator in both styles, and on every span the convention tests store (their modules are marked
``views_row_for_row``, tests/views_reference.py)."""

from __future__ import annotations

import time

from benchmarks import synthetic
from benchmarks.export import make_spans
from benchmarks.views import openinference_spans
from stagetrace import schema
from stagetrace.exporters.clickhouse import COLUMNS, _Resources, span_row
from tests.views_reference import assert_same_rows


def _insert(store, spans) -> None:
    resources = _Resources()
    store.client.insert("otel_traces", [span_row(s, resources) for s in spans], column_names=COLUMNS,
                        database=store.database)  # fmt: skip


def test_the_views_write_schema_10_s_rows_for_the_span_api_s_and_openinference_s_spans(store):
    _insert(store, make_spans(40))
    _insert(store, openinference_spans(40))
    stages = int(store.client.command("SELECT count() FROM stagetrace.stagetrace_stages"))
    assert stages == 40 * 5 + 40 * 4  # the span API's five stages; retriever, embedding, prompt and LLM
    assert assert_same_rows(store) > 500


def test_the_views_write_schema_10_s_rows_for_the_synthetic_stores(store):
    t0 = time.time_ns() - 3600 * 10**9
    synthetic.fill(store, 200, t0)
    synthetic.fill(store, 200, t0, style="openinference", offset=200)
    assert assert_same_rows(store) > 2000


def test_an_upgrade_from_schema_11_retires_the_route_of_spans_with_content_and_keeps_the_rows(store):
    """Schema 11 sent spans with content through a Null table to views of their own; an upgrade drops that route and
    the views it fed, makes one view per table, and what is stored and written afterwards is schema 10's rows."""
    _insert(store, openinference_spans(20))
    db = "stagetrace"
    spans = f"{db}.otel_traces"
    store.client.command(f"CREATE TABLE {db}.stagetrace_content_spans (TraceId String) ENGINE = Null")
    store.client.command(f"CREATE MATERIALIZED VIEW {db}.stagetrace_content_spans_mv TO {db}.stagetrace_content_spans "
                         f"AS SELECT TraceId FROM {spans}")  # fmt: skip
    for view in schema.VIEWS[1:]:  # stand-ins that write what the route's views wrote: left behind, rows come twice
        name = view.name.replace("_mv", "_content_mv")
        store.client.command(f"CREATE MATERIALIZED VIEW {db}.{name} TO {db}.{view.target} AS "
                             f"{view.select.format(source=spans)}")  # fmt: skip
    store.client.command(f"TRUNCATE TABLE {db}.stagetrace_schema_version")
    store.client.command(f"INSERT INTO {db}.stagetrace_schema_version (Version) VALUES (11)")

    assert schema.ensure_schema(store.client, db) is True
    names = set(store.client.query(f"SELECT name FROM system.tables WHERE database = '{db}'").result_columns[0])
    retired = {"stagetrace_content_spans", "stagetrace_content_spans_mv", "stagetrace_requests_content_mv",
               "stagetrace_stages_content_mv"}  # fmt: skip
    assert not names & retired and {v.name for v in schema.VIEWS} <= names
    _insert(store, openinference_spans(20) + make_spans(20))
    assert assert_same_rows(store) > 200
