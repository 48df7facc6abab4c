"""CI runs what a developer runs: the checks of the README, then its test command verbatim."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CHECKS = [
    ".venv/bin/ruff check .",
    ".venv/bin/ruff format --check .",
    ".venv/bin/mypy",
    ".venv/bin/lint-imports",
]


def _commands(path: Path) -> list[str]:
    """The command lines of a shell script (no comments, no blank lines)."""
    lines = (line.strip() for line in path.read_text().splitlines())
    return [line for line in lines if line and not line.startswith("#")]


def _fenced(readme: str) -> list[str]:
    """The lines of the README's ``sh`` code blocks."""
    blocks = re.findall(r"```sh\n(.*?)```", readme, flags=re.DOTALL)
    return [line.strip() for block in blocks for line in block.splitlines() if line.strip()]


def test_ci_ends_with_the_readme_test_command_verbatim() -> None:
    readme = _fenced((ROOT / "README.md").read_text())
    [test_command] = [line for line in readme if "pytest" in line]
    commands = _commands(ROOT / ".ci" / "run")
    assert commands[-1] == test_command


def test_ci_fails_on_the_first_failing_step() -> None:
    commands = _commands(ROOT / ".ci" / "run")
    assert "set -euo pipefail" in commands[:2]


def test_ci_runs_every_check_before_the_tests() -> None:
    commands = _commands(ROOT / ".ci" / "run")
    for check in CHECKS:
        assert check in commands, f".ci/run does not run {check!r}"
        assert commands.index(check) < len(commands) - 1


def test_the_readme_names_the_checks_ci_runs() -> None:
    readme = _fenced((ROOT / "README.md").read_text())
    [checks] = [line for line in readme if "ruff check" in line]
    assert checks.split(" && ") == CHECKS


def test_mypy_is_strict_on_events_and_services() -> None:
    config = (ROOT / "pyproject.toml").read_text()
    mypy = config.split("[tool.mypy]", 1)[1].split("\n[", 1)[0]
    assert re.search(r"^strict\s*=\s*true", mypy, flags=re.MULTILINE), mypy
    for package in ("events", "services"):
        assert package in mypy, f"mypy does not check {package}/"
