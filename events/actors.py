"""Who caused an event: the grammar of every envelope's ``actor``.

The actor is written by the process that appends, from an identity it did not take
from the request's payload:

=============================== =============================================================
``tenant:<user>@<namespace>``   a tenant user; the broker authenticated the user's NKey, and
                                the namespace is the user's account, not a field it sent
``operator:<user>``             an operator (a user of the operators' account)
``agent:<node>#<epoch>``        a node agent, running with its node's credentials, holding
                                its node's lease ``epoch`` (``agent:<node>``: a report
                                made without a lease, by tools and older logs)
``system:<service>``            a dracap service acting on what it consumed (``reservation-0``)
``anonymous:<namespace>``       a request of ``dracap up --insecure``, where nobody is
                                authenticated (``anonymous:-`` for an admin request)
=============================== =============================================================

The bracketed parts never contain ``:`` or ``@`` (user names and namespaces are DNS
labels, node names DNS subdomains, service names are ours), so :func:`parse_actor`
reads every actor back unambiguously. Audit and billing subscribers read it that way.

The epoch of an agent's actor is what the event store checks: an append whose actor
names an epoch older than the node's current lease (or one the node was fenced or
expired at) is refused and the refusal recorded (``docs/reclamation.md``).
"""

from __future__ import annotations

import re
from typing import Final, Literal

import msgspec

from events.errors import EventsError

__all__ = ["Actor", "ActorError", "ActorKind", "parse_actor"]

ActorKind = Literal["tenant", "operator", "agent", "system", "anonymous"]
_KINDS: Final[frozenset[str]] = frozenset({"tenant", "operator", "agent", "system", "anonymous"})
_PART: Final = re.compile(r"[^:@\s]+")

#: What an anonymous admin request names instead of a namespace.
NO_NAMESPACE: Final = "-"


class ActorError(EventsError):
    """A string that is not an actor of this grammar."""


class Actor(msgspec.Struct, frozen=True, kw_only=True):
    """One actor: its kind, its name, and a tenant's namespace."""

    kind: ActorKind
    name: str
    namespace: str | None = None
    epoch: int | None = None  #: an agent's lease epoch

    def __post_init__(self) -> None:
        if not _PART.fullmatch(self.name):
            raise ActorError(f"actor name {self.name!r} must be non-empty, without ':', '@'")
        if (self.kind == "tenant") != (self.namespace is not None):
            raise ActorError("a tenant actor, and only a tenant actor, names a namespace")
        if self.namespace is not None and not _PART.fullmatch(self.namespace):
            raise ActorError(f"actor namespace {self.namespace!r} is not a name")
        if self.epoch is not None and (self.kind != "agent" or self.epoch < 1):
            raise ActorError("only an agent actor names an epoch, and it is at least 1")
        if "#" in self.name:
            raise ActorError(f"actor name {self.name!r} must not contain '#'")

    def __str__(self) -> str:
        if self.kind == "tenant":
            return f"tenant:{self.name}@{self.namespace}"
        if self.epoch is not None:
            return f"agent:{self.name}#{self.epoch}"
        return f"{self.kind}:{self.name}"

    @classmethod
    def tenant(cls, user: str, namespace: str) -> Actor:
        return cls(kind="tenant", name=user, namespace=namespace)

    @classmethod
    def operator(cls, user: str) -> Actor:
        return cls(kind="operator", name=user)

    @classmethod
    def agent(cls, node: str, epoch: int | None = None) -> Actor:
        return cls(kind="agent", name=node, epoch=epoch)

    @classmethod
    def system(cls, service: str) -> Actor:
        return cls(kind="system", name=service)

    @classmethod
    def anonymous(cls, namespace: str | None) -> Actor:
        return cls(kind="anonymous", name=namespace or NO_NAMESPACE)


def parse_actor(text: str) -> Actor:
    """The :class:`Actor` written as ``text``; :class:`ActorError` if it is none."""
    kind, colon, rest = text.partition(":")
    if not colon or kind not in _KINDS:
        raise ActorError(f"actor {text!r}: must start with one of {', '.join(sorted(_KINDS))}")
    if kind == "tenant":
        user, at, namespace = rest.partition("@")
        if not at:
            raise ActorError(f"actor {text!r}: a tenant actor is tenant:<user>@<namespace>")
        return Actor.tenant(user, namespace)
    if kind == "agent" and "#" in rest:
        node, _, epoch = rest.partition("#")
        if not epoch.isdigit():
            raise ActorError(f"actor {text!r}: an agent's epoch is a positive number")
        return Actor.agent(node, int(epoch))
    return Actor(kind=kind, name=rest)  # type: ignore[arg-type]  # kind checked above
