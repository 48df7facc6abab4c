"""One table of exit codes: each code one meaning, used by every command, documented."""

from __future__ import annotations

import re
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from services import cli
from services.commands import replay as replay_command
from services.exitcodes import ExitCode
from services.replay.verify import Report

ROOT = Path(__file__).resolve().parents[2]


def test_the_table() -> None:
    assert {code.name: code.value for code in ExitCode} == {
        "OK": 0,
        "ERROR": 1,
        "BAD_INPUT": 2,
        "NOT_FOUND": 3,
        "REJECTED": 4,
        "INVARIANT_VIOLATED": 5,
        "EVENTS_REFUSED": 6,
        "SNAPSHOT_MISMATCH": 7,
        "INTERRUPTED": 130,
    }


def test_no_other_module_defines_exit_codes() -> None:
    defining = re.compile(r"^\s*_?EXIT_[A-Z_]+\s*(:[^=]*)?=\s*\d", re.MULTILINE)
    found = [
        str(path.relative_to(ROOT))
        for path in (ROOT / "services").rglob("*.py")
        if defining.search(path.read_text(encoding="utf-8"))
    ]
    assert found == []


def test_the_readme_documents_every_code() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    for code in ExitCode:
        assert re.search(rf"^\| {code.value} \| `{code.name}` \|", readme, re.MULTILINE), code


@pytest.mark.parametrize(("ok", "expected"), [(True, 0), (False, 5)])
def test_a_violation_is_not_an_internal_error(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    ok: bool,
    expected: int,
) -> None:
    async def verify(*_: object, **__: object) -> Report:
        return Report() if ok else Report(violation="capacity", violation_position=7)

    monkeypatch.setattr(replay_command, "verify", verify)
    argv = ["replay", "verify", "--database-url", "postgresql://nobody@127.0.0.1:1/none"]
    assert cli.main(argv) == expected
    assert ("OK" if ok else "FAILED") in capsys.readouterr().out


def test_a_database_that_does_not_answer_is_an_error_not_a_violation(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["replay", "verify", "--database-url", "postgresql://nobody@127.0.0.1:1/none"]
    assert cli.main(argv) == ExitCode.ERROR
    assert capsys.readouterr().err.startswith("error: PostgreSQL at ")


@pytest.fixture
def silent_server() -> Iterator[socket.socket]:
    """A listening socket that never answers: a client that connects stays connecting."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(8)
        server.settimeout(60)
        yield server


@pytest.mark.parametrize(
    "argv",
    [
        ["reclaim", "--database-url", "postgresql://nobody@127.0.0.1:{port}/x"],
        ["claim", "watch", "-n", "ns", "--nats", "nats://127.0.0.1:{port}"],
    ],
)
def test_a_command_told_to_stop_as_it_connects_exits_130(
    tmp_path: Path, silent_server: socket.socket, argv: list[str]
) -> None:
    """SIGTERM before a service has its own handlers (here: while it connects) used to
    kill the process (-15); now it exits with ``INTERRUPTED``, without a traceback."""
    port = silent_server.getsockname()[1]
    words = [word.format(port=port) for word in argv]
    process = subprocess.Popen(
        [sys.executable, "-m", "services.cli", *words, "--data-dir", str(tmp_path)],
        cwd=ROOT,
        stderr=subprocess.PIPE,
        text=True,
    )
    connection, _ = silent_server.accept()  # the command is connecting now
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=60)
    connection.close()
    assert process.returncode == ExitCode.INTERRUPTED, err
    assert "Traceback" not in err, err
