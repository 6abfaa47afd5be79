"""The agent's configuration: one frozen object, built in one place from the flags, the environment and the
defaults, that ``agent.run`` receives whole (as dcgm-exporter's ``appconfig`` is handed to every package).

Each value is its flag if given, else its ``STAGETRACE_*`` variable (``environment_variables``), else its default;
text a parser refuses is a ValueError naming the flag (or the variable), one line a person can act on. The live
analyser's schedule is read here too, the same way for the agent's analyser and for ``stagetrace analyse``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from stagetrace.config import DEFAULT_QUERY_LISTEN
from stagetrace.environment_variables import (
    STAGETRACE_AGENT_LOGS,
    STAGETRACE_ANALYSE_EVERY,
    STAGETRACE_ANALYSE_LOOKBACK,
    STAGETRACE_ANALYSE_SETTLE,
    STAGETRACE_INSERT_EVERY,
    STAGETRACE_OTLP_LOGS,
)
from stagetrace.settings import Setting, parse_duration, parse_size

if TYPE_CHECKING:
    from stagetrace.analysis.live import Schedule
    from stagetrace.exporters.diskspace import Reserve
    from stagetrace.hub import QueryLimits
    from stagetrace.web_config import WebConfig

DEFAULT_LISTEN = "127.0.0.1:9464"
DEFAULT_OTLP = "127.0.0.1:4318"
DEFAULT_OTLP_GRPC = "127.0.0.1:4317"
DEFAULT_ANALYSE_EVERY = "1m"
OFF = ("none", "off")  # an address written so: that listener does not start


def _store_or_none(text: str) -> bool:
    if text not in ("store", "none"):
        raise ValueError(f"{text!r} is neither store nor none")
    return text == "store"


INSERT_EVERY = Setting("insert_every_s", parse_duration, "10s", STAGETRACE_INSERT_EVERY, "--insert-every")
OTLP_LOGS = Setting("otlp_logs", _store_or_none, "store", STAGETRACE_OTLP_LOGS, "--otlp-logs")
AGENT_LOGS = Setting("agent_logs", _store_or_none, "none", STAGETRACE_AGENT_LOGS, "--agent-logs")


def _whole(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{text!r} is not a whole number") from None


# how each query limit's text is read (hub.QueryLimits.OPTIONS names each field's flag and variable)
_LIMIT_PARSERS = {"timeout_s": parse_duration, "max_memory_bytes": parse_size, "max_result_bytes": parse_size}


def _default_schedule() -> Schedule:
    from stagetrace.analysis.live import Schedule

    return Schedule()


def _default_limits() -> QueryLimits:
    from stagetrace.hub import QueryLimits

    return QueryLimits()


def _default_reserve() -> Reserve:
    from stagetrace.exporters.diskspace import DEFAULT

    return DEFAULT


@dataclass(frozen=True)
class AgentConfig:
    """Everything ``stagetrace agent`` is told, apart from its collectors (the ``Node``).

    Addresses are ``HOST:PORT``; None: that receiver or endpoint is off. ``token``, when set, is required by the
    receivers and the query endpoint. ``analysis`` is the live analyser's schedule (None: off); it runs with an
    embedded store, and with a server store (whose analyser is ``stagetrace analyse``, one per store) only when
    asked for (``analysis_asked``). ``low_priority`` None: on for an embedded store. ``reserve``: the free space
    kept on the store's and the spool's filesystems, below which writes are refused.
    """

    store: str | None = None  # a DSN; None: $STAGETRACE_STORE, else the default path (store.open_store)
    listen: str = DEFAULT_LISTEN
    otlp: str | None = DEFAULT_OTLP
    otlp_grpc: str | None = DEFAULT_OTLP_GRPC
    query_listen: str | None = DEFAULT_QUERY_LISTEN
    interval_s: float = 5.0
    insert_every_s: float = 10.0  # samples are inserted at most this often, at least every interval
    token: str | None = None
    web: WebConfig | None = None
    query_open: bool = False
    query_limits: QueryLimits = field(default_factory=_default_limits)
    analysis: Schedule | None = field(default_factory=_default_schedule)
    analysis_asked: bool = False
    reserve: Reserve = field(default_factory=_default_reserve)
    low_priority: bool | None = None
    otlp_logs: bool = True
    agent_logs: bool = False

    def listeners(self) -> list[tuple[str | None, str]]:
        """Each address with the flag that sets it."""
        return [
            (self.listen, "--listen"),
            (self.otlp, "--otlp"),
            (self.otlp_grpc, "--otlp-grpc"),
            (self.query_listen, "--query-listen"),
        ]

    @classmethod
    def from_args(cls, args: Any, environ: Mapping[str, str] = os.environ) -> AgentConfig:
        """The agent command line's configuration (``args`` as argparse gives it): ValueError or
        ``config.TokenError`` with one line for a value it refuses."""
        from stagetrace import web_config
        from stagetrace.config import load_token
        from stagetrace.exporters import diskspace
        from stagetrace.httpd import parse_listen

        otlp, otlp_grpc, query_listen = (
            None if text.lower() in OFF else text for text in (args.otlp, args.otlp_grpc, args.query_listen)
        )
        for address in filter(None, (args.listen, otlp, otlp_grpc, query_listen)):
            parse_listen(address)
        try:
            interval = parse_duration(args.interval)
        except ValueError as exc:
            raise ValueError(f"--interval: {exc}") from None
        every = args.analyse_every if args.analyse_every is not None else environ.get(STAGETRACE_ANALYSE_EVERY)
        asked = bool((every or "").strip())
        off = asked and is_zero(every)
        return cls(
            store=args.store,
            listen=args.listen,
            otlp=otlp,
            otlp_grpc=otlp_grpc,
            query_listen=query_listen,
            interval_s=interval,
            insert_every_s=INSERT_EVERY.value(args.insert_every, environ),
            token=load_token(args.token_file),
            web=web_config.load(args.web_config_file),
            query_open=args.query_open,
            query_limits=query_limits(args, environ),
            analysis=None
            if off
            else schedule(every if asked else DEFAULT_ANALYSE_EVERY, "--analyse-every", environ=environ),
            analysis_asked=asked,
            reserve=diskspace.reserve_setting(args.min_free_space),
            low_priority=args.low_priority,
            otlp_logs=OTLP_LOGS.value(args.otlp_logs, environ),
            agent_logs=AGENT_LOGS.value(args.agent_logs, environ),
        )


def query_limits(args: Any, environ: Mapping[str, str] = os.environ) -> QueryLimits:
    """The query endpoint's limits: each from its option, else its environment variable, else the default."""
    from stagetrace.hub import QueryLimits

    chosen = {}
    for name, (option, variable) in QueryLimits.OPTIONS.items():
        text = getattr(args, option[2:].replace("-", "_")) or environ.get(variable)
        if text is None:
            continue
        try:
            chosen[name] = _LIMIT_PARSERS.get(name, _whole)(text)
        except ValueError as exc:
            raise ValueError(f"{option} ({variable}): {exc}") from None
    return QueryLimits(**chosen)


def is_zero(text: str) -> bool:
    """``0``, ``0s``, ``0ms``...: a duration of nothing (which turns analysis off, or the settle delay)."""
    return re.fullmatch(r"\s*0+(\.0*)?\s*(ms|s|m|h|d|w)?\s*", text) is not None


def schedule(
    every: str,
    flag: str,
    settle: str | None = None,
    lookback: str | None = None,
    environ: Mapping[str, str] = os.environ,
) -> Schedule:
    """The live analyser's schedule: each duration from its option, else its environment variable, else default."""
    from stagetrace.analysis import live

    texts = {
        flag: every,
        "--settle": settle or environ.get(STAGETRACE_ANALYSE_SETTLE),
        "--lookback": lookback or environ.get(STAGETRACE_ANALYSE_LOOKBACK),
    }
    seconds = {}
    for option, text in texts.items():
        if not (text or "").strip():  # unset, or set empty: the default
            continue
        try:
            seconds[option] = 0.0 if is_zero(text) else parse_duration(text)
        except ValueError as exc:
            raise ValueError(f"{option}: {exc}") from None
    if seconds[flag] <= 0:
        raise ValueError(f"{flag} must be a positive duration such as 30s or 1m")
    return live.Schedule(
        every_s=seconds[flag],
        settle_s=seconds.get("--settle", live.DEFAULT_SETTLE_S),
        lookback_s=seconds.get("--lookback", live.DEFAULT_LOOKBACK_S),
    )


__all__ = ["AgentConfig", "is_zero", "query_limits", "schedule"]
