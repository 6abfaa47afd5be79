"""Divergence analysis at scale: ``divergences`` over a store of a million requests, and ``explain`` of one.

The store is synthetic (``benchmarks.synthetic``: five stages per request, 5% deviating at a random
stage). Aims from the benchmarks issue: ``divergences`` under 10 s, ``explain`` under 1 s. There is
no outside baseline to run beside these; the figures are absolute, with the generation time shown
for scale.
"""

from __future__ import annotations

import tempfile
import time

from benchmarks import Figure, benchmark, median_seconds, synthetic
from stagetrace.analysis import divergences
from stagetrace.analysis.explain import Explainer
from stagetrace.store import open_store


def _merged(store, limit_s: float = 600.0) -> float:
    """Seconds until no merge runs in the store's database: a store at rest, as analysis meets it, not one busy
    merging the parts of a million requests written a moment ago (which takes one of the two cores)."""
    started = time.perf_counter()
    quiet = 0
    while quiet < 2 and time.perf_counter() - started < limit_s:
        running = int(
            store.client.command(
                "SELECT count() FROM system.merges WHERE database = {db:String}", parameters={"db": store.database}
            )
        )
        quiet = quiet + 1 if running == 0 else 0
        time.sleep(0.5)
    return time.perf_counter() - started


@benchmark("divergence")
def divergence(quick: bool) -> list[Figure]:
    requests = 20_000 if quick else 1_000_000
    with (
        tempfile.TemporaryDirectory(prefix="stagetrace-bench-") as directory,
        open_store(f"chdb://{directory}") as store,
    ):
        now = time.time_ns()
        started = time.perf_counter()
        synthetic.fill(store, requests, now - 3600 * 10**9)
        generated = time.perf_counter() - started
        settled = _merged(store)
        found = {}

        def run() -> None:
            found["result"] = divergences.find(store, 2 * 3600 * 10**9, until_ns=now + 10**9)

        scan = median_seconds(run, runs=1, warmup=0)
        deviating = found["result"]["deviating"]
        some = found["result"]["groups"][0]["deviating"][0]["request_id"]
        explainer = Explainer(store)
        explain = median_seconds(lambda: explainer.explain(some), runs=3 if not quick else 1)
        report = explainer.explain(some).to_json()
        assert report["diverged"] and report["causes"][0]["name"].startswith("setting."), report["summary"]
    return [
        Figure(f"generate {requests:,} requests ({requests * 6:,} spans) in-engine", generated, "s"),
        Figure("then wait for the engine's background merges to finish", settled, "s"),
        Figure(
            f"`divergences` over {requests:,} requests ({deviating:,} deviating, latest 100 analysed)",
            scan,
            "s",
            "aim",
            10.0,
        ),
        Figure("`explain` of one deviating request in that store", explain, "s", "aim", 1.0),
    ]


@benchmark("conventions")
def conventions(quick: bool) -> list[Figure]:
    """The cost of reading other producers' conventions: the same requests written as OpenInference spans (content
    hashed and stages mapped by the store's views) and as stagetrace spans (digests and stage names given), in one
    store, one window each; ingest and ``divergences`` side by side."""
    requests = 20_000 if quick else 1_000_000
    hour = 3600 * 10**9
    with (
        tempfile.TemporaryDirectory(prefix="stagetrace-bench-") as directory,
        open_store(f"chdb://{directory}") as store,
    ):
        now = time.time_ns()
        windows = {"stagetrace": now - 6 * hour, "openinference": now - 3 * hour}
        generated, scans, found = {}, {}, {}
        for offset, (style, t0) in enumerate(windows.items()):
            started = time.perf_counter()
            synthetic.fill(store, requests, t0, offset=offset * requests, style=style)
            generated[style] = time.perf_counter() - started
        for style, t0 in windows.items():

            def run(style=style, t0=t0) -> None:
                found[style] = divergences.find(store, hour, until_ns=t0 + hour + 10**9)

            scans[style] = median_seconds(run, runs=1 if quick else 3, warmup=1)
        same = {
            style: (r["deviating"], {d["first_divergent_stage"] for g in r["groups"] for d in g["deviating"]})
            for style, r in found.items()
        }
        assert same["stagetrace"][0] == same["openinference"][0] > 0, same
    return [
        Figure(
            f"ingest {requests:,} requests as OpenInference spans (views included)",
            generated["openinference"],
            "s",
            "as stagetrace-convention spans",
            generated["stagetrace"],
        ),
        Figure(
            f"`divergences` over {requests:,} OpenInference requests ({found['openinference']['deviating']:,} "
            "deviating)",
            scans["openinference"],
            "s",
            "stagetrace-convention requests",
            scans["stagetrace"],
        ),
    ]
