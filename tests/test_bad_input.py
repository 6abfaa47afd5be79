"""Hostile request IDs and attribute values of every OpenTelemetry type, against the real embedded store."""

import math
import subprocess
import sys

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, ArrayValue, KeyValue, KeyValueList
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.trace import SpanKind

from stagetrace import lookup
from stagetrace.analysis.explain import Explainer
from stagetrace.exporters.clickhouse import ClickHouseSpanExporter
from stagetrace.exporters.otlp import OtlpReceiver
from stagetrace.store import open_store

STORED_EVIL = "a'b\\c\"d; DROP TABLE stagetrace.otel_traces; --"
EVIL = [
    "'",
    "\\",
    '"',
    "\0",
    "r1\0",
    "r1'",
    "x' OR '1'='1",
    "r1' --",
    "'; DROP TABLE stagetrace.otel_traces; --",
    "%",
    "r%",
    "_1",
    "{id:String}",
    "r1\\'",
    STORED_EVIL[:-1],
]


def write_requests(store, *request_ids: str) -> None:
    exporter = ClickHouseSpanExporter(store=store, spool_dir=False)
    provider = TracerProvider(resource=Resource.create({"service.name": "svc", "host.name": "node-a"}))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("t")
    for request_id in request_ids:
        with tracer.start_as_current_span(
            "inference.request",
            kind=SpanKind.SERVER,
            attributes={
                "stagetrace.request.id": request_id,
                "stagetrace.input.digest": "in",
                "stagetrace.output.digest": "out",
            },
        ):
            with tracer.start_as_current_span("decode", attributes={"stagetrace.stage": "decode"}):
                pass
    assert exporter.force_flush()
    provider.shutdown()


@pytest.mark.parametrize("request_id", EVIL)
def test_hostile_request_ids_are_a_clean_not_found(store, request_id):
    write_requests(store, "r1", STORED_EVIL)
    with pytest.raises(lookup.NotFound, match="no request with id"):
        lookup.by_request_id(store, request_id)
    with pytest.raises(lookup.NotFound, match="no request with id"):
        Explainer(store).explain(request_id).to_json()
    with pytest.raises(lookup.NotFound):
        lookup.by_trace_id(store, request_id)
    # nothing was executed as SQL: the tables and the requests are all there
    assert lookup.by_request_id(store, "r1").trace_id
    assert lookup.by_request_id(store, STORED_EVIL).trace_id  # and a hostile ID that exists is found as itself
    assert store.client.command("SELECT count() FROM stagetrace.otel_traces") == 4


def test_the_cli_answers_hostile_ids_with_one_line(tmp_path):
    dsn = f"chdb://{tmp_path / 'store'}"
    with open_store(dsn) as store:
        write_requests(store, "r1")
    for command in ("trace", "explain"):
        result = subprocess.run(
            [sys.executable, "-m", "stagetrace", command, "x' OR '1'='1", "--store", dsn],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 1
        assert (
            result.stderr.startswith("stagetrace: no request with id \"x' OR '1'='1\"")
            and result.stderr.count("\n") == 1
        )


def test_sdk_attributes_of_every_type_are_stored(store):
    exporter = ClickHouseSpanExporter(store=store, spool_dir=False)
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    attributes = {
        "str": "plain",
        "nul": "a\0b",
        "surrogate": "a\udc80b",  # what os.fsdecode makes of non-UTF-8 bytes
        "bool": False,
        "int": 2**63 - 1,
        "neg": -(2**63),
        "float": 1.5,
        "nan": math.nan,
        "inf": -math.inf,
        "strs": ["x", "\ud800", ""],
        "ints": [1, 2],
        "floats": [0.5],
        "bools": [True, False],
        "empty": [],
        "big": "v" * 100_000,
    }
    provider.get_tracer("t").start_span("typed", attributes=attributes).end()
    assert exporter.force_flush(10_000)
    stored = store.client.query(
        "SELECT SpanAttributes FROM stagetrace.otel_traces WHERE SpanName = 'typed'"
    ).result_rows[0][0]
    assert stored["str"] == "plain" and stored["nul"] == "a\0b" and stored["surrogate"] == "a?b"
    assert (stored["bool"], stored["int"], stored["neg"]) == ("false", str(2**63 - 1), str(-(2**63)))
    assert (stored["nan"], stored["inf"]) == ("nan", "-inf")
    assert stored["strs"] == '["x","\\ud800",""]' and stored["bools"] == "[true,false]" and stored["empty"] == "[]"
    assert len(stored["big"]) == 100_000
    provider.shutdown()


def _kv(key: str, value: AnyValue) -> KeyValue:
    return KeyValue(key=key, value=value)


def test_otlp_attributes_of_every_type_including_non_utf8_bytes_are_stored(store):
    nested = ArrayValue(
        values=[AnyValue(int_value=1), AnyValue(array_value=ArrayValue(values=[AnyValue(string_value="in")]))]
    )
    request = ExportTraceServiceRequest()
    span = (
        request.resource_spans.add()
        .scope_spans.add()
        .spans.add(
            trace_id=bytes(range(1, 17)),
            span_id=bytes(range(1, 9)),
            name="typed",
            start_time_unix_nano=1,
            end_time_unix_nano=2,
        )
    )
    span.attributes.extend(
        [
            _kv("bytes", AnyValue(bytes_value=b"\xff\xfe\x00raw")),
            _kv("kvlist", AnyValue(kvlist_value=KeyValueList(values=[_kv("k", AnyValue(double_value=2.5))]))),
            _kv("nested", AnyValue(array_value=nested)),
            _kv("unset", AnyValue()),
            _kv("double", AnyValue(double_value=float("nan"))),
            _kv("int", AnyValue(int_value=-(2**63))),
            _kv("bool", AnyValue(bool_value=True)),
        ]
    )
    receiver = OtlpReceiver(store, "127.0.0.1:0")
    try:
        receiver.traces(request)  # answered once stored
    finally:
        receiver.close()
    stored = store.client.query(
        "SELECT SpanAttributes FROM stagetrace.otel_traces WHERE SpanName = 'typed'"
    ).result_rows[0][0]
    assert stored["bytes"] == "//4AcmF3"  # base64, as the Collector writes bytes
    assert stored["kvlist"] == '{"k":2.5}' and stored["nested"] == "[1,\"('in',)\"]"
    assert stored["unset"] == "" and stored["double"] == "nan" and stored["int"] == str(-(2**63))
    assert stored["bool"] == "true"


@pytest.mark.parametrize(
    "argv, usage, hint",
    [
        (
            ["trace", "req-1", "--jsn"],
            "usage: stagetrace trace ",
            "unrecognized argument: --jsn (did you mean --json?)",
        ),
        (["explain", "req-1", "--agaisnt=req-2"], "usage: stagetrace explain ", "(did you mean --against?)"),
        (["divergences", "--sine", "1h"], "usage: stagetrace divergences ", "(did you mean --since?)"),
        (["tarce", "req-1"], "usage: stagetrace [-h]", "unknown command 'tarce' (did you mean trace?)"),
        (["demmo"], "usage: stagetrace [-h]", "unknown command 'demmo' (did you mean demo?)"),
    ],
)
def test_a_mistyped_option_or_command_gets_its_usage_and_the_closest_word(argv, usage, hint):
    """The usage shown is the command's own (what options it takes), and the right word is named."""
    done = subprocess.run([sys.executable, "-m", "stagetrace", *argv], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.startswith(usage), done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert hint in last and "Traceback" not in done.stderr
    if "unknown command" in last:
        assert last.endswith(
            "the commands: schema, trace, explain, divergences, demo, collect, agent, analyse, provision"
        )


def test_a_word_close_to_nothing_gets_no_guess():
    done = subprocess.run(
        [sys.executable, "-m", "stagetrace", "trace", "req-1", "--zzzzzz"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2 and done.stderr.strip().splitlines()[-1] == (
        "stagetrace trace: error: unrecognized argument: --zzzzzz"
    )


def test_store_before_the_command_is_taken_and_the_commands_own_wins(tmp_path):
    """The README says every command takes ``--store DSN``; an operator writes it before the command as often as
    after. Before it, it is the store; given in both places, the one after the command wins. Two real stores, the
    request in one only, so a store taken from the wrong place is a clean not-found."""
    holding, other = f"chdb://{tmp_path / 'holding'}", f"chdb://{tmp_path / 'other'}"
    with open_store(holding) as store:
        write_requests(store, "r1")
    with open_store(other) as store:
        write_requests(store, "r2")

    def stagetrace(*argv):
        return subprocess.run([sys.executable, "-m", "stagetrace", *argv], capture_output=True, text=True, timeout=120)

    before = stagetrace("--store", holding, "trace", "r1", "--json")
    assert before.returncode == 0 and '"request_id": "r1"' in before.stdout, before.stderr
    both = stagetrace("--store", other, "trace", "r1", "--json", "--store", holding)
    assert both.returncode == 0 and '"request_id": "r1"' in both.stdout, both.stderr
    missing = stagetrace(f"--store={holding}", "trace", "r2")
    assert missing.returncode == 1 and missing.stderr.count("\n") == 1 and "no request with id" in missing.stderr
    assert "unknown command" not in missing.stderr
    nowhere = stagetrace("--store", f"chdb://{tmp_path / 'nope'}", "trace", "r1")
    assert nowhere.returncode == 2 and nowhere.stderr.count("\n") == 1 and "no store at" in nowhere.stderr
