"""The GPU inventory joined to spans whose process recorded no configuration (docs/design.md#configuration-is-evidence).

A fleet whose serving processes ran without stagetrace's resource detector records no GPU model or driver on its
spans, only ``host.name`` and, on decode, ``gpu.uuid``. The agent on each host exports its GPUs as ``gpu_info``
series, written here through the agent's own metric writer (``ClickHouseMetricWriter``) from the gpu collector's
own metric spec. ``explain`` and ``divergences`` must join the two by host and GPU UUID: a host whose inventory
says another driver (or GPU model) than its peers', and whose decode outputs deviate, is explained by it, in both
views alike; an inventory that agrees with the peers' names nothing; and what a process recorded itself always wins
over the inventory.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from stagetrace import conventions
from stagetrace.analysis import divergences, inventory, population
from stagetrace.analysis.explain import Explainer
from stagetrace.collectors.base import Samples
from stagetrace.collectors.gpu import INFO_SPEC
from stagetrace.exporters.clickhouse import ClickHouseMetricWriter

if "stagetrace_tests_fleet" not in sys.modules:  # tests/fleet.py, shared with test_attribution.py
    _spec = importlib.util.spec_from_file_location("stagetrace_tests_fleet", Path(__file__).with_name("fleet.py"))
    sys.modules[_spec.name] = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(sys.modules[_spec.name])
fleet = sys.modules["stagetrace_tests_fleet"]

MINUTE, SECOND = fleet.MINUTE, fleet.SECOND
HOSTS = "abcd"
H200, H100 = "NVIDIA H200", "NVIDIA H100 80GB HBM3"
DRIVER, OLD_DRIVER = "570.133.20", "550.54.15"
GPU_INFO = {
    "model": H200,
    "driver_version": DRIVER,
    "cuda_version": "12.8",
    "ecc_mode": "enabled",
    "mig_mode": "disabled",
}


def gpu(host: str, index: int) -> str:
    return f"GPU-{host}-{index}"  # tests/fleet.py's decode spans run on GPU-<host>-0


def write_inventory(store, host: str, times: list[int], gpus: dict[str, dict]) -> None:
    """The host's agent sampling ``gpu_info`` at each time: ``gpus`` maps a GPU UUID to its labels besides gpu and
    uuid (model, driver_version, cuda_version, ecc_mode, mig_mode), as the gpu collector adds them."""
    writer = ClickHouseMetricWriter(
        store, host=host, create_schema=False, spool_dir=False, insert_every_s=3600, insert_rows=10**6
    )
    for t in times:
        samples = Samples()
        for index, (uuid, labels) in enumerate(gpus.items()):
            info = {k: v for k, v in labels.items() if k != "model"}
            samples.add(INFO_SPEC, info, gpu=index, uuid=uuid, model=labels["model"])
        writer.write([samples], time_ns=t)
    assert writer.close()


def serve(store, resources: dict[str, dict], inventories: dict[str, dict], deviating: str = "c"):
    """Hosts a..d (resource attributes ``resources``, none from the detector unless given) serve two prompts twice a
    minute each for six minutes; ``deviating``'s decode outputs differ. Each host's agent samples gpu_info every
    minute around it, its two GPUs with ``GPU_INFO`` overridden by ``inventories[host]``. (the fleet, a deviating
    request ID, its explain report, its divergences entry)"""
    fl = fleet.Fleet(store, resources=resources)
    n = 0
    for minute in range(6):
        for host in HOSTS:
            for prompt in range(2):
                fl.request(
                    f"r{n}",
                    fl.at(minute, seconds=n % 50),
                    host,
                    prompt=prompt,
                    differs={"decode": "x"} if host == deviating else None,
                )
                n += 1
    fl.flush()
    scrapes = [fl.at(minute) for minute in range(-1, 8)]
    for host in HOSTS:
        labels = {**GPU_INFO, **inventories.get(host, {})}
        write_inventory(store, host, scrapes, {gpu(host, 0): labels, gpu(host, 1): labels})
    bad = [r for r, v in fl.requests.items() if v["host"] == deviating][3]
    report = Explainer(store).explain(bad).to_json()
    found = divergences.find(store, 6 * 3600 * SECOND, limit=0)
    entry = next(item for group in found["groups"] for item in group["deviating"] if item["request_id"] == bad)
    return fl, bad, report, entry


@pytest.mark.parametrize(
    "name, label, value, usual",
    [
        ("gpu.driver.version", "driver_version", OLD_DRIVER, DRIVER),
        ("gpu.model", "model", H100, H200),
    ],
)
def test_a_host_whose_inventory_differs_is_explained_by_it_without_the_detector(store, name, label, value, usual):
    _, _, report, entry = serve(store, {}, {"c": {label: value}})
    top = report["causes"][0]
    assert (report["first_divergent_stage"], top["name"], top["value"], top["baseline_value"]) == (
        "decode",
        name,
        value,
        usual,
    ), report["causes"]
    assert not top["weak"] and top["where"]["host.name"] == "c", top
    assert top["from"] == top["baseline_from"] == "gpu_info", top  # neither process recorded it
    assert f"c runs {name} {value} where its peers run {usual}" in report["summary"]
    # one analysis, two views
    assert (
        entry["first_divergent_stage"],
        entry["top_cause"]["name"],
        entry["top_cause"]["value"],
        entry["top_cause"]["baseline_value"],
    ) == ("decode", name, value, usual), entry


def test_an_inventory_that_agrees_with_the_peers_names_nothing(store):
    _, _, report, entry = serve(store, {}, {})
    names = [c["name"] for c in report["causes"]]
    assert not set(names) & set(conventions.INVENTORY_LABELS), report["causes"]
    assert names[0] in ("gpu.uuid", "host.name") and not report["causes"][0]["weak"], report["causes"]
    assert entry["top_cause"]["name"] == names[0]


def test_what_the_process_recorded_wins_over_the_inventory(store):
    """Hosts a and b ran the detector and recorded an H200; the inventory says a has an H100, and that c (which
    recorded nothing) has one. The H100 of c explains c's deviation; a's recorded H200 stands, in the spans compared
    and in those the contrast counts."""
    recorded = {"gpu.model": H200, "gpu.driver.version": DRIVER, "cuda.driver.version": "12.8"}
    fl, bad, report, entry = serve(store, {"a": recorded, "b": recorded}, {"a": {"model": H100}, "c": {"model": H100}})
    top = report["causes"][0]
    assert (top["name"], top["value"], top["baseline_value"]) == ("gpu.model", H100, H200), report["causes"]
    assert entry["top_cause"]["name"] == "gpu.model" and entry["top_cause"]["value"] == H100

    gpus = inventory.read(store, fl.requests[bad]["start_ns"])
    assert inventory.fill({"host.name": "a", **recorded}, {"gpu.uuid": gpu("a", 0)}, gpus) == {
        "host.name": "a",
        **recorded,
    }
    contrast = population.contrast(store, "decode", ["resource:gpu.model"], fl.at(0), fl.at(7), inventory=gpus)
    per_host = 2 * 6  # two prompts a minute for six minutes
    assert contrast.counts == {
        ("resource:gpu.model", H200): (3 * per_host, 0),
        ("resource:gpu.model", H100): (per_host, per_host),
    }


def test_a_span_without_its_gpu_gets_the_hosts_value_only_where_its_gpus_agree(store):
    """Each GPU's last sample at or before the moment counts, else its first after; a span naming no GPU (or one the
    inventory does not know) gets a value of its host only when all the host's GPUs agree on it."""
    t = fleet.Fleet(store).t0
    # n1: mixed GPU models on one driver, upgraded a minute after t; n2's agent started after t
    write_inventory(store, "n1", [t - 2 * MINUTE, t], {"GPU-n1-0": GPU_INFO, "GPU-n1-1": {**GPU_INFO, "model": H100}})
    write_inventory(
        store,
        "n1",
        [t + MINUTE],
        {
            "GPU-n1-0": {**GPU_INFO, "driver_version": "580.65.06"},
            "GPU-n1-1": {**GPU_INFO, "model": H100, "driver_version": "580.65.06"},
        },
    )
    write_inventory(store, "n2", [t + 30 * SECOND], {"GPU-n2-0": {**GPU_INFO, "driver_version": OLD_DRIVER}})
    write_inventory(store, "n2", [t + 90 * SECOND], {"GPU-n2-0": GPU_INFO})
    gpus = inventory.read(store, t)

    def filled(host: str, uuid: str | None) -> dict:
        got = inventory.fill({"host.name": host}, {"gpu.uuid": uuid} if uuid else {}, gpus)
        return {k: v for k, v in got.items() if k != "host.name"}

    versions = {"gpu.driver.version": DRIVER, "cuda.driver.version": "12.8"}
    assert filled("n1", "GPU-n1-1") == {
        "gpu.model": H100,
        **versions,
        inventory.FILLED: "gpu.model,gpu.driver.version,cuda.driver.version",
    }
    for uuid in (None, "GPU-n1-9"):  # no GPU named, or one the inventory does not know: the host's, where they agree
        assert filled("n1", uuid) == {**versions, inventory.FILLED: "gpu.driver.version,cuda.driver.version"}
    assert filled("n2", "GPU-n2-0")["gpu.driver.version"] == OLD_DRIVER  # none before t: the first after it
    assert filled("n3", "GPU-n3-0") == {}  # no inventory for the host: nothing is guessed
    assert inventory.read(store, t + 2 * MINUTE).value("gpu.driver.version", "n1", "") == "580.65.06"
