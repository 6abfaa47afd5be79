"""Collector settings as data: each collector declares its settings, the registry makes their flags and values.

A collector registered here, outside the package, gets its flag in ``collect --help`` and ``agent --help``,
its environment fallback and its keyword in ``Options`` without any change to the command line's code.
The built-in collectors' flags, variables and defaults are pinned, since the README and operators use them.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
from stagetrace.collectors import Options, Setting, build_node
from stagetrace.collectors.base import GAUGE, REGISTRY, Collector, MetricSpec, register

from stagetrace.cli import build_parser, main

GREETING = MetricSpec("probe_greeting", GAUGE, "What the probe was told to say.", ("greeting",))


class ProbeCollector(Collector):
    """A collector with one declared setting, registered only while a test runs."""

    name = "probe"
    default_enabled = False
    settings = (
        Setting(
            "probe_greeting",
            str,
            "hello",
            env="STAGETRACE_PROBE_GREETING",
            flag="--probe-greeting",
            metavar="WORD",
            help="what the probe says",
        ),
    )

    def collect(self, out) -> None:
        out.add(GREETING, 1, greeting=self.options.probe_greeting)


@pytest.fixture
def probe(monkeypatch):
    monkeypatch.delenv("STAGETRACE_PROBE_GREETING", raising=False)
    register(ProbeCollector)
    yield ProbeCollector
    REGISTRY.pop(ProbeCollector.name)


def greeting(capsys, *argv: str) -> str:
    assert main(["collect", "--once", "--json", "--collectors", "probe", *argv]) == 0
    samples = json.loads(capsys.readouterr().out)
    (sample,) = [s for s in samples if s["name"] == "probe_greeting"]
    return sample["labels"]["greeting"]


@pytest.mark.parametrize("command", ["collect", "agent"])
def test_a_registered_collector_gets_its_flag_in_help(probe, capsys, command):
    with pytest.raises(SystemExit):
        build_parser().parse_args([command, "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--probe-greeting WORD what the probe says (default hello; env STAGETRACE_PROBE_GREETING)" in out


def test_a_registered_collectors_setting_is_flag_else_variable_else_default(probe, capsys, monkeypatch):
    assert greeting(capsys) == "hello"
    monkeypatch.setenv("STAGETRACE_PROBE_GREETING", "hey")
    assert greeting(capsys) == "hey"
    assert greeting(capsys, "--probe-greeting", "hi") == "hi"


def test_a_registered_collectors_setting_is_an_options_keyword(probe):
    node = build_node(["probe"], Options(host="n1", probe_greeting="bonjour"))
    (family,) = [f for f in node.collect() if f.name == "probe_greeting"]
    assert family.samples[0].labels == {"host": "n1", "greeting": "bonjour"}
    assert Options().probe_greeting == "hello"


def test_without_the_collector_its_setting_is_unknown(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["collect", "--help"])
    assert "--probe-greeting" not in capsys.readouterr().out
    with pytest.raises(TypeError, match="probe_greeting"):
        Options(probe_greeting="x")
    with pytest.raises(TypeError, match="unexpected keyword argument 'sysfs_root'"):
        Options(sysfs_root="/sys")


def test_a_second_setting_with_a_taken_name_or_flag_is_refused(probe):
    for taken in (
        Setting("probe_greeting", str, flag="--other"),
        Setting("other", str, flag="--probe-greeting"),
        Setting("sysfs", str),
    ):
        clash = type("Clash", (Collector,), {"name": "clash", "settings": (taken,)})
        with pytest.raises(ValueError, match="already declared"):
            register(clash)
    assert "clash" not in REGISTRY


# --- the built-in collectors' settings, as the README documents them ---------------------------------------

BUILT_IN = [  # attribute, flag, variables, default, a value's text, that value
    ("sysfs", "--sysfs", ["STAGETRACE_SYSFS"], Path("/sys"), "/x", Path("/x")),
    ("nvml_fixture", "--nvml-fixture", ["STAGETRACE_NVML_FIXTURE"], None, "/x", Path("/x")),
    ("mps_pipe_dir", "--mps-pipe-dir", ["CUDA_MPS_PIPE_DIRECTORY"], Path("/tmp/nvidia-mps"), "/x", Path("/x")),
    ("mps_fixture", "--mps-fixture", ["STAGETRACE_MPS_FIXTURE"], None, "/x", Path("/x")),
    ("netdevs", "--netdevs", ["STAGETRACE_NETDEVS"], (), "eth0,,eth1", ("eth0", "eth1")),
    ("ethtool_include", "--ethtool-include", ["STAGETRACE_ETHTOOL_INCLUDE"], "", "pause", "pause"),
    ("ethtool_fixture", "--ethtool-fixture", ["STAGETRACE_ETHTOOL_FIXTURE"], None, "/x.json", Path("/x.json")),
    ("nccl_dir", "--nccl-dir", ["STAGETRACE_NCCL_DIR", "NCCL_INSPECTOR_DUMP_DIR"], None, "/x", Path("/x")),
    ("rails", "--rdma-rails", ["STAGETRACE_RDMA_RAILS"], (), "r0=mlx5_0", (("r0", "mlx5_0", "1"),)),
    (
        "kubelet_socket",
        "--kubelet-socket",
        ["STAGETRACE_KUBELET_SOCKET"],
        Path("/var/lib/kubelet/pod-resources/kubelet.sock"),
        "/x.sock",
        Path("/x.sock"),
    ),
    (
        "gpu_resources",
        "--gpu-resources",
        ["STAGETRACE_GPU_RESOURCES"],
        ("nvidia.com/gpu*", "nvidia.com/mig-*"),
        "amd.com/gpu,,x",
        ("amd.com/gpu", "x"),
    ),
    ("gpu_sharing_factor", "--gpu-sharing-factor", ["STAGETRACE_GPU_SHARING_FACTOR"], 1, "2", 2),
    ("procfs", "--procfs", ["STAGETRACE_PROCFS"], Path("/proc"), "/x", Path("/x")),
    ("kubelet_log_dir", "--kubelet-log-dir", ["STAGETRACE_KUBELET_LOG_DIR"], Path("/var/log"), "/x", Path("/x")),
    ("host", "--host", ["STAGETRACE_HOST"], None, "n7", "n7"),
]


@pytest.mark.parametrize(
    ("name", "flag", "variables", "default", "text", "parsed"), BUILT_IN, ids=[b[0] for b in BUILT_IN]
)
def test_built_in_flags_variables_and_defaults(name, flag, variables, default, text, parsed):
    parser = build_parser()
    options = Options.from_args(parser.parse_args(["collect", "--once"]), environ={})
    assert getattr(options, name) == (socket.gethostname() if name == "host" else default)
    for variable in variables:
        assert getattr(Options.from_args(parser.parse_args(["collect"]), environ={variable: text}), name) == parsed
    first, *later = variables
    environ = {first: text, **dict.fromkeys(later, "/elsewhere")}  # the first variable wins over a later one
    assert getattr(Options.from_args(parser.parse_args(["agent"]), environ=environ), name) == parsed
    flagged = Options.from_args(parser.parse_args(["collect", flag, text]), environ=dict.fromkeys(variables, "/other"))
    assert getattr(flagged, name) == parsed  # the flag wins over the variables


def test_options_reads_the_environment_for_what_a_keyword_does_not_set(monkeypatch):
    monkeypatch.setenv("STAGETRACE_SYSFS", "/from-env")
    monkeypatch.setenv("STAGETRACE_HOST", "env-host")
    options = Options(nvml_fixture=Path("/n"))
    assert (options.sysfs, options.host, options.nvml_fixture) == (Path("/from-env"), "env-host", Path("/n"))
    options.sysfs = Path("/else")  # attributes stay writable, as on the dataclass this replaced
    assert options.sysfs == Path("/else") and options != Options(nvml_fixture=Path("/n"))


def test_options_of_any_set_of_settings_are_generic_configuration():
    """``stagetrace.settings.Options`` is not the collectors': any set of settings gets keywords, variables,
    defaults and flags the same way (the collectors' Options is the one whose settings the registry declares)."""
    import argparse

    from stagetrace import settings

    every = settings.Setting("every_s", settings.parse_duration, "1m", env="EXAMPLE_EVERY", flag="--every")
    limit = settings.Setting("limit", int, 10, env="EXAMPLE_LIMIT")

    class Loop(settings.Options):
        @classmethod
        def _settings(cls):
            return (every, limit)

    parser = argparse.ArgumentParser()
    settings.add_arguments(parser, Loop._settings())
    assert [a.option_strings for a in parser._actions[1:]] == [["--every"]]  # a setting without a flag gets none
    chosen = Loop.from_args(parser.parse_args(["--every", "5s"]), {"EXAMPLE_EVERY": "2m", "EXAMPLE_LIMIT": "3"})
    assert (chosen.every_s, chosen.limit) == (5.0, 3)
    assert Loop(limit=4) == Loop(limit=4) != Loop(limit=5)
    with pytest.raises(ValueError, match=r"^EXAMPLE_EVERY: 'soon' is not a positive duration"):
        Loop.from_args(parser.parse_args([]), {"EXAMPLE_EVERY": "soon"})
    with pytest.raises(TypeError, match="Loop.. got an unexpected keyword argument 'sysfs'"):
        Loop(sysfs="/sys")
