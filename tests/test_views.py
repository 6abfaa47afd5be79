"""The store's views since issue 32 (spans with content apart, digest rules planned only for them) write the rows the
views of schema 10 wrote, row for row: on the spans of stagetrace's span API, of OpenInference apps with content, of
the synthetic generator in both styles, and on every span the convention tests store (their modules are marked
``views_row_for_row``, tests/views_reference.py)."""

from __future__ import annotations

import time

from benchmarks import synthetic
from benchmarks.export import make_spans
from benchmarks.views import openinference_spans
from stagetrace import conventions, schema
from stagetrace.exporters.rows import COLUMNS, Resources, span_row
from tests.views_reference import assert_same_rows


def _insert(store, spans) -> None:
    resources = Resources()
    store.client.insert(
        "otel_traces", [span_row(s, resources) for s in spans], column_names=COLUMNS, database=store.database
    )


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


def test_a_span_without_content_attributes_needs_no_digest_rule():
    """What the views without the rules rely on: of every digest's sources, the given digest comes first and all the
    others read attributes HAS_CONTENT_SQL looks for, so a span without those has the given digest or none."""
    for sources in (
        conventions.REQUEST_INPUT_DIGEST_SOURCES,
        conventions.REQUEST_OUTPUT_DIGEST_SOURCES,
        conventions.STAGE_INPUT_DIGEST_SOURCES,
        conventions.STAGE_OUTPUT_DIGEST_SOURCES,
    ):
        first, *rest = sources
        assert isinstance(first, conventions.Digest)
        for source in rest:
            assert (
                source.key in conventions.CONTENT_SOURCE_KEYS
                if isinstance(source, conventions.Content)
                else source.prefix in conventions.CONTENT_SOURCE_PREFIXES
            ), source


def test_spans_with_content_pass_through_and_nothing_is_kept_on_the_way(store):
    _insert(store, openinference_spans(3))
    assert int(store.client.command("SELECT count() FROM stagetrace.stagetrace_content_spans")) == 0
    engine = store.client.command(
        "SELECT engine FROM system.tables WHERE database = 'stagetrace' AND name = 'stagetrace_content_spans'"
    )
    assert engine == "Null"
    assert {v.name for v in schema.VIEWS} <= set(
        store.client.query("SELECT name FROM system.tables WHERE database = 'stagetrace'").result_columns[0]
    )
