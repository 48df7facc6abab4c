"""The services' decisions stay pure: no runtime plumbing, no I/O library, directly or not.

(The import contract in pyproject.toml says the same of the allocator and admission;
these modules are held to it here.)
"""

from __future__ import annotations

import grimp
import pytest

DECISIONS = (
    "services.reservation.rounds",
    "services.enforcement.decisions",
    "services.claims.adminwrites",
)
FORBIDDEN = ("services.runtime", "asyncpg", "nats", "subprocess", "multiprocessing", "socket")


@pytest.fixture(scope="module")
def graph() -> grimp.ImportGraph:
    return grimp.build_graph("services", "events", include_external_packages=True)


@pytest.mark.parametrize("decision", DECISIONS)
def test_a_decision_imports_no_io(graph: grimp.ImportGraph, decision: str) -> None:
    reached = [f for f in FORBIDDEN if graph.chain_exists(decision, f, as_packages=True)]
    assert reached == [], f"{decision} reaches {reached}"
