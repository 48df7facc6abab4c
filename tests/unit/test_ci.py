"""CI checks what a developer checks.

``.ci/run`` is the CI entry point. It must run the static checks (ruff, ruff format,
mypy in its strict configuration, the import contracts) and then exactly the test
command the README gives, under ``set -euo pipefail`` so that any failing step fails
the run. This test reads both files, so that neither can drift from the other.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CHECKS = (
    ".venv/bin/ruff check .",
    ".venv/bin/ruff format --check .",
    ".venv/bin/mypy",
    ".venv/bin/lint-imports",
)


def _commands(script: str) -> list[str]:
    """The script's command lines, without comments, blank lines or continuations."""
    return [
        line.strip()
        for line in script.splitlines()
        if line.strip() and not line.strip().startswith("#")
    ]


def _readme_test_command() -> str:
    """The command in the code block after the README's "Run the tests:"."""
    readme = (ROOT / "README.md").read_text()
    found = re.search(r"Run the tests:\s*```sh\n(.+?)\n```", readme, re.S)
    assert found, "README.md has no 'Run the tests:' code block"
    return found.group(1).strip()


def test_ci_run_fails_on_any_failing_step() -> None:
    """The script stops at the first failing command."""
    assert "set -euo pipefail" in _commands((ROOT / ".ci" / "run").read_text())


def test_ci_run_names_each_check_before_the_tests() -> None:
    """Each static check is a command line of its own, all before the test command."""
    lines = _commands((ROOT / ".ci" / "run").read_text())
    test_command = _readme_test_command()
    assert test_command in lines, "the README's test command is not in .ci/run verbatim"
    last = len(lines) - 1 - lines[::-1].index(test_command)
    for check in CHECKS:
        assert check in lines, f".ci/run does not run {check!r}"
        assert lines.index(check) < last, f"{check!r} runs after the tests"


def test_ci_run_ends_with_the_readme_test_command() -> None:
    """The last thing CI does is exactly what the README tells a developer to run."""
    lines = _commands((ROOT / ".ci" / "run").read_text())
    assert lines[-1] == _readme_test_command()


def test_readme_names_the_same_checks() -> None:
    """The README's check line names the same checks, in the same order."""
    readme = (ROOT / "README.md").read_text()
    assert " && ".join(CHECKS) in readme


def test_mypy_is_strict() -> None:
    """The mypy that CI runs is the strict configuration of pyproject.toml."""
    pyproject = (ROOT / "pyproject.toml").read_text()
    mypy_section = pyproject.split("[tool.mypy]", 1)[1].split("\n[", 1)[0]
    assert re.search(r"^strict\s*=\s*true", mypy_section, re.M)
