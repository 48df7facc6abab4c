"""Unix socket paths for the kubelet's gRPC: the ``sun_path`` limit and stale files.

A Unix socket address holds its path in ``sun_path``, 108 bytes on Linux with the
terminating NUL, so a path longer than 107 bytes cannot be bound or dialled — and the
failure gRPC reports then does not say why. :func:`checked_socket_path` refuses such a
path up front with an error that names it. A plugin that died leaves its socket files
behind; :func:`clear_stale_socket` removes one before the plugin binds again, and
refuses to remove anything that is not a socket.
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path
from typing import Final

from services.runtime.kubeletplugin.errors import PluginConfigError, SocketPathTooLong

__all__ = ["SUN_PATH_MAX_BYTES", "checked_socket_path", "clear_stale_socket", "unix_target"]

#: The longest socket path that fits ``sun_path`` (108 bytes, one for the NUL).
SUN_PATH_MAX_BYTES: Final = 107

_log = logging.getLogger(__name__)


def checked_socket_path(path: Path | str) -> Path:
    """``path`` made absolute; :class:`SocketPathTooLong` when it does not fit ``sun_path``."""
    absolute = Path(os.path.abspath(path))
    length = len(os.fsencode(absolute))
    if length > SUN_PATH_MAX_BYTES:
        raise SocketPathTooLong(str(absolute), length, SUN_PATH_MAX_BYTES)
    return absolute


def clear_stale_socket(path: Path) -> bool:
    """Remove a socket file left at ``path``; True when one was removed.

    Anything else at ``path`` (a file, a directory) is not the plugin's to delete:
    :class:`PluginConfigError`.
    """
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return False
    if not stat.S_ISSOCK(mode):
        raise PluginConfigError(f"{path} exists and is not a socket; refusing to replace it")
    path.unlink(missing_ok=True)
    _log.info("removed stale socket %s", path)
    return True


def unix_target(path: Path) -> str:
    """The gRPC address of the socket at the absolute ``path``."""
    return f"unix:{path}"
