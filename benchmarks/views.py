"""What the store's materialized views cost per span: the same inserts into a bare ``otel_traces`` and into stores
with stagetrace's views, side by side in one run.

One embedded store, several databases, each with the same ``otel_traces``: ``bare`` (no view), ``views`` (every view
as ``stagetrace schema`` creates it now), ``before`` (the views as schema 10 created them, from
``tests/fixtures/views/schema10.sql``), and one database per view alone (now), which is the profile: what each view
adds to the bare insert. Two corpora, each made once with the OpenTelemetry SDK and turned into rows by the
exporter's ``span_row``: stagetrace-convention requests (a root and five stage spans carrying digests, as the span
API makes them) and OpenInference requests with content (a LlamaIndex-shaped RAG query: the chain, the query
embedding, the retriever with four documents, the prompt, the LLM with its messages; content of the sizes such apps
record), whose digests the views compute in the store. The inserts are raw columnar ``client.insert`` of 4,096 rows
(the exporter's batch) with a token each, databases taking turns batch by batch so that none gets the quieter
moments; the figure is each database's median seconds per batch, and the ratio is to the bare table's.
"""

from __future__ import annotations

import json
import statistics
import tempfile
import time
import uuid
from pathlib import Path

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.trace import SpanKind

from benchmarks import Figure, benchmark
from benchmarks.export import BATCH_ROWS, _columnar, _Keep, make_spans
from stagetrace import schema
from stagetrace.exporters.rows import COLUMNS, Resources, span_row
from stagetrace.store import open_store

BEFORE_SQL = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "views" / "schema10.sql"


def before_views() -> list[schema.View]:
    """The views as schema 10 created them (the SELECTs frozen in ``tests/fixtures/views/schema10.sql``)."""
    out = []
    for chunk in (c.strip() for c in BEFORE_SQL.read_text().split("\n;;\n") if c.strip()):
        lines = chunk.splitlines()
        name, target = [line for line in lines if line.startswith("-- ")][-1][3:].split(" -> ")
        out.append(schema.View(name, target, "\n".join(line for line in lines if not line.startswith("--"))))
    return out


def by_table(views: list[schema.View]) -> dict[str, list[schema.View]]:
    """The views that fill each of stagetrace's tables, each with the view that passes spans on to it, if any."""
    out: dict[str, list[schema.View]] = {}
    for view in views:
        if any(w.source == view.target for w in views):  # passes spans on: counted with the views that read them
            continue
        for w in [w for w in views if w.target == view.source] + [view]:
            if w not in out.setdefault(view.target, []):
                out[view.target].append(w)
    return out


def _text(seed: int, words: int) -> str:
    return " ".join(f"w{(seed * 7919 + i * 104729) % 50_000}" for i in range(words))


def openinference_spans(requests: int) -> list:
    """Finished SDK spans of ``requests`` LlamaIndex-shaped RAG queries, traced as OpenInference records them."""
    keep = _Keep()
    provider = TracerProvider(resource=Resource.create({"service.name": "rag", "host.name": "rag-0"}))
    provider.add_span_processor(SimpleSpanProcessor(keep))
    tracer = provider.get_tracer("openinference.instrumentation.llama_index")
    kind = "openinference.span.kind"
    for i in range(requests):
        question, answer = _text(i, 16), _text(i + 1, 120)
        documents = [_text(i * 4 + d, 150) for d in range(4)]
        with tracer.start_as_current_span(
            "RetrieverQueryEngine.query",
            kind=SpanKind.SERVER,
            attributes={
                kind: "CHAIN",
                "input.value": question,
                "output.value": answer,
                "input.mime_type": "text/plain",
            },
        ):
            with tracer.start_as_current_span(
                "VectorIndexRetriever.retrieve",
                attributes={
                    kind: "RETRIEVER",
                    "input.value": question,
                    **{
                        f"retrieval.documents.{d}.document.{field}": value
                        for d, text in enumerate(documents)
                        for field, value in (("id", f"node-{i}-{d}"), ("content", text), ("score", 0.9 - d / 10))
                    },
                },
            ):
                with tracer.start_as_current_span(
                    "OpenAIEmbedding.get_query_embedding",
                    attributes={
                        kind: "EMBEDDING",
                        "embedding.model_name": "text-embedding-3-small",
                        "embedding.embeddings.0.embedding.text": question,
                    },
                ):
                    pass
            with tracer.start_as_current_span(
                "ChatPromptTemplate",
                attributes={
                    kind: "PROMPT",
                    "llm.prompt_template.template": "Context: {context}\nQ: {query}",
                    "llm.prompt_template.variables": json.dumps({"query": question}),
                },
            ):
                pass
            with tracer.start_as_current_span(
                "OpenAI.chat",
                attributes={
                    kind: "LLM",
                    "llm.model_name": "gpt-4o-mini",
                    "llm.invocation_parameters": '{"temperature": 0}',
                    "llm.input_messages.0.message.role": "system",
                    "llm.input_messages.0.message.content": "\n".join(documents),
                    "llm.input_messages.1.message.role": "user",
                    "llm.input_messages.1.message.content": question,
                    "llm.output_messages.0.message.role": "assistant",
                    "llm.output_messages.0.message.content": answer,
                    "llm.token_count.prompt": 900,
                    "llm.token_count.completion": 160,
                },
            ):
                pass
            with tracer.start_as_current_span(
                "CompactAndRefine.get_response",
                attributes={
                    kind: "CHAIN",
                    "input.value": question,
                    "output.value": answer,
                },
            ):
                pass
    provider.shutdown()
    return keep.spans


def _database(store, name: str, views: list[schema.View]) -> None:
    store.client.command(f"CREATE DATABASE {name}")
    for sql in schema.statements(name, views=False):
        store.client.command(sql)
    for view in views:  # each reading the table it reads in the store: otel_traces, or the Null table
        store.client.command(
            f"CREATE MATERIALIZED VIEW {name}.`{view.name}` TO {name}.`{view.target}`\n"
            f"AS {view.select.format(source=f'{name}.`{view.source}`')}"
        )


def _insert(store, database: str, columns) -> float:
    started = time.perf_counter()
    store.client.insert(
        "otel_traces",
        columns,
        column_names=COLUMNS,
        database=database,
        column_oriented=True,
        settings={"insert_deduplication_token": uuid.uuid4().hex},
    )
    return time.perf_counter() - started


def measure(
    corpora: dict[str, list],
    rounds: int,
    per_view: bool = True,
    rows_per_insert: int = BATCH_ROWS,
    inserts: int | None = None,
) -> dict[str, dict[str, float]]:
    """Median seconds per insert of ``rows_per_insert`` spans (the first ``inserts`` of them a round, or all the
    corpus makes), by corpus and database."""
    databases = {"bare": [], "views": list(schema.VIEWS), "before": before_views()}
    if per_view:
        databases |= by_table(list(schema.VIEWS))
        databases |= {f"before {table}": views for table, views in by_table(before_views()).items()}
    out = {}
    resources = Resources()
    with (
        tempfile.TemporaryDirectory(prefix="stagetrace-bench-") as directory,
        open_store(f"chdb://{directory}", create_schema=False) as store,
    ):
        names = {}
        for corpus, spans in corpora.items():
            rows = [span_row(s, resources) for s in spans]
            whole = rows[: len(rows) // rows_per_insert * rows_per_insert] or rows
            batches = _columnar(whole, rows_per_insert)[:inserts]
            for name, views in databases.items():
                names[corpus, name] = f"{corpus}_{name}".replace(" ", "_")
                _database(store, names[corpus, name], views)
            seconds: dict[str, list[float]] = {name: [] for name in databases}
            for name in databases:  # warm-up: the first insert into a table opens it
                _insert(store, names[corpus, name], batches[0])
            for r in range(rounds):
                for b, columns in enumerate(batches):
                    order = list(databases) if (r + b) % 2 == 0 else list(reversed(databases))
                    for name in order:
                        seconds[name].append(_insert(store, names[corpus, name], columns))
            out[corpus] = {name: statistics.median(values) for name, values in seconds.items()}
            expected = len(batches[0][0]) + rounds * sum(len(c[0]) for c in batches)
            for name in databases:
                stored = int(store.client.command(f"SELECT count() FROM {names[corpus, name]}.otel_traces"))
                if stored != expected:
                    raise RuntimeError(f"{names[corpus, name]}.otel_traces holds {stored} rows, expected {expected}")
    return out


CORPORA = {
    "stagetrace": "stagetrace-convention spans (digests given)",
    "openinference": "OpenInference spans with content (digests computed in the store)",
}


@benchmark("views")
def views(quick: bool) -> list[Figure]:
    requests, rounds = (700, 1) if quick else (4_100, 3)
    corpora = {"stagetrace": make_spans(requests), "openinference": openinference_spans(requests)}
    medians = measure(corpora, rounds)
    figures = []
    for corpus, seconds in medians.items():
        bare = seconds["bare"] * 1000
        label = f"{CORPORA[corpus]}, {BATCH_ROWS:,}-span insert, median"
        figures.append(Figure(f"{label}: every view, now", seconds["views"] * 1000, "ms", "bare otel_traces", bare))
        figures.append(
            Figure(f"{label}: every view, before (schema 10)", seconds["before"] * 1000, "ms", "bare otel_traces", bare)
        )
        for table in by_table(list(schema.VIEWS)):
            for when, key in (("now", table), ("before", f"before {table}")):
                if key not in seconds:  # a table newer than schema 10 has no before
                    continue
                figures.append(
                    Figure(
                        f"{label}: the views into {table} alone, {when}",
                        seconds[key] * 1000,
                        "ms",
                        "bare otel_traces",
                        bare,
                    )
                )
    return figures


@benchmark("views_by_insert")
def views_by_insert(quick: bool) -> list[Figure]:
    """Every view against the bare table as inserts grow, from one request (six spans: what an insert costs whatever
    its size, as each view is planned anew) to 65,536 spans (quick: 6 to 4,096)."""
    sizes, requests, rounds = ((6, 1_024, 4_096), 700, 1) if quick else ((6, 4_096, 16_384, 65_536), 12_000, 3)
    corpora = {"stagetrace": make_spans(requests), "openinference": openinference_spans(requests)}
    figures = []
    for size in sizes:
        inserts = 40 if size < BATCH_ROWS else None
        for corpus, seconds in measure(corpora, rounds, per_view=False, rows_per_insert=size, inserts=inserts).items():
            for when, key in (("now", "views"), ("before (schema 10)", "before")):
                label = f"{CORPORA[corpus]}, {size:,}-span insert, median: every view, {when}"
                figures.append(Figure(label, seconds[key] * 1000, "ms", "bare otel_traces", seconds["bare"] * 1000))
    return figures


def _planning_ms(store, database: str, views: list[schema.View], rounds: int) -> dict[str, float]:
    """Median milliseconds to plan each view's query over ``database``'s tables (run on no rows: ``WHERE 0``), and a
    one-column query's, which is what a query costs before its expressions."""
    queries = {v.name: v.select.format(source=f"{database}.`{v.source}`") for v in views}
    queries[""] = f"SELECT TraceId FROM {database}.otel_traces"
    seconds: dict[str, list[float]] = {name: [] for name in queries}
    for _ in range(rounds):
        for name, sql in queries.items():
            started = time.perf_counter()
            store.client.query(f"SELECT * FROM ({sql}) WHERE 0")
            seconds[name].append(time.perf_counter() - started)
    return {name: statistics.median(values) * 1000 for name, values in seconds.items()}


def profile(spans: list, large: int, rounds: int) -> dict:
    """What every view adds to an insert, split into a fixed cost (an insert of one request, six spans) and a cost a
    span (an insert of ``large`` spans less the one of six just before it, so that the host's slower moments cancel),
    with the background merges stopped so that an insert's figure is its own; then what each view's query takes to
    plan. Medians of ``rounds`` rounds, the databases taking turns, in milliseconds (a span's: microseconds)."""
    resources = Resources()
    rows = [span_row(s, resources) for s in spans]
    small, big = _columnar(rows[:6], 6)[0], _columnar(rows[:large], large)[0]
    with (
        tempfile.TemporaryDirectory(prefix="stagetrace-bench-") as directory,
        open_store(f"chdb://{directory}", create_schema=False) as store,
    ):
        for name, views in (("bare", []), ("views", list(schema.VIEWS))):
            _database(store, name, views)
        store.client.command("SYSTEM STOP MERGES")
        fixed, per_span, whole = {"bare": [], "views": []}, {"bare": [], "views": []}, {"bare": [], "views": []}
        for r in range(rounds + 1):  # the first round opens the tables: not counted
            for name in ("bare", "views") if r % 2 else ("views", "bare"):
                one, many = _insert(store, name, small) * 1000, _insert(store, name, big) * 1000
                if r:
                    fixed[name].append(one)
                    per_span[name].append((many - one) / (large - 6) * 1000)
                    whole[name].append(many)
        planning = _planning_ms(store, "views", list(schema.VIEWS), 3 * rounds)
    medians = {
        key: {name: statistics.median(values) for name, values in by_name.items()}
        for key, by_name in (("fixed", fixed), ("per_span", per_span), ("large", whole))
    }
    return {**medians, "planning": planning}


def ratio_reached_at(fixed: dict, per_span: dict, ratio: float) -> float:
    """The insert size (spans) from which an insert through every view takes at most ``ratio`` times the bare
    insert, by the fixed and per-span costs; infinite where the per-span costs alone exceed it."""
    extra_fixed = fixed["views"] - ratio * fixed["bare"]
    margin = (ratio * per_span["bare"] - per_span["views"]) / 1000  # ms a span
    if margin <= 0:
        return float("inf")
    return max(6.0, extra_fixed / margin)


@benchmark("views_profile")
def views_profile(quick: bool) -> list[Figure]:
    """The views' cost as a fixed part an insert and a part a span, each view's planning, and the insert size from
    which the aims hold (1.5× the bare insert for stagetrace spans, 2× for OpenInference spans with content)."""
    large, rounds = (4_096, 3) if quick else (32_768, 15)
    requests = large // 6 + 1
    corpora = {"stagetrace": (make_spans(requests), 1.5), "openinference": (openinference_spans(requests), 2.0)}
    figures = []
    for corpus, (spans, aim) in corpora.items():
        found = profile(spans, large, rounds)
        fixed, per_span = found["fixed"], found["per_span"]
        label = f"{CORPORA[corpus]}, merges stopped"
        figures.append(
            Figure(
                f"{label}: an insert of one request (6 spans), every view",
                fixed["views"],
                "ms",
                "bare otel_traces",
                fixed["bare"],
            )
        )
        figures.append(
            Figure(
                f"{label}: a span more, every view (from {large:,}-span inserts)",
                per_span["views"],
                "µs",
                "bare otel_traces",
                per_span["bare"],
            )
        )
        figures.append(
            Figure(
                f"{label}: an insert of {large:,} spans, every view",
                found["large"]["views"],
                "ms",
                "bare otel_traces",
                found["large"]["bare"],
            )
        )
        figures.append(
            Figure(
                f"{label}: the insert size from which every view costs at most {aim}× the bare insert",
                ratio_reached_at(fixed, per_span, aim),
                "spans",
            )
        )
        if corpus == "stagetrace":  # the planning is the same SQL whatever the spans
            trivial = found["planning"].pop("")
            for view, ms in found["planning"].items():
                figures.append(Figure(f"planning {view}'s query (on no rows)", ms, "ms", "a one-column query", trivial))
    return figures


# -- the views priced at the sizes a fleet's writers send (issue 55): the SDK's BatchSpanProcessor exports 512 spans at
# a time, the Collector's batch processor up to 8,192 (send_batch_size) or what arrived in 200 ms (its timeout)
WRITER_SIZES = (512, 2_000, 8_192)
WRITER_RATES = (100, 1_000, 10_000)  # spans/s, sent as the Collector sends them: every COLLECTOR_TIMEOUT_S
COLLECTOR_TIMEOUT_S, COLLECTOR_BATCH = 0.2, 8_192
JSON_DDL = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "collector_json" / "json.sql"


def _json_database(store, name: str, views: bool) -> None:
    """The Collector's JSON-layout span table (tests/fixtures/collector_json), and stagetrace's views over it."""
    store.client.command(f"CREATE DATABASE {name}")
    for chunk in JSON_DDL.read_text().split("\n;;\n"):
        sql = "\n".join(line for line in chunk.splitlines() if not line.startswith("--")).strip()
        if 'otel_traces"' in sql and "CREATE TABLE" in sql:
            store.client.command(sql.replace('"stagetrace"', f'"{name}"'))
    for sql in schema.statements(name, views=False):
        if "`otel_traces`" not in sql:
            store.client.command(sql)
    if views:
        for sql in schema.statements(name, tables=False, layouts={"otel_traces": "JSON", "otel_logs": "Map"}):
            store.client.command(sql)


# the Collector's exporter inserts with async_insert = 1 (its default since PR #33614) and the server's default
# wait_for_async_insert = 1: each insert returns once its rows are stored
COLLECTOR_SETTINGS = {"async_insert": 1, "wait_for_async_insert": 1}


def _cpu_of(store, database: str | None, batches: list, pace_s: float = 0.0, settle_s: float = 0.5) -> float:
    """The process's CPU seconds (every thread: the engine's inserts, its views and its merges) to insert ``batches``
    into ``database``, one every ``pace_s`` (0: back to back, as the agent's and the SDK's exporters insert; else as
    the Collector does), and ``settle_s`` after (merges the inserts caused). ``database`` None: the same time idle."""
    cpu, start = time.process_time(), time.perf_counter()
    for i, columns in enumerate(batches):
        if pace_s:
            time.sleep(max(0.0, start + i * pace_s - time.perf_counter()))
        if database is None:
            continue
        if pace_s:
            store.client.insert(
                "otel_traces",
                columns,
                column_names=COLUMNS,
                database=database,
                column_oriented=True,
                settings=COLLECTOR_SETTINGS,
            )
        else:
            _insert(store, database, columns)
    time.sleep(settle_s)
    return time.process_time() - cpu


# every table stagetrace's views fill from otel_traces (and the trace-ID table the Collector's view fills)
_FILLED = ("otel_traces", "otel_traces_trace_id_ts", "stagetrace_requests", "stagetrace_stages")
_CONTENT_SPANS_TABLE = "stagetrace_content_spans"  # a Null table passing spans with content on to their views


def _refresh_cpu(store, database: str) -> float:
    """One period of a refreshed design, a prototype of refreshable views: the CPU seconds to fill every table the
    views fill from the spans the period stored, each with one insert-select of its views' queries (those of spans
    with content too, over otel_traces as a schema upgrade refills them; the table that passes them on is skipped)."""
    cpu = time.process_time()
    for view in schema.VIEWS:
        if view.target != _CONTENT_SPANS_TABLE:
            store.client.command(
                f"INSERT INTO {database}.`{view.target}` {view.select.format(source=f'{database}.`otel_traces`')}"
            )
    return time.process_time() - cpu


def by_writer(
    spans: list,
    sizes=WRITER_SIZES,
    rates=WRITER_RATES,
    rounds: int = 3,
    period_s: float = 6.0,
    json_layout: bool = True,
) -> dict:
    """CPU seconds a stored span, by database: {("size", n) | ("rate", r): {database: seconds}}. Databases take
    turns (the order alternating by round), each emptied after its turn; each figure is the median of ``rounds``.
    At a rate, the CPU the idle process spends in the same time (the engine's own threads) is measured in each round
    too and taken off. ``refresh``: the bare table's inserts, then one insert-select a view over what they stored
    (the round's spans: 24,000 at the sizes, ``period_s`` of spans at a rate), as refreshable views would do it."""
    resources = Resources()
    rows = [span_row(s, resources) for s in spans]
    databases = ["bare", "views", "refresh"] + (["json_bare", "json_views"] if json_layout else [])
    out: dict = {}
    with (
        tempfile.TemporaryDirectory(prefix="stagetrace-bench-") as directory,
        open_store(f"chdb://{directory}", create_schema=False) as store,
    ):
        _database(store, "bare", [])
        _database(store, "views", list(schema.VIEWS))
        _database(store, "refresh", [])
        if json_layout:
            _json_database(store, "json_bare", views=False)
            _json_database(store, "json_views", views=True)
        for name in databases:  # the first insert opens the tables
            _insert(store, name, _columnar(rows[:6], 6)[0])
        plans = [
            (("size", n), _columnar(rows[: max(n, len(rows) // n * n)], n)[: max(2, 24_000 // n)], 0.0) for n in sizes
        ]
        for rate in rates:
            per_insert = min(COLLECTOR_BATCH, max(1, round(rate * COLLECTOR_TIMEOUT_S)))
            inserts = max(1, int(period_s / COLLECTOR_TIMEOUT_S))
            needed = per_insert * inserts
            source = (rows * (needed // len(rows) + 1))[:needed]
            plans.append((("rate", rate), _columnar(source, per_insert), COLLECTOR_TIMEOUT_S))
        for key, batches, pace in plans:
            spans_sent = sum(len(c[0]) for c in batches)
            seconds: dict[str, list[float]] = {name: [] for name in databases}
            for r in range(rounds):
                idle = _cpu_of(store, None, batches, pace) if pace else 0.0
                for name in databases if r % 2 == 0 else list(reversed(databases)):
                    cpu = _cpu_of(store, name, batches, pace) - idle
                    cpu += _refresh_cpu(store, name) if name == "refresh" else 0.0
                    seconds[name].append(cpu / spans_sent)
                    for table in _FILLED:  # the next round starts from empty tables, as the others do
                        store.client.command(f"TRUNCATE TABLE {name}.`{table}`")
            out[key] = {name: statistics.median(values) for name, values in seconds.items()}
    return out


@benchmark("views_by_writer")
def views_by_writer(quick: bool) -> list[Figure]:
    """The store's CPU a stored span (engine, views and merges: the whole process's CPU time), every view against
    the bare otel_traces, for inserts of the sizes writers send (the SDK's 512, 2,000, the Collector's 8,192) and for
    spans sent at 100, 1,000 and 10,000 spans/s the way the Collector sends them (what arrived in 200 ms, one insert
    with async_insert, the idle process's CPU taken off); the same on the Collector's JSON layout.
    Stagetrace-convention spans."""
    requests, rounds, period = (400, 1, 1.0) if quick else (4_100, 3, 6.0)
    found = by_writer(make_spans(requests), rounds=rounds, period_s=period)
    figures = []
    for (kind, n), seconds in found.items():
        what = f"inserts of {n:,} spans" if kind == "size" else f"{n:,} spans/s sent every 200 ms"
        for layout, bare, views in (("Map", "bare", "views"), ("JSON", "json_bare", "json_views")):
            if views in seconds:
                figures.append(
                    Figure(
                        f"CPU a stored span, {what}, {layout} layout: every view",
                        seconds[views] * 1e6,
                        "µs",
                        f"bare otel_traces ({layout})",
                        seconds[bare] * 1e6,
                    )
                )
        figures.append(
            Figure(
                f"CPU a stored span, {what}, Map layout: the views' queries run once a period instead "
                "(a refresh's prototype)",
                seconds["refresh"] * 1e6,
                "µs",
                "bare otel_traces (Map)",
                seconds["bare"] * 1e6,
            )
        )
    return figures
