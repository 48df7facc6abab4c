"""Enforcers: what makes a share's limit real on a node.

The node agent (:mod:`services.enforcement.agent`) does not know how a limit is
enforced; it asks an :class:`Enforcer`:

* ``apply(limit)`` puts one share's limit in place (or verifies it is already there:
  it must be idempotent, the agent may call it again after a crash) and reports the
  :class:`AppliedLimit` — the *enforcement level* (``hard``: the kernel or driver
  refuses more; ``soft``: best effort, e.g. a scheduling weight; ``none``: nothing is
  enforced) and the amounts actually in force;
* ``remove(share_id)`` takes it away (idempotent: removing an unknown share is fine);
* ``observe()`` lists what is in force now, so an agent that restarts can reconcile.

A failure raises an :class:`EnforcementError`, and its type says what to do::

    EnforcementError               root: catch it to handle any failure of an enforcer
    ├── RetryableEnforcementError  the same call may succeed later (daemon still
    │                              starting, tc busy): the agent lets the message be
    │                              redelivered, then reports ``LimitFailed(retryable=True)``
    └── PermanentEnforcementError  the same call will fail again (unknown device, a
                                   limit the mechanism cannot express): the agent
                                   reports ``LimitFailed(retryable=False)``, which
                                   fails the claim

The type is the whole classification: nothing reads a flag or the message text.

dracap never claims QoS it cannot prove: :class:`NoneEnforcer`, the default where no
mechanism exists (and in tests), reports level ``none`` with no amounts in force. The
traffic-control (bandwidth) and CUDA MPS (GPU memory) enforcers implement the same
protocol.
"""

from __future__ import annotations

from typing import Protocol

import msgspec

from events.catalog import EnforcementLevel
from events.quantities import Quantity
from events.state import DeviceKey

__all__ = [
    "AppliedLimit",
    "EnforcementError",
    "Enforcer",
    "NoneEnforcer",
    "PermanentEnforcementError",
    "RetryableEnforcementError",
    "ShareLimit",
]


class ShareLimit(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """The limit one share needs: where it lives and how much it may consume."""

    share_id: str
    driver: str
    pool: str
    device: str
    consumed: dict[str, Quantity]
    admin_access: bool = False


class AppliedLimit(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """What an enforcer put in place for one share."""

    level: EnforcementLevel
    actual: dict[str, Quantity]


class EnforcementError(Exception):
    """An enforcer could not apply, remove or observe a limit (raise a subclass)."""


class RetryableEnforcementError(EnforcementError):
    """A transient failure: the same call may succeed later."""


class PermanentEnforcementError(EnforcementError):
    """The limit cannot be put in place as asked; repeating the call changes nothing."""


class Enforcer(Protocol):
    """Applies and removes share limits on one node (see the module docstring).

    ``level``: what it offers an ordinary share (its node's lease records it, and a
    DeviceClass's minimum enforcement level is checked against it).
    """

    level: EnforcementLevel

    async def apply(self, limit: ShareLimit) -> AppliedLimit:
        """Put ``limit`` in place (idempotently) and report what is in force."""
        ...

    async def remove(self, share_id: str) -> None:
        """Take the limit of ``share_id`` away (a no-op if there is none)."""
        ...

    async def observe(self) -> dict[str, AppliedLimit]:
        """Every share whose limit is in force now."""
        ...

    async def health(self) -> dict[DeviceKey, str | None]:
        """The devices it enforces for, each with what fails (``None``: healthy)."""
        ...

    async def usage(self) -> dict[str, int]:
        """Per share whose limit is in force: how much went through it (bytes; 0: none).

        Shares it cannot observe are left out: their use is never inferred.
        """
        ...


class NoneEnforcer:
    """Enforces nothing and says so: level ``none``, no amounts in force."""

    level: EnforcementLevel = "none"

    def __init__(self) -> None:
        self._applied: dict[str, AppliedLimit] = {}

    async def apply(self, limit: ShareLimit) -> AppliedLimit:
        applied = AppliedLimit(level="none", actual={})
        self._applied[limit.share_id] = applied
        return applied

    async def remove(self, share_id: str) -> None:
        self._applied.pop(share_id, None)

    async def observe(self) -> dict[str, AppliedLimit]:
        return dict(self._applied)

    async def health(self) -> dict[DeviceKey, str | None]:
        return {}

    async def usage(self) -> dict[str, int]:
        return {}
