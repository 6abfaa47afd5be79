"""The agent's configuration, built once from the real command line's flags, an environment and the defaults."""

import dataclasses

import pytest

from stagetrace.agent_config import AgentConfig
from stagetrace.cli import build_parser
from stagetrace.environment_variables import (
    STAGETRACE_AGENT_LOGS,
    STAGETRACE_ANALYSE_EVERY,
    STAGETRACE_ANALYSE_SETTLE,
    STAGETRACE_INSERT_EVERY,
    STAGETRACE_OTLP_LOGS,
    STAGETRACE_QUERY_MAX_MEMORY,
    STAGETRACE_QUERY_MAX_THREADS,
)


def config(*flags: str, environ: dict | None = None) -> AgentConfig:
    args = build_parser(collector_flags=False).parse_args(["agent", *flags])
    return AgentConfig.from_args(args, environ or {})


def test_the_defaults_are_the_flags_defaults(monkeypatch):
    for name in (STAGETRACE_INSERT_EVERY, STAGETRACE_OTLP_LOGS, STAGETRACE_AGENT_LOGS, STAGETRACE_ANALYSE_EVERY):
        monkeypatch.delenv(name, raising=False)  # the parser's defaults read the process's environment
    built = config()
    assert built == dataclasses.replace(AgentConfig(), analysis=built.analysis)
    assert (built.listen, built.otlp, built.otlp_grpc) == ("127.0.0.1:9464", "127.0.0.1:4318", "127.0.0.1:4317")
    assert built.analysis.every_s == 60.0 and not built.analysis_asked  # on by default, for an embedded store
    with pytest.raises(dataclasses.FrozenInstanceError):
        built.token = "x"


def test_a_flag_wins_over_its_variable_which_wins_over_the_default(monkeypatch):
    monkeypatch.delenv(STAGETRACE_INSERT_EVERY, raising=False)
    environ = {
        STAGETRACE_QUERY_MAX_MEMORY: "512MiB",
        STAGETRACE_QUERY_MAX_THREADS: "4",
        STAGETRACE_ANALYSE_SETTLE: "30s",
    }
    built = config("--query-max-threads", "8", "--insert-every", "1m", environ=environ)
    assert built.query_limits.max_memory_bytes == 512 << 20  # the variable
    assert built.query_limits.max_threads == 8  # the flag
    assert built.query_limits.timeout_s == 30.0  # the default
    assert built.insert_every_s == 60.0
    assert built.analysis.settle_s == 30.0


def test_none_turns_a_listener_off_and_zero_the_analysis():
    built = config("--otlp", "none", "--otlp-grpc", "off", "--query-listen", "none", "--analyse-every", "0")
    assert (built.otlp, built.otlp_grpc, built.query_listen, built.analysis) == (None, None, None, None)
    assert built.analysis_asked  # asked for: the analyser then runs with a server store too
    assert [flag for address, flag in built.listeners() if address] == ["--listen"]


@pytest.mark.parametrize(
    "flags, environ, message",
    [
        (["--interval", "5"], {}, r"--interval: '5' is not a positive duration"),
        (
            ["--query-max-threads", "two"],
            {},
            r"--query-max-threads \(STAGETRACE_QUERY_MAX_THREADS\): 'two' is not a whole",
        ),
        (
            [],
            {STAGETRACE_QUERY_MAX_MEMORY: "lots"},
            r"--query-max-memory \(STAGETRACE_QUERY_MAX_MEMORY\): 'lots' is not",
        ),
        (["--analyse-every", "soon"], {}, r"--analyse-every: 'soon' is not a positive duration"),
        (["--listen", "9464"], {}, r"listen address '9464' is not HOST:PORT"),
    ],
)
def test_refused_text_is_one_line_naming_its_flag(flags, environ, message):
    with pytest.raises(ValueError, match=message) as refused:
        config(*flags, environ=environ)
    assert "\n" not in str(refused.value)
