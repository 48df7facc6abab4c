"""The wiring every service command shares (services/runtime/hosting/process.py)."""

from __future__ import annotations

import argparse
import asyncio
import gc
from pathlib import Path

import pytest

from services.exitcodes import ExitCode
from services.runtime.ground.gctuning import THRESHOLDS
from services.runtime.ground.settings import SettingsError
from services.runtime.hosting.process import NotConnectedError, hosting, run_service


def _args(tmp_path: Path) -> argparse.Namespace:
    return argparse.Namespace(data_dir=str(tmp_path), metrics_port=0, metrics_addr="127.0.0.1")


def test_a_process_without_nats_says_so_when_a_service_asks_for_it(tmp_path: Path) -> None:
    async def main() -> None:
        async with hosting(_args(tmp_path), "snapshots") as context:
            assert context.database_url is None and not context.stop.is_set()
            with pytest.raises(NotConnectedError, match="snapshots was started without NATS"):
                _ = context.nc
            with pytest.raises(NotConnectedError):
                _ = context.js

    asyncio.run(main())


def test_a_bad_setting_is_one_line_and_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    async def main() -> int:
        raise SettingsError("DRACAP_POOL_SIZE: must be a positive integer")

    assert run_service(main) == ExitCode.BAD_INPUT
    err = capsys.readouterr().err
    assert err == "error: DRACAP_POOL_SIZE: must be a positive integer\n"


def test_errors_the_command_names_are_bad_input_too(capsys: pytest.CaptureFixture[str]) -> None:
    class ConfigFileError(Exception):
        pass

    async def main() -> int:
        raise ConfigFileError("--config: no such file")

    assert run_service(main, bad_input=(ConfigFileError,)) == ExitCode.BAD_INPUT
    assert "error: --config: no such file" in capsys.readouterr().err


def test_the_service_exit_code_is_the_command_s() -> None:
    async def main() -> int:
        return ExitCode.OK

    assert run_service(main) == ExitCode.OK


def test_a_service_run_leaves_the_collector_as_it_found_it() -> None:
    seen: list[tuple[int, int, int]] = []

    async def main() -> int:
        seen.append(gc.get_threshold())
        return ExitCode.OK

    before, callbacks = gc.get_threshold(), list(gc.callbacks)
    gc.set_threshold(700, 10, 10)  # CPython's default, whatever ran in this process before
    try:
        assert run_service(main) == ExitCode.OK
        assert seen == [THRESHOLDS]  # tuned while the service ran
        assert gc.get_threshold() == (700, 10, 10)
        assert gc.callbacks == callbacks
        assert gc.get_freeze_count() == 0
    finally:
        gc.set_threshold(*before)
