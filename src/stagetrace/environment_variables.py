"""Every ``STAGETRACE_*`` environment variable, in one place: its name as a constant, its default, how a value is
written and one line of what it does (as opentelemetry-python's ``environment_variables`` module holds ``OTEL_*``).

Code reads a variable through its constant here (``os.environ.get(STAGETRACE_STORE)``, ``Setting(env=...)``), never
through a string of its own; ``tests/test_environment_variables.py`` fails on a ``STAGETRACE_`` name in the source that
is not registered. The table in ``docs/configuration.md`` is generated from :data:`VARIABLES`::

    python -m stagetrace.environment_variables --write docs/configuration.md   # rewrite the table between its markers
    python -m stagetrace.environment_variables                                # print it

Sizes and durations are written as everywhere (``stagetrace.settings``): ``256MiB``, ``1G``, ``1000000``; ``500ms``,
``5s``, ``1m``, ``1h``. A flag, where there is one, wins over its variable.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Variable:
    """One environment variable: ``default`` and ``value`` in words (Markdown), ``doc`` one line, ``page`` the docs
    page that explains it (relative to ``docs/``), ``topic`` the table's group."""

    name: str
    default: str
    value: str
    doc: str
    page: str
    topic: str


VARIABLES: dict[str, Variable] = {}

SIZE = "a size"
DURATION = "a duration"
PATH = "a path"
COUNT = "a positive integer"


def _variable(name: str, default: str, value: str, doc: str, page: str, topic: str) -> str:
    if name in VARIABLES or not name.startswith("STAGETRACE_"):
        raise ValueError(f"{name} is registered twice or is not a STAGETRACE_ name")
    VARIABLES[name] = Variable(name, default, value, doc, page, topic)
    return name


_STORE = "The store and the span API"
STAGETRACE_STORE = _variable(
    "STAGETRACE_STORE",
    "`chdb://$XDG_DATA_HOME/stagetrace/store` (`~/.local/share/…`)",
    "a store DSN: `chdb:///path`, `chdb://memory`, `http(s)://[user@]host:port/database`",
    "the store every command and the span API read and write (`--store` wins)",
    "store.md",
    _STORE,
)
STAGETRACE_STORE_USER = _variable(
    "STAGETRACE_STORE_USER",
    "`default`",
    "a ClickHouse user",
    "the server store's user where its DSN names none",
    "store.md",
    _STORE,
)
STAGETRACE_STORE_PASSWORD = _variable(
    "STAGETRACE_STORE_PASSWORD",
    "none",
    "text",
    "the server store's password (the `_FILE` variable keeps it out of the environment)",
    "store.md",
    _STORE,
)
STAGETRACE_STORE_PASSWORD_FILE = _variable(
    "STAGETRACE_STORE_PASSWORD_FILE",
    "none",
    PATH,
    "a file holding the server store's password; wins over `STAGETRACE_STORE_PASSWORD`",
    "store.md",
    _STORE,
)
STAGETRACE_SERVICE_NAME = _variable(
    "STAGETRACE_SERVICE_NAME",
    "`$OTEL_SERVICE_NAME`, else `inference`",
    "text",
    "the `service.name` of the span API's spans",
    "recording.md",
    _STORE,
)
STAGETRACE_RECORD_CONTENT = _variable(
    "STAGETRACE_RECORD_CONTENT",
    "off",
    "`1`, `true`, `yes` or `on` (any case): on",
    "the span API records stages' inputs and outputs themselves, not only their digests",
    "recording.md",
    _STORE,
)
STAGETRACE_PEER_KEY = _variable(
    "STAGETRACE_PEER_KEY",
    "`service.name,gen_ai.request.model`",
    "a comma-separated subset of `service.name`, `gen_ai.request.model`; `none`: the input digest alone",
    "which requests are peers, compared with each other, besides their input digest",
    "explain.md",
    _STORE,
)

_AGENT = "The agent"
STAGETRACE_HOST = _variable(
    "STAGETRACE_HOST",
    "this machine's hostname",
    "a name",
    "the host label on every series the agent exports",
    "agent.md",
    _AGENT,
)
STAGETRACE_INSERT_EVERY = _variable(
    "STAGETRACE_INSERT_EVERY",
    "`10s`",
    DURATION,
    "how often the agent inserts its samples into the store",
    "agent.md",
    _AGENT,
)
STAGETRACE_OTLP_LOGS = _variable(
    "STAGETRACE_OTLP_LOGS",
    "`store`",
    "`store` or `none`",
    "OTLP log records go into `otel_logs` (`store`) or are refused (`none`)",
    "otlp.md",
    _AGENT,
)
STAGETRACE_AGENT_LOGS = _variable(
    "STAGETRACE_AGENT_LOGS",
    "`none`",
    "`store` or `none`",
    "the agent's own log lines (INFO and above) go into `otel_logs` too",
    "otlp.md",
    _AGENT,
)
STAGETRACE_QUERY_TIMEOUT = _variable(
    "STAGETRACE_QUERY_TIMEOUT", "`30s`", DURATION, "the query endpoint's time per query", "otlp.md", _AGENT
)
STAGETRACE_QUERY_MAX_MEMORY = _variable(
    "STAGETRACE_QUERY_MAX_MEMORY", "`1GiB`", SIZE, "the query endpoint's memory per query", "otlp.md", _AGENT
)
STAGETRACE_QUERY_MAX_THREADS = _variable(
    "STAGETRACE_QUERY_MAX_THREADS", "`2`", COUNT, "the query endpoint's engine threads per query", "otlp.md", _AGENT
)
STAGETRACE_QUERY_MAX_RESULT_ROWS = _variable(
    "STAGETRACE_QUERY_MAX_RESULT_ROWS",
    "`1000000`",
    COUNT,
    "rows in one result of the query endpoint",
    "otlp.md",
    _AGENT,
)
STAGETRACE_QUERY_MAX_RESULT_BYTES = _variable(
    "STAGETRACE_QUERY_MAX_RESULT_BYTES",
    "`256MiB`",
    SIZE,
    "bytes in one result of the query endpoint",
    "otlp.md",
    _AGENT,
)
STAGETRACE_QUERY_MAX_CONCURRENT = _variable(
    "STAGETRACE_QUERY_MAX_CONCURRENT",
    "`16`",
    COUNT,
    "queries in flight at the query endpoint (one runs, the rest wait; beyond: 503)",
    "otlp.md",
    _AGENT,
)

_DURABLE = "Spool and free space"
STAGETRACE_SPOOL_DIR = _variable(
    "STAGETRACE_SPOOL_DIR",
    "`<store>.spool` beside an embedded store; `$XDG_STATE_HOME/stagetrace/spool/<host>-<port>-<db>` for a server",
    f"{PATH}; `off` disables the spool",
    "where batches the store did not take, and OTLP requests written ahead, wait",
    "reliability.md",
    _DURABLE,
)
STAGETRACE_SPOOL_MAX_BYTES = _variable(
    "STAGETRACE_SPOOL_MAX_BYTES",
    "`256MiB`",
    SIZE,
    "the spool's bound; beyond it the oldest batches are dropped",
    "reliability.md",
    _DURABLE,
)
STAGETRACE_SPOOL_KEEP_BYTES = _variable(
    "STAGETRACE_SPOOL_KEEP_BYTES",
    "`64MiB`, at most 2% of the filesystem",
    f"{SIZE}; `0`: none",
    "stored OTLP requests kept to restore a part the engine loses",
    "reliability.md",
    _DURABLE,
)
STAGETRACE_MIN_FREE_SPACE = _variable(
    "STAGETRACE_MIN_FREE_SPACE",
    "`1GiB`, at most 5% of the filesystem",
    f"{SIZE}, or a percentage `5%`; `0`: never",
    "new writes are refused (senders retry) while the store's or the spool's filesystem has less free",
    "reliability.md",
    _DURABLE,
)

_ANALYSIS = "Live analysis"
STAGETRACE_ANALYSE_EVERY = _variable(
    "STAGETRACE_ANALYSE_EVERY",
    "`1m`; in the agent, `0` with a server store",
    f"{DURATION}; `0`: never",
    "how often a live analysis pass runs (`stagetrace analyse`, and the agent's own)",
    "live.md",
    _ANALYSIS,
)
STAGETRACE_ANALYSE_SETTLE = _variable(
    "STAGETRACE_ANALYSE_SETTLE",
    "`10s`",
    DURATION,
    "requests this recent are left for a later pass: spans may still arrive",
    "live.md",
    _ANALYSIS,
)
STAGETRACE_ANALYSE_LOOKBACK = _variable(
    "STAGETRACE_ANALYSE_LOOKBACK",
    "`1h`",
    DURATION,
    "how far back a pass looks for same-input peers",
    "live.md",
    _ANALYSIS,
)
STAGETRACE_ANALYSE_LISTEN = _variable(
    "STAGETRACE_ANALYSE_LISTEN",
    "`127.0.0.1:9465`",
    "`HOST:PORT` or `none`",
    "where `stagetrace analyse` serves its `/metrics`",
    "live.md",
    _ANALYSIS,
)

_COLLECTORS = "Collectors"
STAGETRACE_SYSFS = _variable(
    "STAGETRACE_SYSFS", "`/sys`", PATH, "the sysfs root the RDMA and ethtool collectors read", "agent.md", _COLLECTORS
)
STAGETRACE_PROCFS = _variable(
    "STAGETRACE_PROCFS",
    "`/proc`",
    PATH,
    "the procfs root whose `<pid>/cgroup` names each GPU process's pod",
    "gpus.md",
    _COLLECTORS,
)
STAGETRACE_KUBELET_LOG_DIR = _variable(
    "STAGETRACE_KUBELET_LOG_DIR",
    "`/var/log`",
    PATH,
    "the host's `/var/log`, whose `pods/` and `containers/` name the kubelet's pods and containers",
    "gpus.md",
    _COLLECTORS,
)
STAGETRACE_KUBELET_SOCKET = _variable(
    "STAGETRACE_KUBELET_SOCKET",
    "`/var/lib/kubelet/pod-resources/kubelet.sock`",
    PATH,
    "the kubelet's PodResources socket; the kubernetes collector runs by default where it exists",
    "gpus.md",
    _COLLECTORS,
)
STAGETRACE_GPU_RESOURCES = _variable(
    "STAGETRACE_GPU_RESOURCES",
    "`nvidia.com/gpu*,nvidia.com/mig-*`",
    "comma-separated names or shell patterns",
    "the extended resources that are GPUs",
    "gpus.md",
    _COLLECTORS,
)
STAGETRACE_GPU_SHARING_FACTOR = _variable(
    "STAGETRACE_GPU_SHARING_FACTOR", "`1`", COUNT, "the allocations per physical GPU you intend", "gpus.md", _COLLECTORS
)
STAGETRACE_NETDEVS = _variable(
    "STAGETRACE_NETDEVS",
    "those behind RDMA ports, else every non-loopback one",
    "comma-separated netdevs",
    "the netdevs the ethtool collector reads",
    "fabric.md",
    _COLLECTORS,
)
STAGETRACE_ETHTOOL_INCLUDE = _variable(
    "STAGETRACE_ETHTOOL_INCLUDE",
    "none",
    "a regular expression",
    "also export every ethtool statistic whose name it matches",
    "fabric.md",
    _COLLECTORS,
)
STAGETRACE_RDMA_RAILS = _variable(
    "STAGETRACE_RDMA_RAILS",
    "every port is a rail named `DEVICE/PORT`",
    "comma-separated `NAME=DEVICE[:PORT]` or `DEVICE[:PORT]`",
    "the RDMA ports that are rails, and their names",
    "fabric.md",
    _COLLECTORS,
)
STAGETRACE_NCCL_DIR = _variable(
    "STAGETRACE_NCCL_DIR",
    "`$NCCL_INSPECTOR_DUMP_DIR`",
    PATH,
    "the directory NCCL Inspector dumps into",
    "fabric.md",
    _COLLECTORS,
)
STAGETRACE_NVML_FIXTURE = _variable(
    "STAGETRACE_NVML_FIXTURE",
    "none: the real library",
    PATH,
    "recorded NVML snapshots instead of the real library (the gpu and mps collectors, the resource detector)",
    "agent.md",
    _COLLECTORS,
)
STAGETRACE_MPS_FIXTURE = _variable(
    "STAGETRACE_MPS_FIXTURE",
    "none: the binary",
    PATH,
    "recorded `nvidia-cuda-mps-control` answers instead of the binary",
    "gpus.md",
    _COLLECTORS,
)
STAGETRACE_ETHTOOL_FIXTURE = _variable(
    "STAGETRACE_ETHTOOL_FIXTURE",
    "none: the ioctl",
    PATH,
    "recorded ethtool statistics instead of the ioctl",
    "fabric.md",
    _COLLECTORS,
)

_SECURITY = "Tokens and TLS"
STAGETRACE_AGENT_TOKEN = _variable(
    "STAGETRACE_AGENT_TOKEN",
    "none: no token required",
    "text",
    "the bearer token the agent's listeners require, and its clients send",
    "reliability.md",
    _SECURITY,
)
STAGETRACE_AGENT_TOKEN_FILE = _variable(
    "STAGETRACE_AGENT_TOKEN_FILE",
    "none",
    f"{PATH} (mode 600)",
    "a file holding the agent's token; wins over `STAGETRACE_AGENT_TOKEN`",
    "reliability.md",
    _SECURITY,
)
STAGETRACE_WEB_CONFIG_FILE = _variable(
    "STAGETRACE_WEB_CONFIG_FILE",
    "none: plain HTTP",
    f"{PATH}, Prometheus' web configuration format",
    "TLS and basic auth for every listener of the agent",
    "reliability.md",
    _SECURITY,
)
STAGETRACE_CA_FILE = _variable(
    "STAGETRACE_CA_FILE",
    "the system's CAs",
    PATH,
    "the CA the project's clients (and Grafana's data source) verify an agent's or a server's certificate with",
    "reliability.md",
    _SECURITY,
)
STAGETRACE_CLIENT_CERT_FILE = _variable(
    "STAGETRACE_CLIENT_CERT_FILE",
    "none",
    PATH,
    "the certificate the project's clients present when an agent asks",
    "reliability.md",
    _SECURITY,
)
STAGETRACE_CLIENT_KEY_FILE = _variable(
    "STAGETRACE_CLIENT_KEY_FILE", "none", PATH, "the key of `STAGETRACE_CLIENT_CERT_FILE`", "reliability.md", _SECURITY
)

_GRAFANA = "Grafana's data source (`stagetrace dashboards provision`)"
STAGETRACE_CLICKHOUSE_HOST = _variable(
    "STAGETRACE_CLICKHOUSE_HOST",
    "the `--store` server's host, else the agent's query endpoint",
    "a host name",
    "where Grafana connects to ClickHouse",
    "grafana.md",
    _GRAFANA,
)
STAGETRACE_CLICKHOUSE_PORT = _variable(
    "STAGETRACE_CLICKHOUSE_PORT",
    "the `--store` server's port, else ClickHouse's for the protocol",
    "a port",
    "the port Grafana connects to",
    "grafana.md",
    _GRAFANA,
)
STAGETRACE_CLICKHOUSE_PROTOCOL = _variable(
    "STAGETRACE_CLICKHOUSE_PROTOCOL",
    "`http`",
    "`http` or `native`",
    "the protocol Grafana speaks to ClickHouse",
    "grafana.md",
    _GRAFANA,
)
STAGETRACE_CLICKHOUSE_USER = _variable(
    "STAGETRACE_CLICKHOUSE_USER",
    "the `--store` server's user, else `default`",
    "a ClickHouse user",
    "the user Grafana connects as",
    "grafana.md",
    _GRAFANA,
)
STAGETRACE_CLICKHOUSE_PASSWORD = _variable(
    "STAGETRACE_CLICKHOUSE_PASSWORD",
    "the store's password when Grafana connects as its user",
    "text",
    "the data source's password; Grafana reads it from its own environment too",
    "grafana.md",
    _GRAFANA,
)
STAGETRACE_CLICKHOUSE_PASSWORD_FILE = _variable(
    "STAGETRACE_CLICKHOUSE_PASSWORD_FILE",
    "none",
    PATH,
    "a file holding the data source's password; wins over `STAGETRACE_CLICKHOUSE_PASSWORD`",
    "grafana.md",
    _GRAFANA,
)


# --- the docs' table ----------------------------------------------------------------------------------------------

BEGIN = "<!-- environment variables: generated by `python -m stagetrace.environment_variables --write`; do not edit -->"
END = "<!-- end of the generated environment variables -->"


def table() -> str:
    """Every variable as Markdown: one table per topic, in registration order."""
    lines: list[str] = []
    topics = list(dict.fromkeys(v.topic for v in VARIABLES.values()))
    for topic in topics:
        lines += ["", f"**{topic}**", "", "| variable | default | value | what | see |", "|---|---|---|---|---|"]
        for v in VARIABLES.values():
            if v.topic == topic:
                cells = (f"`{v.name}`", v.default, v.value, v.doc, f"[{v.page.removesuffix('.md')}]({v.page})")
                lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines[1:]) + "\n"


def rewritten(page: str) -> str:
    """``page`` with the text between its markers replaced by :func:`table`; ValueError if it lacks them."""
    start, end = page.find(BEGIN), page.find(END)
    if start < 0 or end < start:
        raise ValueError(f"the page has no {BEGIN!r} … {END!r} markers to write the table between")
    return page[: start + len(BEGIN)] + "\n" + table() + page[end:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m stagetrace.environment_variables",
        description="Print the table of STAGETRACE_* variables, or write it into a page.",
    )
    parser.add_argument("--write", metavar="PAGE", type=Path, help="rewrite the table between the page's markers")
    args = parser.parse_args(argv)
    if args.write is None:
        sys.stdout.write(table())
        return 0
    try:
        args.write.write_text(rewritten(args.write.read_text()))
    except (OSError, ValueError) as exc:
        print(f"{args.write}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
