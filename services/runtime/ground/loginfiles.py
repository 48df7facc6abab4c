"""Where each service finds its own database login: ``<data-dir>/database/<kind>.url``.

``dracap db logins`` (:mod:`services.runtime.store.logins`) creates or rotates one login user
per service kind on the operator's PostgreSQL and writes the URL each one connects with
into a file of its own, mode 0600: ``relay.url``, ``claims.url``, ``reservation.url``,
``enforcement.url``, ``reclamation.url``, ``ledger.url`` (the audit and billing
subscribers), ``snapshots.url`` and ``readonly.url`` (the live state's reads, ``dracap
replay verify``, forensics). A command that runs one kind of service reads its kind's
file when neither ``--database-url`` nor ``DRACAP_DATABASE_URL_<KIND>`` names a URL
(:func:`services.runtime.bus.endpoints.resolve_endpoints`), and connects as that user — so
docker-compose.yml gives its services the data directory and no database URL at all,
and a Kubernetes Secret holds the same URLs under the same names.

This module only names and reads the files (no database driver: node agents import the
endpoints and must stay off the database).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Final

from services.runtime.ground.errors import PermanentError

__all__ = ["LOGINS_DIR", "LoginFileError", "login_file", "read_login_url"]

LOGINS_DIR: Final = "database"  #: under a data directory


class LoginFileError(PermanentError):
    """A login file that exists but cannot be read or holds no URL."""


def login_file(data_dir: str | os.PathLike[str], kind: str) -> Path:
    """The file holding the URL of service kind ``kind``'s login."""
    return Path(data_dir) / LOGINS_DIR / f"{kind}.url"


def read_login_url(data_dir: str | os.PathLike[str], kind: str) -> str | None:
    """The URL in ``kind``'s login file, or None when there is no such file."""
    path = login_file(data_dir, kind)
    try:
        text = path.read_text().strip()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as exc:
        raise LoginFileError(f"{path}: cannot read it: {exc}") from None
    if not text.startswith(("postgresql://", "postgres://")):
        raise LoginFileError(
            f"{path}: not a PostgreSQL URL (postgresql://...); `dracap db logins` writes it"
        )
    return text
