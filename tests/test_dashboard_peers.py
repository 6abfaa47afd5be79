"""The dashboards in a store shared with other services: a request deviates only from its peers.

Each query runs after exactly the rewrites the ClickHouse data source applies (``tests.grafana_macros.expand``),
on a store of its own (chdb allows one embedded store per process, so not beside ``test_dashboards``' demo store).
"""

from __future__ import annotations

import json
from datetime import datetime, timezone

import pytest

from tests import fleet

from stagetrace.dashboards import build_all
from tests.grafana_macros import ALL, QueryContext, Variable, expand
from stagetrace.store import open_store

DASHBOARDS = build_all()


def _panels_of(dashboard: dict) -> dict[str, str]:
    """Title → SQL of each panel's first query."""
    return {p["title"]: p["targets"][0]["rawSql"] for p in dashboard["panels"] if p["type"] != "row"}


def run(store, sql: str) -> tuple[list[str], list[list]]:
    """Column names and rows."""
    result = json.loads(store.client.raw_query(sql, fmt="JSONCompact"))
    return [c["name"] for c in result["meta"]], result["data"]


def test_another_service_answering_the_same_prompts_differently_is_no_deviation(tmp_path):
    """Class: a store shared with a neighbour (a shadow deployment of another model, busier than the service, on the
    same prompts, so its answers would be every input's majority). The overview's deviating ratio and the trace
    lookup's ``deviates`` compare a request only with its peers (same service and model, as the analysis does): the
    service's one real deviation counts, the neighbour's other answers do not."""
    with open_store(f"chdb://{tmp_path / 'store'}") as store:
        store.client.database = store.database
        rag = fleet.Fleet(store)
        shadow = fleet.Fleet(store, rag.t0, service="shadow", model="other-8b")
        for prompt in (0, 1):
            for i in range(4):  # rag: four requests a prompt, one of prompt 0 deviating at decode
                rag.request(
                    f"rag-{prompt}-{i}",
                    rag.at(i),
                    "h1",
                    prompt=prompt,
                    differs={"decode": "fault"} if (prompt, i) == (0, 3) else None,
                )
            for i in range(5):  # the shadow: five a prompt, all alike and unlike rag's
                shadow.request(
                    f"shadow-{prompt}-{i}", shadow.at(i, 30), "s1", prompt=prompt, differs={"decode": "other model"}
                )
        rag.flush()
        shadow.flush()
        window = QueryContext(
            datetime.fromtimestamp(rag.at(-1) / 1e9, timezone.utc),
            datetime.fromtimestamp(rag.at(10) / 1e9, timezone.utc),
            interval_ms=1000,
        )
        overview = _panels_of(DASHBOARDS["stagetrace-overview"])
        lookup = _panels_of(DASHBOARDS["stagetrace-trace-lookup"])
        variables = {name: Variable((ALL,)) for name in ("service", "host")}
        _, ((ratio,),) = run(store, expand(overview["Deviating outputs"], window, variables))
        assert ratio == pytest.approx(1 / 18)

        def request(request_id: str) -> dict:
            names, (row,) = run(store, expand(lookup["Request"], window, {"request_id": Variable(request_id)}))
            return dict(zip(names, row))

        deviating = request("rag-0-3")
        assert (deviating["deviates"], int(deviating["requests_with_same_input"])) == ("yes", 4)
        assert [request(f"rag-{p}-0")["deviates"] for p in (0, 1)] == ["no", "no"]
        assert request("shadow-0-0")["deviates"] == "no"
