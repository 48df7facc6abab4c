"""What every command that draws needs first: matplotlib, or one clear line saying so.

matplotlib is an optional dependency (``pip install 'dracap[plot]'``); the commands that
write PNGs (``dracap report``, ``dracap replay plot``, ``dracap simulate --plot``) check
for it before they read anything, so a missing library costs one line and exit 2.
"""

from __future__ import annotations

from services.exitcodes import CommandError, ExitCode

__all__ = ["require_matplotlib"]


def require_matplotlib(what: str) -> None:
    """Raise :class:`CommandError` (exit 2) naming ``what`` when matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise CommandError(
            f"{what} needs matplotlib: pip install 'dracap[plot]'", ExitCode.BAD_INPUT
        ) from None
