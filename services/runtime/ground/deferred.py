"""Imports a command does not need, deferred until something uses them.

nats-py imports aiohttp at its own import, for a WebSocket transport (``ws://`` URLs)
that dracap never uses; aiohttp costs about 0.1 s, more than everything else
``dracap claim list`` imports. :func:`defer_unused_imports` puts a stand-in module in
its place: any use of one of its attributes (``aiohttp.ClientSession``, a submodule such
as ``aiohttp.web``, the Kubernetes client's imports) imports the real module there and
then, and the stand-in forwards to it from then on. Whoever never uses aiohttp never
pays for it.

Only :func:`services.cli.main` calls it, before a command's imports, and only for a
module that is not imported yet. A stand-in is a module whose ``__getattr__`` loads the
real one: the import machinery's own reads (``__spec__``, ``__name__``) are answered by
the stand-in without loading anything, which is why it is not
:class:`importlib.util.LazyLoader` (whose module loads on the first read of any
attribute, ``__spec__`` included, that is at the next ``import aiohttp``).
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import threading
import types
from typing import Any, Final

__all__ = ["DEFERRED", "defer_unused_imports"]

#: The modules deferred: imported by a dependency on every start, used by few commands.
DEFERRED: Final = ("aiohttp",)


class _StandIn(types.ModuleType):
    """A module that imports the real one on the first use of an attribute it lacks."""

    _lock = threading.Lock()

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._real(), attr)

    def _real(self) -> types.ModuleType:
        with _StandIn._lock:
            name = self.__name__
            if sys.modules.get(name) is self:
                del sys.modules[name]  # the real module's own imports must find itself
                try:
                    importlib.import_module(name)
                except BaseException:
                    sys.modules.setdefault(name, self)
                    raise
            return sys.modules[name]


def defer_unused_imports(names: tuple[str, ...] = DEFERRED) -> None:
    """Put a stand-in in place of each module of ``names`` not imported yet (and
    installed: a module that is missing stays missing)."""
    for name in names:
        if name in sys.modules:
            continue
        spec = importlib.util.find_spec(name)
        if spec is None:
            continue
        stand_in = _StandIn(name)
        stand_in.__spec__ = spec
        stand_in.__file__ = spec.origin
        sys.modules[name] = stand_in
