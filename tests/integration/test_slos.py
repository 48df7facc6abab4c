"""The SLO metrics and ``dracap report`` agree on one log: one definition, two readers
(both fold the transitions of :mod:`events.transitions` through one ``SloFold``).

The in-process stack (the services of ``dracap up``) fills both GPUs of a class, a third
claim waits for capacity until one of them is deleted, and every claim becomes Ready.
What the process's Prometheus histograms observed meanwhile (scheduling latency, the
wait for capacity, convergence: count and sum per class) must equal what ``dracap
report`` computes from the database's log afterwards, span for span.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from services.replay.sources import DatabaseSource
from services.report.panels import build_report
from services.runtime.ground.metrics import REGISTRY
from services.runtime.ground.settings import Settings
from services.runtime.store.eventstore import connect
from tests.integration.cluster import running_cluster
from tests.integration.test_class_modes import GPU_CLASS, INVENTORY
from tests.integration.test_policy import NAMESPACE, _ready, claim_doc, view_when

pytestmark = pytest.mark.integration

#: the report's kind of span -> the histogram the services export it as
HISTOGRAMS = {
    "scheduling": "dracap_scheduling_latency_seconds",
    "capacity_wait": "dracap_capacity_wait_seconds",
    "convergence": "dracap_claim_convergence_seconds",
}


def _decisions() -> dict[str, float]:
    """``dracap_claim_decisions_total`` for the test's class, by outcome, in this process now."""
    return {
        outcome: REGISTRY.get_sample_value(
            "dracap_claim_decisions_total", {"class": GPU_CLASS, "outcome": outcome}
        )
        or 0.0
        for outcome in ("admitted", "rejected", "unschedulable")
    }


def _observed() -> dict[str, tuple[float, float]]:
    """Each histogram's count and sum for the test's class, in this process now."""
    labels = {"class": GPU_CLASS}
    return {
        kind: (
            REGISTRY.get_sample_value(f"{name}_count", labels) or 0.0,
            REGISTRY.get_sample_value(f"{name}_sum", labels) or 0.0,
        )
        for kind, name in HISTOGRAMS.items()
    }


async def test_report_and_metrics_say_the_same_of_one_log(
    settings: Settings, nats_url: str, tmp_path: Path
) -> None:
    before, decided_before = _observed(), _decisions()
    async with running_cluster(settings, nats_url, tmp_path, INVENTORY) as cluster:
        api = cluster.api
        for name in ("big-0", "big-1"):  # both 40Gi devices, whole
            await api.claims(NAMESPACE, "apply", claim_doc(name, "40Gi"))
            await view_when(api, name, _ready)
        await api.claims(NAMESPACE, "apply", claim_doc("late", "10Gi"))
        await view_when(api, "late", lambda v: v["phase"] == "unschedulable")
        await api.claims(NAMESPACE, "delete", {"name": "big-0"})
        await view_when(api, "late", _ready)
        await view_when(api, "big-0", lambda v: v["phase"] == "released")
        after, decided_after = _observed(), _decisions()

    connection = await connect(settings)
    try:
        async with DatabaseSource(connection, snapshots=False) as source:
            report = await build_report(source)
    finally:
        await connection.close()

    for kind in HISTOGRAMS:
        count = after[kind][0] - before[kind][0]
        seconds = after[kind][1] - before[kind][1]
        reported = report.spans.get(kind, {}).get(GPU_CLASS, (0, 0.0))
        assert (count, pytest.approx(seconds, abs=1e-6)) == reported, kind
    for outcome, total in decided_after.items():
        reported_decisions = report.decisions.get(outcome, {}).get(GPU_CLASS, 0)
        assert total - decided_before[outcome] == reported_decisions, outcome
    assert report.decisions["admitted"][GPU_CLASS] == 3, "each claim admitted once"
    assert report.decisions["unschedulable"][GPU_CLASS] == 1, "the late claim waited"
    assert report.spans["scheduling"][GPU_CLASS][0] == 3, "one decision per claim"
    assert report.spans["capacity_wait"][GPU_CLASS][0] == 1, "the late claim waited once"
    assert report.spans["convergence"][GPU_CLASS][0] == 3
