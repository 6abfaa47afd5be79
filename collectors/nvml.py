"""The NVML source seam as the gpu and mps collectors choose it: the recorded snapshots of ``--nvml-fixture``
(``STAGETRACE_NVML_FIXTURE``), else the real library. The binding itself (:class:`PynvmlSource`,
:class:`FixtureSource`, the error classes, the fixture writers) is :mod:`stagetrace.nvml`, in the core, which the
process's configuration reads too; its names stay importable from here.
"""

from __future__ import annotations

from stagetrace.collectors.base import Options, Setting, path_or_none
from stagetrace.environment_variables import STAGETRACE_NVML_FIXTURE
from stagetrace.nvml import *  # noqa: F403
from stagetrace.nvml import NvmlSource, __all__ as _BINDING, open_source

# Read by the gpu and mps collectors, which both declare it.
NVML_FIXTURE = Setting(
    "nvml_fixture",
    path_or_none,
    env=STAGETRACE_NVML_FIXTURE,
    flag="--nvml-fixture",
    metavar="DIR",
    help="recorded NVML snapshots instead of the real library",
)


def nvml_source(options: Options, watch_xids: bool = True) -> NvmlSource:
    """The recorded snapshot when ``Options.nvml_fixture`` is set, else the real library."""
    return open_source(options.nvml_fixture, watch_xids=watch_xids)


__all__ = ["NVML_FIXTURE", "nvml_source", *_BINDING]
