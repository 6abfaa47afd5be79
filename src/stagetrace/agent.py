"""``stagetrace agent`` and ``stagetrace collect``: the node's collectors on ``/metrics`` and in ClickHouse.

The agent serves ``/metrics`` (collected at scrape time) and, every interval, collects once more and
writes the samples to the store. It also receives OTLP/HTTP (``exporters.otlp``) into the same store and,
when that is an embedded store on disk, which only this process can then open, shares it read-only with the
other commands through a query endpoint (``hub``). SIGTERM or SIGINT stops it: it writes what it holds and
exits 0.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import platform
import signal
import socket
import threading
import time

from stagetrace import httpd, hub
from stagetrace.agent_config import AgentConfig
from stagetrace.collectors.base import Node
from stagetrace.environment_variables import STAGETRACE_AGENT_TOKEN
from stagetrace.exporters import diskspace, spool
from stagetrace.exporters.agent_logs import StoreLogHandler
from stagetrace.exporters.clickhouse import ClickHouseMetricWriter
from stagetrace.exporters.durable import DurableWriter
from stagetrace.exporters.otlp import OtlpReceiver
from stagetrace.exporters.prometheus import parse_listen, serve
from stagetrace.exporters.restore import Restorer
from stagetrace.part_guard import CHECK_EVERY_S as GUARD_EVERY_S, PartGuard
from stagetrace.store import AGENT_ENGINE, open_store, parse_dsn, without_dataframe_checks
from stagetrace.store_health import StoreHealth

logger = logging.getLogger("stagetrace.agent")

LOW_PRIORITY_NICE = 10  # added to the agent's niceness: the GPUs' own host processes go first
_IOPRIO_SET = {"x86_64": 251, "aarch64": 30}  # the ioprio_set system call's number
_IOPRIO_BEST_EFFORT_LOWEST = (2 << 13) | 7  # IOPRIO_PRIO_VALUE(IOPRIO_CLASS_BE, 7), as `ionice -c2 -n7`


class AgentError(Exception):
    """An expected failure to start the agent; its message is one line a person can act on."""


def lower_priority() -> list[str]:
    """Lower the CPU (nice) and I/O (best effort, lowest level) priority of this thread, which on Linux the
    threads it starts afterwards inherit: call it before any other starts. What was lowered, for the log."""
    done = []
    try:
        os.setpriority(os.PRIO_PROCESS, 0, min(19, os.getpriority(os.PRIO_PROCESS, 0) + LOW_PRIORITY_NICE))
        done.append(f"nice {os.getpriority(os.PRIO_PROCESS, 0)}")
    except (OSError, AttributeError) as exc:
        logger.warning("cannot lower the CPU priority: %s", exc)
    number = _IOPRIO_SET.get(platform.machine())
    if number is not None:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.syscall(number, 1, 0, _IOPRIO_BEST_EFFORT_LOWEST) == 0:  # IOPRIO_WHO_PROCESS, this thread
            done.append("I/O best-effort 7")
        else:
            logger.warning("cannot lower the I/O priority: %s", os.strerror(ctypes.get_errno()))
    return done


class SerializedNode:
    """The node behind a lock, so a scrape and the writer's sample never run the collectors at once."""

    def __init__(self, node: Node):
        self.node = node
        self._lock = threading.Lock()
        self.analysis = None  # the live analyser's Stats, when it runs here
        self.health = None  # the store's StoreHealth (broken parts), when the agent checks it

    def collect(self) -> list:
        with self._lock:
            # with what the exporters dropped, so /metrics and the store show losses, not only the collectors
            analysis = list(self.analysis.families(self.node.host)) if self.analysis else []
            health = list(self.health.families(self.node.host)) if self.health else []
            return [*self.node.collect(), *spool.DROPPED.families(self.node.host), *health, *analysis]

    def collect_samples(self) -> list:
        """What the writer stores: the collectors' ``Samples`` as they are (building client_python's families of
        them took 1.8 of a scrape's 4.1 ms on the fixture node), the drop counters' and the store's health's."""
        with self._lock:
            health = list(self.health.families(self.node.host)) if self.health else []
            return [*self.node.collect_samples(), *spool.DROPPED.families(self.node.host), *health]


def failed_collectors(families) -> list[str]:
    """The collectors whose ``stagetrace_collector_success`` is 0 in these families."""
    return [
        sample.labels["collector"]
        for family in families
        if family.name == "stagetrace_collector_success"
        for sample in family.samples
        if sample.value == 0
    ]


def samples_json(families) -> list[dict]:
    """One ``{name, type, help, labels, value}`` per sample, for ``collect --format json``."""
    return [
        {"name": s.name, "type": f.type, "help": f.documentation, "labels": dict(s.labels), "value": s.value}
        for f in families
        for s in f.samples
        if not (f.type == "counter" and s.name.endswith("_created"))
    ]


def _bind(start, listen: str, flag: str, what: str = ""):
    """``start()``, or AgentError naming the address and the option that chooses another."""
    try:
        return start()
    except OSError as exc:
        off = f", or {flag} none" if what else ""
        raise AgentError(
            f"cannot listen on {listen}{what}: {exc.strerror or exc} (choose another with {flag}{off})"
        ) from None


def _busy(listens: list[tuple[str | None, str]]) -> list[str]:
    """The addresses (with the option that sets each) that something else listens on now: all of them found before
    anything starts, so that a person fixes every one at once, not one per start."""
    busy = []
    for listen, flag in listens:
        if not listen:
            continue
        host, port = parse_listen(listen)
        if not port:
            continue
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers bind: TIME_WAIT is no owner
            try:
                probe.bind((host, port))
            except OSError as exc:
                busy.append(f"{listen} ({flag}: {exc.strerror or exc})")
    return busy


def _exposed(listen: str, what: str, token: str | None) -> None:
    if token is None and not httpd.is_loopback(parse_listen(listen)[0]):
        logger.warning(
            "%s listens on %s without a token: anyone who can reach it can use it (set one with --token-file or %s)",
            what,
            listen,
            STAGETRACE_AGENT_TOKEN,
        )


def run(node: Node, config: AgentConfig, stop: threading.Event | None = None) -> int:
    """Serve and write as ``config`` says (``agent_config``) until ``stop`` is set or SIGTERM/SIGINT arrives;
    returns the exit status (0).

    Samples are inserted at most every ``config.insert_every_s`` (at least every interval), so a short interval
    costs scrapes, not engine inserts. The store is checked for parts the engine detached as broken at start and
    every minute (``store_health``); ``config.agent_logs``: the agent's own log lines go into ``otel_logs`` as well
    (``exporters.agent_logs``).
    """
    busy = _busy(config.listeners())
    if len(busy) > 1:  # one alone gets the message of the listener that fails, below
        raise AgentError(
            f"cannot listen on {', '.join(busy)}: choose other addresses with those options "
            "(or none for the receivers and the query endpoint)"
        )
    listen, otlp, otlp_grpc, query_listen = (config.listen, config.otlp, config.otlp_grpc, config.query_listen)
    token, web, interval_s = config.token, config.web, config.interval_s
    stop = stop or threading.Event()
    shared = SerializedNode(node)
    embedded = parse_dsn(config.store).embedded
    low = embedded if config.low_priority is None else config.low_priority
    lowered = lower_priority() if low else []
    with contextlib.ExitStack() as cleanup:  # undone in reverse: signals, listeners, writers (flush), store, node
        cleanup.callback(node.close)
        without_dataframe_checks()
        # Never through another agent's query endpoint: this agent must hold the store it writes.
        opened = open_store(config.store, agent_fallback=False, engine=AGENT_ENGINE)
        cleanup.callback(opened.close)
        location = opened.location
        reserve = config.reserve
        spool_base = spool.directory_setting(location)
        headroom = diskspace.Headroom(
            {"store": location.path if location.embedded else None, "spool": spool_base}, reserve
        )
        if config.agent_logs:
            own = StoreLogHandler(opened, node.host, headroom=headroom)
            cleanup.callback(own.close)  # after it is removed: what it holds is written
            logging.getLogger("stagetrace").addHandler(own)
            cleanup.callback(logging.getLogger("stagetrace").removeHandler, own)
        checked = opened.another()  # a server store's client runs one query at a time
        # the receivers' spool keeps what they stored, to restore the rows of a part the engine loses
        restorer = Restorer(checked, spool_base / "spans" if spool_base else None)
        health = StoreHealth(checked, restore=restorer)
        if health.store is not opened:
            cleanup.callback(health.store.close)
        health.check()  # at start: what the engine moved aside while loading the tables
        shared.health = health
        guard = None
        if location.embedded and location.path:  # a server's disks and merges are its operator's
            guard = PartGuard(
                checked,
                headroom,
                after_reload=lambda short: health.check(known=short),
                settled=lambda: not restorer.waiting,
            )
            guard.check()  # what the engine loaded: the parts made from now on are checked
            cleanup.callback(guard.close)
            guarding = threading.Event()
            cleanup.callback(_guard_thread(guard, guarding).join, 30)
            cleanup.callback(guarding.set)
        writer = ClickHouseMetricWriter(
            opened,
            host=node.host,
            create_schema=False,
            headroom=headroom,
            insert_every_s=max(config.insert_every_s, interval_s),
        )
        cleanup.callback(writer.close)
        server = _bind(lambda: serve(shared, listen, web=web), listen, "--listen")
        cleanup.callback(server.close)
        endpoints = {"metrics": server.url, "database": opened.database, "token": token is not None}
        if otlp or otlp_grpc:
            if otlp:
                _exposed(otlp, "the OTLP receiver", token)
            receiver = _bind(
                lambda: OtlpReceiver(
                    opened, otlp, token=token, web=web, headroom=headroom, logs=config.otlp_logs, part_guard=guard
                ),
                otlp or "",
                "--otlp",
                " for OTLP",
            )
            cleanup.callback(receiver.close)  # before the store closes: its replay stops
            if otlp:
                endpoints["otlp"] = receiver.url
            if otlp_grpc:
                from stagetrace.exporters.otlp_grpc import OtlpGrpcServer  # grpc is loaded only when served

                _exposed(otlp_grpc, "the OTLP/gRPC receiver", token)
                grpc_server = _bind(
                    lambda: OtlpGrpcServer(receiver, otlp_grpc, tls=web.tls if web else None),
                    otlp_grpc,
                    "--otlp-grpc",
                    " for OTLP/gRPC",
                )
                cleanup.callback(grpc_server.close)  # first: calls in flight finish before the receiver closes
                endpoints["otlp_grpc"] = grpc_server.url
        else:  # no receiver, whose writer would: store what processes that found the store held handed over
            cleanup.callback(DurableWriter(opened, "spans", headroom=headroom, part_guard=guard).close)
        if query_listen and location.embedded and location.path:
            # who reaches it must show something: a token, a basic-auth user, or a certificate the CA signed
            verified = web is not None and bool(
                web.users or (web.tls and web.tls.client_auth == "RequireAndVerifyClientCert")
            )
            exposed = not httpd.is_loopback(parse_listen(query_listen)[0])
            if token is None and not verified and not config.query_open and exposed:
                raise AgentError(
                    f"the query endpoint would read the store for anyone who can reach {query_listen}: "
                    "give it a token (--token-file) or require client certificates (--web-config-file), "
                    "keep it on loopback, or accept that with --query-open"
                )
            _exposed(query_listen, "the query endpoint", token)
            endpoint = _bind(
                lambda: hub.QueryEndpoint(
                    location.path,
                    query_listen,
                    database=location.database,
                    token=token,
                    limits=config.query_limits,
                    web=web,
                ),
                query_listen,
                "--query-listen",
                " for queries",
            )
            cleanup.callback(endpoint.close)
            endpoints["query"] = endpoint.url
            cleanup.callback(hub.withdraw, hub.advertise(location.path, **endpoints))
        analysis = config.analysis
        if analysis and (embedded or config.analysis_asked):
            from stagetrace.analysis import live

            shared.analysis = live.Stats()
            analysed = opened.another()  # a server store's client runs one query at a time: the writers use it
            if analysed is not opened:
                cleanup.callback(analysed.close)
            _, analysing, thread = live.start(analysed, analysis, shared.analysis)
            cleanup.callback(thread.join, 30)  # a pass in progress ends before the store closes
            cleanup.callback(analysing.set)
            logger.info("analysing divergences every %gs (--analyse-every 0 to turn off)", analysis.every_s)
        for sig in (signal.SIGTERM, signal.SIGINT):
            cleanup.callback(signal.signal, sig, signal.signal(sig, lambda *_: stop.set()))
        logger.info(
            "serving %s, sampling every %gs into %s (collectors: %s)",
            server.url,
            interval_s,
            location.redacted(),
            ", ".join(c.name for c in node.collectors) or "none",
        )
        if lowered:
            logger.info("running at low priority: %s (--no-low-priority to turn off)", ", ".join(lowered))
        if not headroom.off:
            logger.info(
                "refusing writes while free space under %s is below %s (--min-free-space)",
                " or ".join(str(p) for p in headroom.paths.values()),
                reserve,
            )
        if "otlp" in endpoints:
            logger.info("receiving OTLP/HTTP at %s/v1/traces and /v1/metrics", endpoints["otlp"])
        if "otlp_grpc" in endpoints:
            logger.info("receiving OTLP/gRPC at %s (TraceService, MetricsService)", endpoints["otlp_grpc"])
        if "query" in endpoints:
            logger.info("sharing the store read-only at %s (ClickHouse HTTP interface)", endpoints["query"])
        elif query_listen:
            why = (
                "an in-memory store cannot be shared"
                if location.embedded
                else "other commands reach the server directly"
            )
            logger.info("no query endpoint: %s", why)
        due = time.monotonic()
        said = None
        diagnosing = any(c.name == "kubernetes" for c in node.collectors)  # nothing to read on every scrape else
        while True:
            headroom.room()  # space back is said when it is back, not at the next request
            if health.due():
                health.check()
            collected = shared.collect_samples()
            writer.write(collected)
            if diagnosing:
                said = _say_diagnosis(collected, node.host, said)
            # keep the cadence; after a stall (slow store, suspended host) start again from now
            due = max(due + interval_s, time.monotonic())
            if stop.wait(due - time.monotonic()):
                break
        logger.info("stopping")
    return 0


def _guard_thread(guard: PartGuard, stop: threading.Event) -> threading.Thread:
    """The part guard's rounds, every second until ``stop`` (``part_guard``)."""

    def rounds() -> None:
        while not stop.wait(GUARD_EVERY_S):
            guard.check()

    thread = threading.Thread(target=rounds, name="stagetrace-part-guard", daemon=True)
    thread.start()
    return thread


def _say_diagnosis(collected, host: str, said: str | None) -> str | None:
    """Log the kubernetes collector's one-line diagnosis (a GPU the scheduler counts twice) when it changes."""
    from stagetrace.metrics import Samples
    from stagetrace.collectors.kubernetes import DIAGNOSIS_INPUTS, diagnose

    read = Samples()  # only what the diagnosis reads: families of a whole scrape cost more than the scrape's rows
    for item in collected:
        if isinstance(item, Samples):
            for spec, values, value in item.series():
                if spec.name in DIAGNOSIS_INPUTS:
                    read.add_series(spec, values, value)
    line = diagnose(read.families(host))
    if line != said:
        if line:
            logger.warning("%s", line)
        elif said:
            logger.info("the kubelet's GPU allocations agree with the hardware again")
    return line


__all__ = ["AgentError", "SerializedNode", "failed_collectors", "lower_priority", "run", "samples_json"]
