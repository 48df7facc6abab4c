"""What every command that draws needs first: matplotlib, or one clear line saying so.

matplotlib is an optional dependency (``pip install 'dracap[plot]'``); the commands that
write PNGs (``dracap report``, ``dracap replay plot``, ``dracap simulate --plot``) check
for it before they read anything, so a missing library costs one line and exit 2.

Every text a figure shows that the log or a tenant chose (tenants, classes, devices,
titles naming an object) goes through :func:`label`: control characters escaped as for a
terminal (:mod:`services.runtime.ground.printable`), and ``$`` escaped so matplotlib draws it
instead of reading mathematics between two of them.
"""

from __future__ import annotations

from services.exitcodes import CommandError, ExitCode
from services.runtime.ground.printable import printable

__all__ = ["label", "require_matplotlib"]


def label(text: object) -> str:
    """``text`` as a figure may show it (see the module docstring)."""
    return printable(text).replace("$", "\\$")


def require_matplotlib(what: str) -> None:
    """Raise :class:`CommandError` (exit 2) naming ``what`` when matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise CommandError(
            f"{what} needs matplotlib: pip install 'dracap[plot]'", ExitCode.BAD_INPUT
        ) from None
