"""The ``stagetrace`` command line."""

from __future__ import annotations

import argparse
import json
import os
import sys

from stagetrace import __version__, config, lookup, schema
from stagetrace.store import StoreError, open_store, parse_dsn


def _store_option() -> argparse.ArgumentParser:
    parent = argparse.ArgumentParser(add_help=False)
    parent.add_argument(
        "--store",
        metavar="DSN",
        default=None,
        help=f"chdb:///path or http(s)://user@host:8123/db (env {config.ENV_STORE}; "
        f"password from {config.ENV_STORE_PASSWORD} or {config.ENV_STORE_PASSWORD_FILE}); "
        f"default chdb://{config.default_store_path()}",
    )
    return parent


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="stagetrace", description="Tracing for stateless GPU inference pipelines.")
    parser.add_argument("--version", action="version", version=f"stagetrace {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    store = _store_option()

    p = commands.add_parser("schema", parents=[store], help="create the ClickHouse tables (idempotent)")
    p.add_argument("--cluster", metavar="NAME", help="emit ON CLUSTER DDL with Replicated and Distributed tables")
    p.add_argument("--print", action="store_true", help="print the DDL instead of running it")
    p.set_defaults(run=_schema)

    p = commands.add_parser("trace", parents=[store], help="show a request's spans in order")
    p.add_argument("request_id", nargs="?", metavar="REQUEST_ID")
    p.add_argument("--trace-id", metavar="TRACE_ID", help="look the trace up by its trace ID instead")
    p.add_argument("--json", action="store_true", help="print the trace as JSON")
    p.set_defaults(run=_trace)
    return parser


def _schema(args) -> int:
    if args.print:
        database = parse_dsn(args.store).database
        print(";\n\n".join(schema.statements(database, args.cluster)) + ";")
        return 0
    with open_store(args.store, create_schema=False) as store:
        applied = store.ensure_schema(args.cluster)
        state = "created" if applied else "already up to date"
        print(f"schema version {schema.SCHEMA_VERSION} {state} in {store.location.redacted()}")
    return 0


def _trace(args) -> int:
    if bool(args.request_id) == bool(args.trace_id):
        print("stagetrace trace: give a REQUEST_ID or --trace-id TRACE_ID", file=sys.stderr)
        return 2
    with open_store(args.store) as store:
        try:
            found = lookup.by_trace_id(store, args.trace_id) if args.trace_id else lookup.by_request_id(store, args.request_id)
        except lookup.NotFound as exc:
            print(f"stagetrace: {exc} in {store.location.redacted()}", file=sys.stderr)
            return 1
    if args.json:
        json.dump(found.to_json(), sys.stdout, indent=2, ensure_ascii=False)
        sys.stdout.write("\n")
    else:
        from rich.console import Console

        from stagetrace.render import waterfall

        console = Console()
        console.print(waterfall(found, console.width))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except (StoreError, schema.SchemaError) as exc:
        print(f"stagetrace: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # e.g. piped into head: not an error worth a traceback
        sys.stdout = open(os.devnull, "w")
        return 0


if __name__ == "__main__":
    sys.exit(main())
