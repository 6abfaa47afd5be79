"""``stagetrace provision``: its options and what it runs.

Heavy imports (PyYAML, grafana-client) wait until the command runs, so other commands start fast.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def add_provision_parser(commands, parents: list[argparse.ArgumentParser]) -> None:
    p = commands.add_parser(
        "provision",
        parents=parents,
        help="Grafana: ClickHouse data source, dashboards and alert rules",
        description="Provision Grafana from files (--to-dir) or over its HTTP API (--grafana-url, token from "
        "$GRAFANA_TOKEN or $GRAFANA_TOKEN_FILE).",
    )
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument(
        "--to-dir",
        metavar="DIR",
        type=Path,
        help="write a provisioning tree (datasources/, dashboards/, alerting/) to mount at /etc/grafana/provisioning",
    )
    target.add_argument(
        "--grafana-url",
        metavar="URL",
        help="create or update the folder, data source, dashboards and alert rules in a running Grafana",
    )
    p.add_argument(
        "--provisioning-path",
        metavar="PATH",
        default="/etc/grafana/provisioning",
        help="where Grafana will see DIR, for the dashboard provider's path (default /etc/grafana/provisioning)",
    )
    ch = p.add_argument_group(
        "ClickHouse data source",
        "Where Grafana connects. Defaults: $STAGETRACE_CLICKHOUSE_HOST/_PORT/_PROTOCOL/_USER, else the --store "
        "server. Password: $STAGETRACE_CLICKHOUSE_PASSWORD or $STAGETRACE_CLICKHOUSE_PASSWORD_FILE (files name the "
        "variable for Grafana to expand, never the password).",
    )
    ch.add_argument("--clickhouse-host", metavar="HOST")
    ch.add_argument("--clickhouse-port", metavar="PORT", type=int)
    ch.add_argument("--clickhouse-protocol", choices=("http", "native"), help="default http")
    ch.add_argument(
        "--clickhouse-secure", action="store_true", default=None, help="TLS (default: when --store is https)"
    )
    ch.add_argument("--clickhouse-user", metavar="USER", help="a read-only user is enough (default: the store's user)")
    ch.add_argument("--clickhouse-database", metavar="DB", help="default: the store's database")
    p.set_defaults(run=run)


def run(args) -> int:
    from stagetrace.dashboards.provisioning import ProvisionError, settings_from, write_tree

    try:
        settings = settings_from(
            store=args.store,
            host=args.clickhouse_host,
            port=args.clickhouse_port,
            protocol=args.clickhouse_protocol,
            secure=args.clickhouse_secure,
            user=args.clickhouse_user,
            database=args.clickhouse_database,
        )
        if settings.through_agent:
            print(settings.through_agent)
        if args.to_dir:
            for path in write_tree(args.to_dir, settings, args.provisioning_path):
                print(f"wrote {path}")
            if settings.password_needed:
                print("Grafana reads the data source password from $STAGETRACE_CLICKHOUSE_PASSWORD in its environment")
        else:
            from stagetrace.dashboards.grafana_api import provision

            provision(args.grafana_url, settings)
    except ProvisionError as exc:
        print(f"stagetrace provision: {exc}", file=sys.stderr)
        return 2
    return 0
