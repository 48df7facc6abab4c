"""Test configuration shared by every test directory.

Tests under ``tests/integration/`` are marked ``integration`` automatically; the real
server fixtures live in :mod:`tests.fixtures.services` (see its docstring for how the
servers are found: environment, Docker, or embedded).
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest_plugins = ["tests.fixtures.services"]

_INTEGRATION = Path(__file__).parent / "integration"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "integration: needs real PostgreSQL / NATS / network namespaces"
    )


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if _INTEGRATION in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.integration)
