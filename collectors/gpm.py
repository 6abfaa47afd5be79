"""The GPM table under the gpu collector's name: the table itself is data the analysis and the dashboards read too,
so it lives in the core (:mod:`stagetrace.gpm_metrics`); this module keeps its names importable from here."""

from __future__ import annotations

from stagetrace.gpm_metrics import *  # noqa: F403
from stagetrace.gpm_metrics import __all__  # noqa: F401
