"""The ``stagetrace`` command line."""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import shlex
import shutil
import sys
import time
from pathlib import Path

# Only what building the parser needs: each command imports what it uses, so `--help` and a lookup through the
# agent load neither the embedded engine nor the OpenTelemetry SDK.
from stagetrace import __version__, config
from stagetrace.config import DEFAULT_QUERY_LISTEN
from stagetrace.environment_variables import (
    STAGETRACE_AGENT_LOGS,
    STAGETRACE_AGENT_TOKEN,
    STAGETRACE_AGENT_TOKEN_FILE,
    STAGETRACE_ANALYSE_EVERY,
    STAGETRACE_ANALYSE_LISTEN,
    STAGETRACE_ANALYSE_LOOKBACK,
    STAGETRACE_ANALYSE_SETTLE,
    STAGETRACE_HOST,
    STAGETRACE_INSERT_EVERY,
    STAGETRACE_MIN_FREE_SPACE,
    STAGETRACE_OTLP_LOGS,
    STAGETRACE_QUERY_TIMEOUT,
    STAGETRACE_WEB_CONFIG_FILE,
)
from stagetrace.errors import SchemaError, StoreError


_STORE_HELP = (
    f"chdb:///path or http(s)://user@host:8123/db (env {config.ENV_STORE}; "
    f"password from {config.ENV_STORE_PASSWORD} or {config.ENV_STORE_PASSWORD_FILE}); "
    f"default chdb://{config.default_store_path()}"
)
# ``stagetrace --store DSN trace ID``: the top level keeps its own destination, as the command's default (None) would
# overwrite a shared one; after parsing, the command's own --store wins over this one.
_STORE_BEFORE_COMMAND = "store_before_command"


def _store_option() -> argparse.ArgumentParser:
    parent = argparse.ArgumentParser(add_help=False)
    parent.add_argument("--store", metavar="DSN", default=None, help=_STORE_HELP)
    return parent


def _collector_options() -> argparse.ArgumentParser:
    """Options shared by the commands that run collectors: ``--collectors`` and the flags the collectors declare."""
    from stagetrace.collectors import add_arguments

    parent = argparse.ArgumentParser(add_help=False)
    group = parent.add_argument_group(
        "collectors", "Each setting: its flag, else its environment variable, else default."
    )
    group.add_argument(
        "--collectors", metavar="LIST", help="comma-separated collectors to run (default: every default-enabled one)"
    )
    add_arguments(group)
    return parent


def _node(args):
    """The Node of the collectors the command line names (ValueError for an unknown name or a refused setting)."""
    from stagetrace.collectors import Options, build_node

    return build_node(args.collectors, Options.from_args(args))


def _log_to_stderr(prefix: str) -> None:
    logging.basicConfig(format=f"{prefix}: %(message)s")
    logging.getLogger("stagetrace").setLevel(logging.INFO)


def build_parser(collector_flags: bool = True) -> argparse.ArgumentParser:
    """The whole command line; ``collector_flags=False`` leaves out the flags the collectors declare (importing
    every collector to learn them), for a command line that runs neither ``collect`` nor ``agent``."""
    parser = argparse.ArgumentParser(prog="stagetrace", description="Tracing for stateless GPU inference pipelines.")
    parser.add_argument("--version", action="version", version=f"stagetrace {__version__}")
    parser.add_argument(
        "--store",
        metavar="DSN",
        dest=_STORE_BEFORE_COMMAND,
        default=None,
        help="the store of every command that reads or writes one, given before the command",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    store = _store_option()

    p = commands.add_parser("schema", parents=[store], help="create the ClickHouse tables (idempotent)")
    p.add_argument("--cluster", metavar="NAME", help="emit ON CLUSTER DDL with Replicated and Distributed tables")
    p.add_argument("--print", action="store_true", help="print the DDL instead of running it")
    p.add_argument(
        "--check",
        action="store_true",
        help="change nothing: say which generation of the Collector's layout each table has, which are "
        "stagetrace's own, and which are missing",
    )
    p.set_defaults(run=_schema)

    p = commands.add_parser("trace", parents=[store], help="show a request's spans in order")
    p.add_argument("request_id", nargs="?", metavar="REQUEST_ID")
    p.add_argument("--trace-id", metavar="TRACE_ID", help="look the trace up by its trace ID instead")
    p.add_argument("--json", action="store_true", help="print the trace as JSON")
    p.add_argument("--logs", action="store_true", help="show all the request's log lines, not only the first few")
    p.set_defaults(run=_trace)

    p = commands.add_parser("explain", parents=[store], help="why a request's output deviates: stage, change, hardware")
    p.add_argument("request_id", metavar="REQUEST_ID")
    p.add_argument("--against", metavar="OTHER_ID", help="compare with this request instead of the majority output")
    p.add_argument(
        "--window",
        metavar="DURATION",
        default="24h",
        help="peers: requests with the same input this close in time (default 24h)",
    )
    p.add_argument("--json", action="store_true", help="print the explanation as JSON")
    p.add_argument(
        "--html",
        metavar="FILE",
        type=Path,
        help="also write a self-contained incident report page (inline SVG, no network) to FILE",
    )
    p.set_defaults(run=_explain)

    p = commands.add_parser(
        "divergences", parents=[store], help="every group of same-input requests whose outputs disagree"
    )
    p.add_argument("--since", metavar="DURATION", default="1h", help="requests that started this long ago (default 1h)")
    p.add_argument(
        "--limit",
        metavar="N",
        type=int,
        default=100,
        help="analyse the latest N deviating requests in full (default 100; 0 for all)",
    )
    p.add_argument("--json", action="store_true", help="print the groups as JSON")
    p.set_defaults(run=_divergences)

    p = commands.add_parser("demo", parents=[store], help="run a simulated stateless GPU pipeline with injected faults")
    p.add_argument("--requests", type=int, default=1000, metavar="N", help="requests to serve (default 1000)")
    p.add_argument("--nodes", type=int, default=4, metavar="K", help="node processes, 2 to 16 (default 4)")
    p.add_argument(
        "--seed", type=int, default=7, metavar="S", help="the same seed gives the same requests, faults and outputs"
    )
    p.add_argument("--json", action="store_true", help="print {requests, deviating, truth} as JSON")
    earlier = p.add_mutually_exclusive_group()
    earlier.add_argument(
        "--fresh",
        action="store_true",
        help="remove earlier demo runs first: the demo's own spans, samples and ground truth; other "
        "services' data stays",
    )
    earlier.add_argument(
        "--append",
        action="store_true",
        help="add this run beside an earlier one (its own request IDs; counts then cover both)",
    )
    p.set_defaults(run=_demo)

    collectors = _collector_options() if collector_flags else argparse.ArgumentParser(add_help=False)
    p = commands.add_parser("collect", parents=[collectors], help="print one snapshot of every collector")
    p.add_argument("--once", action="store_true", help="one snapshot (the only mode; `agent` collects continuously)")
    p.add_argument(
        "--format", choices=("prometheus", "json"), default="prometheus", help="text exposition or JSON samples"
    )
    p.add_argument("--json", dest="format", action="store_const", const="json", help="same as --format json")
    p.set_defaults(run=_collect)

    p = commands.add_parser(
        "agent",
        parents=[store, collectors],
        help="serve /metrics, receive OTLP, write to ClickHouse, share an embedded store read-only",
    )
    p.add_argument(
        "--listen",
        metavar="HOST:PORT",
        default="127.0.0.1:9464",
        help="where /metrics is served (default 127.0.0.1:9464)",
    )
    p.add_argument(
        "--interval",
        metavar="DURATION",
        default="5s",
        help="how often samples are taken, e.g. 500ms, 5s, 1m (default 5s)",
    )
    p.add_argument(
        "--insert-every",
        metavar="DURATION",
        default=os.environ.get(STAGETRACE_INSERT_EVERY, "10s"),
        help="how often samples are inserted into the store, at least every interval "
        f"(default 10s, env {STAGETRACE_INSERT_EVERY})",
    )
    p.add_argument(
        "--otlp",
        metavar="HOST:PORT",
        default="127.0.0.1:4318",
        help="OTLP/HTTP receiver for spans, metrics and logs, or 'none' (default 127.0.0.1:4318)",
    )
    p.add_argument(
        "--otlp-grpc",
        metavar="HOST:PORT",
        default="127.0.0.1:4317",
        help="OTLP/gRPC receiver for spans, metrics and logs, or 'none' (default 127.0.0.1:4317)",
    )
    p.add_argument(
        "--query-listen",
        metavar="HOST:PORT",
        default=DEFAULT_QUERY_LISTEN,
        help="read-only ClickHouse HTTP endpoint sharing an embedded store with other commands and "
        f"Grafana, or 'none' (default {DEFAULT_QUERY_LISTEN})",
    )
    limits = p.add_argument_group(
        "query endpoint limits",
        "Applied to every query; no client can raise them. Each has an environment variable: "
        f"{STAGETRACE_QUERY_TIMEOUT}, _MAX_MEMORY, _MAX_THREADS, _MAX_RESULT_ROWS, _MAX_RESULT_BYTES, _MAX_CONCURRENT.",
    )
    limits.add_argument("--query-timeout", metavar="DURATION", help="per query (default 30s)")
    limits.add_argument("--query-max-memory", metavar="SIZE", help="per query, e.g. 512MiB (default 1GiB)")
    limits.add_argument("--query-max-threads", metavar="N", help="engine threads per query (default 2)")
    limits.add_argument("--query-max-result-rows", metavar="N", help="rows in a result (default 1000000)")
    limits.add_argument("--query-max-result-bytes", metavar="SIZE", help="bytes in a result (default 256MiB)")
    limits.add_argument(
        "--query-max-concurrent",
        metavar="N",
        help="queries in flight, one running; beyond, 503 with Retry-After (default 16)",
    )
    p.add_argument(
        "--low-priority",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="nice 10 and the lowest best-effort I/O class, for the engine's threads too (default: on for an "
        "embedded store)",
    )
    p.add_argument(
        "--token-file",
        metavar="FILE",
        help="bearer token required by the OTLP receiver and the query endpoint "
        f"(default: ${STAGETRACE_AGENT_TOKEN_FILE}, else ${STAGETRACE_AGENT_TOKEN}; neither: no token required)",
    )
    p.add_argument(
        "--query-open",
        action="store_true",
        help="let the query endpoint listen off loopback without a token or client certificates (it "
        "refuses to otherwise)",
    )
    p.add_argument(
        "--web-config-file",
        metavar="FILE",
        help="TLS and basic auth for every listener, in Prometheus' web configuration format "
        f"(tls_server_config, basic_auth_users; env {STAGETRACE_WEB_CONFIG_FILE})",
    )
    p.add_argument(
        "--otlp-logs",
        choices=("store", "none"),
        default=os.environ.get(STAGETRACE_OTLP_LOGS, "store"),
        help="OTLP log records (/v1/logs, LogsService) into otel_logs, bodies as sent, or none: refused "
        f"(default store; env {STAGETRACE_OTLP_LOGS})",
    )
    p.add_argument(
        "--agent-logs",
        choices=("store", "none"),
        default=os.environ.get(STAGETRACE_AGENT_LOGS, "none"),
        help="the agent's own log lines (INFO and above) into otel_logs too, service stagetrace-agent "
        f"(default none; env {STAGETRACE_AGENT_LOGS})",
    )
    p.add_argument(
        "--min-free-space",
        metavar="SIZE|PCT",
        help="refuse new writes (503 / UNAVAILABLE, the senders retry) while free space on the store's or "
        "the spool's filesystem is below this, e.g. 2GiB or 5%%, 0 for never (default 1GiB, at most 5%% "
        f"of the filesystem; env {STAGETRACE_MIN_FREE_SPACE})",
    )
    p.add_argument(
        "--analyse-every",
        metavar="DURATION",
        default=os.environ.get(STAGETRACE_ANALYSE_EVERY),
        help="run the live divergence analysis this often, 0 for never (default 1m with an embedded store, "
        f"0 with a server store, where `stagetrace analyse` runs it; env {STAGETRACE_ANALYSE_EVERY})",
    )
    p.set_defaults(run=_agent)

    p = commands.add_parser("analyse", parents=[store], help="the live divergence analysis as a loop, one per store")
    p.add_argument(
        "--every",
        metavar="DURATION",
        default=os.environ.get(STAGETRACE_ANALYSE_EVERY, "1m"),
        help=f"how often a pass runs (default 1m, env {STAGETRACE_ANALYSE_EVERY})",
    )
    p.add_argument(
        "--settle",
        metavar="DURATION",
        help="leave out requests this recent, whose spans may still arrive (default 10s, env "
        f"{STAGETRACE_ANALYSE_SETTLE}; the agent's analyser reads the same variables)",
    )
    p.add_argument(
        "--lookback",
        metavar="DURATION",
        help=f"same-input peers: requests this long before (default 1h, env {STAGETRACE_ANALYSE_LOOKBACK})",
    )
    p.add_argument(
        "--listen",
        metavar="HOST:PORT",
        default=os.environ.get(STAGETRACE_ANALYSE_LISTEN, "127.0.0.1:9465"),
        help="where the analyser's /metrics is served, or 'none' (default 127.0.0.1:9465)",
    )
    p.add_argument("--once", action="store_true", help="one pass, then exit (if this process gets the lease)")
    p.set_defaults(run=_analyse)

    from stagetrace.dashboards.command import add_provision_parser  # its options live with the provisioner

    add_provision_parser(commands, parents=[store])
    return parser


def _schema(args) -> int:
    from stagetrace import schema
    from stagetrace.store import open_store, parse_dsn

    if args.print:
        database = parse_dsn(args.store).database
        print(";\n\n".join(schema.statements(database, args.cluster)) + ";")
        return 0
    with open_store(args.store, create_schema=False) as store:
        if args.check:
            states = schema.check(store.client, store.database)
            width = max(len(table) for table, _ in states)
            for table, state in states:
                print(f"{table:<{width}}  {state}")
            return 1 if any(state == "missing" for _, state in states) else 0
        applied = store.ensure_schema(args.cluster)
        state = "created" if applied else "already up to date"
        print(f"schema version {schema.SCHEMA_VERSION} {state} in {store.location.redacted()}")
    return 0


def _trace(args) -> int:
    if bool(args.request_id) == bool(args.trace_id):
        print("stagetrace trace: give a REQUEST_ID or --trace-id TRACE_ID", file=sys.stderr)
        return 2
    from stagetrace import lookup
    from stagetrace.analysis import activity
    from stagetrace.analysis.hardware import context
    from stagetrace.analysis.pods import gpu_pods
    from stagetrace.store import open_store

    with open_store(args.store, must_exist=True) as store:
        try:
            found = (
                lookup.by_trace_id(store, args.trace_id)
                if args.trace_id
                else lookup.by_request_id(store, args.request_id)
            )
        except lookup.NotFound as exc:
            print(f"stagetrace: {exc} in {store.location.redacted()}", file=sys.stderr)
            return 1
        hardware = context(store, found)
        busy = activity.of_trace(store, found)
        pods = gpu_pods(store, found)
        logs = lookup.logs_of(store, found)
    if args.json:
        json.dump(
            {
                **found.to_json(),
                "resources": lookup.resources(found),
                "hardware": hardware,
                "activity": busy,
                "pods": pods,
                "logs": [line.to_json() for line in logs],
            },
            sys.stdout,
            indent=2,
            ensure_ascii=False,
        )
        sys.stdout.write("\n")
    else:
        from stagetrace.render import Output, gpu_activity, gpu_holders, hardware_rises, log_lines, waterfall

        out = Output()
        waterfall(out, found)
        gpu_activity(out, busy)
        gpu_holders(out, pods)
        hardware_rises(out, hardware)
        log_lines(out, logs, None if args.logs else FIRST_LOG_LINES)
    return 0


FIRST_LOG_LINES = 5  # `trace` shows this many of a request's log lines; --logs shows all


def _duration_ns(text: str, option: str) -> int:
    from stagetrace.settings import parse_duration

    try:
        return int(parse_duration(text) * 1e9)
    except ValueError as exc:
        raise _UsageError(f"{option}: {exc}") from None


class _UsageError(Exception):
    """A bad option value; the message is one line."""


def _explain(args) -> int:
    from stagetrace import lookup
    from stagetrace.analysis.explain import Explainer
    from stagetrace.store import open_store

    window = _duration_ns(args.window, "--window")
    with open_store(args.store, must_exist=True) as store:
        try:
            report = Explainer(store, window_ns=window).explain(args.request_id, args.against)
        except lookup.NotFound as exc:
            print(f"stagetrace: {exc} in {store.location.redacted()}", file=sys.stderr)
            return 1
        if args.html:
            from stagetrace.report import incident_html

            try:
                args.html.write_text(incident_html(store, report), encoding="utf-8")
            except OSError as exc:
                raise _UsageError(f"--html: cannot write {args.html}: {exc.strerror or exc}") from None
            print(f"wrote the incident report {args.html}", file=sys.stderr)
    if args.json:
        json.dump(report.to_json(), sys.stdout, indent=2, ensure_ascii=False)
        sys.stdout.write("\n")
    else:
        from stagetrace.render import Output, explanation

        explanation(Output(), report)
    return 0


def _divergences(args) -> int:
    from stagetrace.analysis import divergences
    from stagetrace.store import open_store

    since = _duration_ns(args.since, "--since")
    if args.limit < 0:
        raise _UsageError("--limit: give 0 (all) or a positive number")
    with open_store(args.store, must_exist=True) as store:
        report = divergences.compute(store, since, limit=args.limit or None)
        divergences.record(store, report)
        hint = _older_requests_hint(store, since, args.since) if not report.deviating else ""
    if hint:  # on stderr: the JSON on stdout stays what it was
        print(f"stagetrace divergences: {hint}", file=sys.stderr)
    if args.json:
        json.dump(report.to_json(), sys.stdout, indent=2, ensure_ascii=False)
        sys.stdout.write("\n")
    else:
        from stagetrace.render import Output, divergence_groups

        divergence_groups(Output(), report, args.since)
    return 0


# The latest request the store holds, whatever its age (run only when a window found nothing to show).
_LATEST_REQUEST_SQL = "SELECT toUnixTimestamp64Nano(max(Start)) FROM {db:Identifier}.stagetrace_requests"
HOUR_NS = 3_600_000_000_000


def _older_requests_hint(store, since_ns: int, since: str) -> str:
    """When the window holds no request but the store holds older ones: how old the latest is and a ``--since``
    that covers it (a newcomer who ran the demo an hour ago saw "0 deviating requests" and nothing else)."""
    latest = int(store.client.command(_LATEST_REQUEST_SQL, parameters={"db": store.database}) or 0)
    age_ns = time.time_ns() - latest
    if not latest or age_ns <= since_ns:  # an empty store, or requests in the window that simply agree
        return ""
    hours = math.ceil(age_ns / HOUR_NS)
    # the latest request and an hour or a day before it: its peers, which a baseline is chosen from, ran earlier
    cover = f"{hours + 1}h" if hours <= 48 else f"{math.ceil(hours / 24) + 1}d"
    age = (
        f"{math.ceil(age_ns / 60e9)} min"
        if age_ns < HOUR_NS
        else f"{age_ns / HOUR_NS:.1f} h"
        if hours <= 48
        else f"{age_ns / (24 * HOUR_NS):.1f} days"
    )
    return f"no request in the last {since}; the store's latest started {age} ago: try --since {cover}"


def _demo(args) -> int:
    """The demo, safe to interrupt: a Ctrl-C ends it in one line and exit status 130 (its child processes ignore
    it, ``demo._quiet``, and are stopped by this one; ``main`` installed ``_interrupt_once``)."""
    began, finished = [], []
    try:
        return _run_demo(args, began.append, finished.append)
    except KeyboardInterrupt:
        pass
    except Exception:
        if not _ctrl_c_pressed:
            raise
    if finished:
        what = " after the run completed: the store holds it whole"
    elif began:
        what = (
            "; the store marks this run as interrupted (stagetrace_demo_runs), and the next `stagetrace demo` "
            "removes what it wrote"
        )
    else:
        what = _BEFORE_THE_RUN
    print(f"stagetrace demo: interrupted{what}", file=sys.stderr)
    return 130


def _run_demo(args, began, finished) -> int:
    from stagetrace import demo
    from stagetrace.render import Output, demo_summary, progress_bar
    from stagetrace.store import StoreError, open_store

    with open_store(args.store) as store, progress_bar("serving requests", enabled=not args.json) as progress:
        if store.read_only:  # the demo writes: a store an agent holds is said to be held before anything else
            raise StoreError(store.client.refusal)
        try:
            earlier = "fresh" if args.fresh else "append" if args.append else "refuse"
            result = demo.run(
                store,
                requests=args.requests,
                nodes=args.nodes,
                seed=args.seed,
                progress=progress,
                earlier=earlier,
                notice=lambda line: print(f"stagetrace demo: {line}", file=sys.stderr),
                began=lambda: began(True),
            )
        except demo.DemoError as exc:
            print(f"stagetrace demo: {exc}", file=sys.stderr)
            return 2
        finished(True)
        location = store.location
    if args.json:
        json.dump(result.to_json(), sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        demo_summary(Output(), result, _invocation(), location.redacted() if args.store else "")
    return 0


def _invocation() -> str:
    """How this command was started, so printed next commands work when pasted (venv not activated)."""
    program = sys.argv[0]
    if os.path.basename(program) == "stagetrace":
        on_path = shutil.which("stagetrace")
        same = on_path is not None and os.path.realpath(on_path) == os.path.realpath(program)
        return "stagetrace" if same else shlex.quote(program)
    return f"{shlex.quote(sys.executable)} -m stagetrace"


def _collect(args) -> int:
    from stagetrace.agent import failed_collectors, samples_json
    from stagetrace.collectors.kubernetes import diagnose
    from stagetrace.exporters.prometheus import exposition

    _log_to_stderr("stagetrace")
    try:
        node = _node(args)
    except ValueError as exc:
        print(f"stagetrace: {exc}", file=sys.stderr)
        return 2
    try:
        families = list(node.collect())
    finally:
        node.close()
    if args.format == "json":
        json.dump(samples_json(families), sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(exposition(families).decode())
    # the scheduler's view against the hardware's (a shared GPU counted twice), on stderr: stdout stays the samples
    diagnosis = diagnose(families)
    if diagnosis:
        print(f"stagetrace: {diagnosis}", file=sys.stderr)
    # a collector asked for by name that could not collect is an error; an absent default one is not
    return 1 if args.collectors and failed_collectors(families) else 0


def _agent(args) -> int:
    from stagetrace import agent
    from stagetrace.agent_config import AgentConfig
    from stagetrace.config import TokenError

    _log_to_stderr("stagetrace agent")
    try:
        config = AgentConfig.from_args(args)
        node = _node(args)
    except (ValueError, TokenError) as exc:  # a WebConfigError is a ValueError
        print(f"stagetrace agent: {exc}", file=sys.stderr)
        return 2
    try:
        return agent.run(node, config)
    except agent.AgentError as exc:
        print(f"stagetrace agent: {exc}", file=sys.stderr)
        return 2


DURATION_OPTIONS = (
    "--since",
    "--window",
    "--interval",
    "--insert-every",
    "--analyse-every",
    "--every",
    "--settle",
    "--lookback",
)


def _analyse(args) -> int:
    import signal
    import socket
    import threading

    from stagetrace import agent_config
    from stagetrace.analysis import live
    from stagetrace.exporters.prometheus import parse_listen, serve
    from stagetrace.store import open_store

    _log_to_stderr("stagetrace analyse")
    for handler in logging.getLogger().handlers:  # the drivers log each retry; an outage is one line of its own
        handler.addFilter(lambda record: record.name.startswith("stagetrace"))
    try:
        schedule = agent_config.schedule(args.every, "--every", args.settle, args.lookback)
        listen = None if args.listen.lower() in ("none", "off") else args.listen
        if listen:
            parse_listen(listen)
    except ValueError as exc:
        print(f"stagetrace analyse: {exc}", file=sys.stderr)
        return 2
    with open_store(args.store) as store:
        if store.read_only:
            print(
                f"stagetrace analyse: store {store.location.redacted()} is read-only here: the agent that holds it "
                "runs the analysis itself (--analyse-every)",
                file=sys.stderr,
            )
            return 2
        analyser = live.Analyser(store, schedule)
        if args.once:
            done = analyser.step()
            try:
                analyser.release()
            except Exception as exc:  # the store went away after the pass: the lease runs out by itself
                logging.getLogger("stagetrace").debug("releasing the lease: %s", exc)
            print(
                "another analyser holds this store's lease"
                if done is None and not analyser.stats.failures
                else f"analysed {done.analysed} deviating requests"
                if done
                else "the pass failed"
            )
            return 0 if done else 1
        stop = threading.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
        server = None
        if listen:

            class Metrics:
                def collect(self):
                    return analyser.stats.families(os.environ.get(STAGETRACE_HOST) or socket.gethostname())

            try:
                server = serve(Metrics(), listen)
            except OSError as exc:
                print(
                    f"stagetrace analyse: cannot listen on {listen}: {exc.strerror or exc} (choose another with "
                    "--listen, or --listen none)",
                    file=sys.stderr,
                )
                return 2
            logging.getLogger("stagetrace").info("serving %s", server.url)
        logging.getLogger("stagetrace").info("analysing %s every %gs", store.location.redacted(), schedule.every_s)
        try:
            analyser.run(stop)
        finally:
            if server:
                server.close()
    return 0


def _joined_durations(argv: list[str]) -> list[str]:
    """``--since -1h`` as ``--since=-1h``: argparse takes a value that starts with '-' for an option and prints
    its usage; joined, the value reaches the duration check, which says in one line what to write."""
    out, i = [], 0
    while i < len(argv):
        if (
            argv[i] in DURATION_OPTIONS
            and i + 1 < len(argv)
            and argv[i + 1].startswith("-")
            and argv[i + 1][1:2].isdigit()
        ):
            out.append(f"{argv[i]}={argv[i + 1]}")
            i += 2
            continue
        out.append(argv[i])
        i += 1
    return out


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return next(a.choices for a in parser._actions if isinstance(a, argparse._SubParsersAction))


def _did_you_mean(word: str, known) -> str:
    """`` (did you mean --json?)`` for the known word closest to a mistyped one, or nothing when none is close."""
    import difflib

    close = difflib.get_close_matches(word, list(known), n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""


def _parse(parser: argparse.ArgumentParser, argv: list[str], command: str | None) -> argparse.Namespace:
    """The arguments; a mistyped command or option is named with the closest right one, and an option unknown to a
    command gets that command's usage, not the top level's (argparse hands unknown options up to the top level)."""
    commands = _subcommands(parser)
    if command is not None and command not in commands:
        parser.error(
            f"unknown command {command!r}{_did_you_mean(command, commands)}; the commands: " + ", ".join(commands)
        )
    args, extra = parser.parse_known_args(argv)
    if extra:
        sub = commands[args.command]
        options = [o for action in sub._actions for o in action.option_strings]
        unknown = next((word for word in extra if word.startswith("-")), extra[0])
        hint = _did_you_mean(unknown.split("=", 1)[0], options) if unknown.startswith("-") else ""
        sub.error(f"unrecognized argument{'s' if len(extra) > 1 else ''}: {' '.join(extra)}{hint}")
    before = getattr(args, _STORE_BEFORE_COMMAND)
    if before is not None:
        if not hasattr(args, "store"):
            commands[args.command].error("this command uses no store: leave out --store")
        if args.store is None:
            args.store = before
    return args


def _command_word(argv: list[str]) -> str | None:
    """The command's name: the first word that is neither an option nor the value of a top-level ``--store``."""
    words = iter(argv)
    for word in words:
        if word == "--store":
            next(words, None)
        elif not word.startswith("-"):
            return word
    return None


# Set by the demo's first Ctrl-C. The KeyboardInterrupt it raises inside the import of a compiled module can come out
# as another error (numpy's ImportError, the chdb driver's "engine not found", then a StoreError): once it is set,
# an error is the interrupt's, and the demo ends as interrupted rather than with that error.
_ctrl_c_pressed = False
_BEFORE_THE_RUN = " before the run began: nothing was written"


def _interrupt_once(signum, frame):
    """SIGINT's handler while the demo runs: a KeyboardInterrupt once; later ones are ignored, so that stopping the
    child processes and marking the run interrupted is not itself interrupted (a held-down Ctrl-C sends several)."""
    import signal

    global _ctrl_c_pressed
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _ctrl_c_pressed = True
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    argv = _joined_durations(sys.argv[1:] if argv is None else list(argv))
    command = _command_word(argv)
    if command == "demo" and threading_is_main():
        import signal

        global _ctrl_c_pressed
        _ctrl_c_pressed = False
        signal.signal(signal.SIGINT, _interrupt_once)
    try:
        args = _parse(build_parser(collector_flags=command in ("collect", "agent")), argv, command)
    except KeyboardInterrupt:
        if command == "demo":
            print(f"stagetrace demo: interrupted{_BEFORE_THE_RUN}", file=sys.stderr)
        return 130
    except Exception:
        if not _ctrl_c_pressed:
            raise
        print(f"stagetrace demo: interrupted{_BEFORE_THE_RUN}", file=sys.stderr)
        return 130
    try:
        return args.run(args)
    except (StoreError, SchemaError, _UsageError) as exc:
        print(f"stagetrace: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # e.g. piped into head: not an error worth a traceback
        sys.stdout = open(os.devnull, "w")
        return 0


def threading_is_main() -> bool:
    """Signal handlers can be installed from the main thread only (a test may call ``main`` from another)."""
    import threading

    return threading.current_thread() is threading.main_thread()


if __name__ == "__main__":
    sys.exit(main())
