"""The files a command reads or writes, checked before it starts its work.

A command that runs for a while (a simulation, a fold of the whole log) and then finds it
cannot write its figure has wasted the run, and one that lets Python's ``OSError`` through
prints a traceback. Every command that takes a path checks it first with these, and says
what is wrong in one line naming the flag (exit 2, :class:`~services.exitcodes.CommandError`):

* :func:`check_out`: the file can be created — its directory exists and is writable, it is
  not a directory itself — and, when ``suffix`` is given, it ends with it (``.png``);
* :func:`check_in`: the file exists, is a file and can be read;
* :func:`written`: the one line for an ``OSError`` raised while writing anyway (a disk
  that filled meanwhile).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from services.exitcodes import CommandError, ExitCode

__all__ = ["check_in", "check_out", "written"]


def check_out(flag: str, path: str, suffix: str | None = None) -> None:
    """:class:`CommandError` (exit 2) unless ``path`` can be written (module docstring)."""
    where = f"{flag} {path}".strip()
    if suffix is not None and not path.endswith(suffix):
        raise CommandError(f"{where}: must end in {suffix}", ExitCode.BAD_INPUT)
    target = Path(path)
    folder = target.parent
    if not folder.is_dir():
        raise CommandError(f"{where}: directory {folder} does not exist", ExitCode.BAD_INPUT)
    if target.is_dir():
        raise CommandError(f"{where}: is a directory", ExitCode.BAD_INPUT)
    if not os.access(folder, os.W_OK) or (target.exists() and not os.access(target, os.W_OK)):
        raise CommandError(f"{where}: not writable", ExitCode.BAD_INPUT)


def check_in(flag: str, path: str) -> None:
    """:class:`CommandError` (exit 2) unless ``path`` is a file that can be read."""
    where = f"{flag} {path}".strip()
    target = Path(path)
    if not target.exists():
        raise CommandError(f"{where}: no such file", ExitCode.BAD_INPUT)
    if not target.is_file():
        raise CommandError(f"{where}: not a file", ExitCode.BAD_INPUT)
    if not os.access(target, os.R_OK):
        raise CommandError(f"{where}: not readable", ExitCode.BAD_INPUT)


@contextlib.contextmanager
def written(flag: str, path: str) -> Iterator[None]:
    """An ``OSError`` inside is one line naming ``flag`` and ``path`` (exit 2)."""
    try:
        yield
    except OSError as exc:
        where = f"{flag} {path}".strip()
        raise CommandError(f"{where}: {exc.strerror or exc}", ExitCode.BAD_INPUT) from None
