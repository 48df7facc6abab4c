"""``dracap agent --tc-backend``: which way the tc enforcer talks to the kernel."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from services.commands.agent import build_enforcer, register
from services.enforcement.discovery import load_config
from services.enforcement.tc import ProcessTc, TcEnforcer
from services.enforcement.tcnetlink import NetlinkTc

CONFIG = Path(__file__).resolve().parents[2] / "deploy" / "agent-config.example.yaml"


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    return parser.parse_args(["agent", "--node", "n1", "--enforcer", "tc", *argv])


@pytest.mark.parametrize(
    ("argv", "kernel"), [((), NetlinkTc), (("--tc-backend", "netlink"), NetlinkTc),
                         (("--tc-backend", "tc"), ProcessTc)]
)  # fmt: skip
def test_the_backend_is_the_flags(argv: tuple[str, ...], kernel: type) -> None:
    args = _args(*argv)
    enforcer = build_enforcer(args, load_config(CONFIG, "n1"))
    assert isinstance(enforcer, TcEnforcer)
    assert type(enforcer.kernel) is kernel
    assert enforcer.backend == (argv[1] if argv else "netlink")
    enforcer.close()


def test_an_unknown_backend_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        _args("--tc-backend", "ioctl")
    assert exit_.value.code == 2
    assert "invalid choice: 'ioctl'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="backend must be one of netlink, tc"):
        TcEnforcer({}, backend="ioctl")  # type: ignore[arg-type]
