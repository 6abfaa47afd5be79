"""Grafana dashboards as code, provisioning files and alert rules.

Each dashboard module has ``build() -> dict``. What they build is committed under ``generated/`` as
``<uid>.json``, so Grafana (or an operator copying files) needs no Python; a test fails when a
committed file differs from its builder. Regenerate with ``python -m stagetrace.dashboards``.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path

# Builder modules, in the order the dashboards are listed in the README and provisioned.
MODULES = ("overview", "trace_lookup", "divergences", "compare", "gpu", "rdma", "fabric", "weights")
GENERATED = Path(__file__).parent / "generated"


def build_all() -> dict[str, dict]:
    """Every dashboard, by uid."""
    dashboards = [importlib.import_module(f"stagetrace.dashboards.{name}").build() for name in MODULES]
    return {dashboard["uid"]: dashboard for dashboard in dashboards}


def render(dashboard: dict) -> str:
    """The committed form of a dashboard: stable key order, two-space indent, final newline."""
    return json.dumps(dashboard, indent=2, ensure_ascii=False) + "\n"
