"""Test configuration shared by every test directory.

Tests under ``tests/integration/`` are marked ``integration`` automatically; the real
server fixtures live in :mod:`tests.fixtures.services` (see its docstring for how the
servers are found: environment, Docker, or embedded).

Each session's ``tmp_path`` root is a directory of its own under the system's temporary
directory (unless ``--basetemp`` names one), not pytest's shared
``/tmp/pytest-of-<user>``: every starting session resets that shared directory to mode
0700, and an embedded PostgreSQL started by ``dracap up`` in a test runs as another
system user that must traverse it — so a second test session started meanwhile (CI and
a developer, two worktrees) made the first one's server unreachable ("Permission
denied" on its data directory). The directory is removed when the session ends.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest

pytest_plugins = ["tests.fixtures.services"]

_INTEGRATION = Path(__file__).parent / "integration"


_OWN_BASETEMP = "_dracap_own_basetemp"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "integration: needs real PostgreSQL / NATS / network namespaces"
    )
    if config.option.basetemp is None:
        own = tempfile.mkdtemp(prefix="dracap-pytest-")
        config.option.basetemp = own
        setattr(config, _OWN_BASETEMP, own)


def pytest_unconfigure(config: pytest.Config) -> None:
    own = getattr(config, _OWN_BASETEMP, None)
    if own is not None:
        shutil.rmtree(own, ignore_errors=True)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if _INTEGRATION in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.integration)


@pytest.fixture(autouse=True)
def _loggers_enabled() -> None:
    """Every logger enabled when a test starts: an in-process run that configures logging
    from a file (import-linter in ``test_architecture``) disables every logger that
    existed then, and a test reading a module's log lines (``caplog``) must not depend
    on which tests ran before it."""
    import logging

    for logger in logging.Logger.manager.loggerDict.values():
        if isinstance(logger, logging.Logger):
            logger.disabled = False
