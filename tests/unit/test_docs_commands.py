"""The docs name commands that exist: every ``dracap`` command of README.md and docs/*.md.

* A command of a fenced code block (what a reader copies) must parse with dracap's own
  command line, its flags included, unless it holds a placeholder (``[...]``, ``|``,
  ``…``, ``<...>``).
* A command quoted in the prose (```dracap claim get```) must name a command word and a
  verb that exist (flags in prose are often partial, so they are not checked); a
  ``get/list`` pair names each verb.
"""

from __future__ import annotations

import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

from services import cli

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PLACEHOLDERS = re.compile(r"[\[\]|…<>{}]|\.\.\.")
COMMAND = re.compile(r"^(?:[A-Z_]+=\S+ +)*(?:\.venv/bin/)?dracap (.*)$")
QUOTED = re.compile(r"`((?:\.venv/bin/)?dracap [^`]+)`")
#: sentences that quote dracap without naming a command
NOT_COMMANDS = {
    "dracap is ready",  # the banner's last line
    "dracap audit rebuild",  # "is not written": docs/audit-billing.md says what is left
    "dracap class set-placement",  # "no command yet": docs/placement.md
    "dracap db node-role",  # "is gone" (migration 0012): agent.md, database-roles.md, …
}


def _parses(argv: list[str]) -> str | None:
    """None when ``argv`` parses, else argparse's complaint."""
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            cli.build_parser(argv).parse_args(argv)
    except SystemExit as exc:
        if exc.code:
            return err.getvalue().strip().splitlines()[-1]
    return None


def _blocks(path: Path) -> list[tuple[int, str]]:
    """``(line, command)`` of every dracap command in the file's fenced code blocks."""
    found, inside, carried = [], False, ""
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.startswith("```"):
            inside, carried = not inside, ""
            continue
        if not inside:
            continue
        text = carried + line.strip()
        if text.endswith("\\"):
            carried = text[:-1] + " "
            continue
        carried = ""
        match = COMMAND.match(text.removeprefix("$ "))
        if match and not PLACEHOLDERS.search(match.group(1)):
            found.append((number, match.group(1).split(" #")[0]))
    return found


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_every_command_in_a_code_block_parses(path: Path) -> None:
    wrong = [
        f"{path.name}:{n}: dracap {cmd}: {problem}"
        for n, cmd in _blocks(path)
        if (problem := _parses(shlex.split(cmd))) is not None
    ]
    assert not wrong, "\n".join(wrong)


def _words(quoted: str) -> list[list[str]]:
    """The command word and verb(s) a quoted command names (``get/list``, ``get|list``:
    each); a placeholder or an option ends what is checked."""
    named: list[list[str]] = []
    for arg in quoted.split()[1:3]:
        if arg.startswith(("-", "[", "<")) or "…" in arg or arg.isupper():
            break
        named.append([word for word in re.split(r"[/|]", arg) if word])
    if not named:
        return []
    if len(named) == 1:
        return [[word] for word in named[0]]
    return [[command, verb] for command in named[0] for verb in named[1]]


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_every_command_quoted_in_the_prose_exists(path: Path) -> None:
    wrong = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        for quoted in QUOTED.findall(line):
            if any(quoted.startswith(sentence) for sentence in NOT_COMMANDS):
                continue
            for words in _words(quoted):
                problem = _parses(words)
                if problem is not None and "invalid choice" in problem:
                    wrong.append(f"{path.name}:{number}: {quoted}: {problem}")
    assert not wrong, "\n".join(wrong)
