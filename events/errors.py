"""The typed error tree of the pure core.

Every error raised by ``events`` derives from :class:`EventsError`, so a caller can
catch the whole package with one clause and still tell the kinds apart by type::

    EventsError
    ├── QuantityError          a string that is not a Kubernetes quantity
    ├── ValidationError        a manifest or command that breaks an API rule
    │   └── ManifestError      a manifest file that cannot be read (events.manifests)
    ├── SelectorError          a CEL selector that does not compile or evaluate
    │   ├── SelectorCostExceeded   an evaluation that went over its cost budget
    │   └── SelectorDeadlineExceeded   an evaluation stopped at its wall-clock deadline
    ├── SelectorsPending       a heavy selector's results are not in yet (events.inventory)
    ├── SubjectError           a name that cannot be part of a NATS subject
    ├── CatalogError           an event that is not part of the catalog
    ├── SnapshotError          a stored fold snapshot that cannot be restored
    └── InvariantViolation     a fold step that would break an invariant

None of these is retryable: they describe bad input or a broken log, and the same
input will fail the same way again. Retryable and conflict errors belong to the
I/O layers (``services.runtime``), never to this package.

Two classes of :mod:`events.celcost` are deliberately outside the tree:
``OverBudget`` and ``Interrupted`` are signals, not errors. They derive from
``BaseException`` so that no ``except Exception`` inside cel-python can swallow them,
and they never leave :mod:`events.selectors` and the selector worker, which turn them
into :class:`SelectorCostExceeded` or a reported deadline.
"""

from __future__ import annotations


class EventsError(Exception):
    """Root of every error raised by the pure core."""


class QuantityError(EventsError, ValueError):
    """A string is not a valid Kubernetes quantity."""

    def __init__(self, text: str, reason: str) -> None:
        super().__init__(f"quantity {text!r}: {reason}")
        self.text = text
        self.reason = reason


class ValidationError(EventsError, ValueError):
    """An object breaks a rule of the API.

    ``obj`` names the object (``ResourceClaim ns/name``), ``field`` is the field path in
    Kubernetes notation (``spec.devices.requests[0].exactly.count``) and ``rule`` says
    what the field must satisfy.
    """

    def __init__(self, obj: str, field: str, rule: str) -> None:
        super().__init__(f"{obj}: {field}: {rule}")
        self.obj = obj
        self.field = field
        self.rule = rule


class SelectorError(EventsError):
    """A CEL selector failed to compile or to evaluate."""

    def __init__(self, expression: str, message: str) -> None:
        shown = expression if len(expression) <= 120 else expression[:100] + "..."
        super().__init__(f"CEL selector {shown!r}: {message}")
        self.expression = expression
        self.message = message


class SelectorCostExceeded(SelectorError):  # noqa: N818 (the name says what happened)
    """A CEL selector's evaluation spent more than the cost units it was allowed."""

    def __init__(self, expression: str, message: str, limit: int) -> None:
        super().__init__(expression, message)
        self.limit = limit


class SelectorDeadlineExceeded(SelectorError):  # noqa: N818 (as above)
    """A CEL selector's evaluation was stopped at a wall-clock deadline (dracap's own)."""


class SubjectError(EventsError, ValueError):
    """A name cannot be written as (part of) a NATS subject."""


class CatalogError(EventsError, ValueError):
    """A payload does not decode into an event of the catalog."""


class SnapshotError(EventsError, ValueError):
    """A stored snapshot of the fold is of another format, or does not decode."""


class InvariantViolation(EventsError):  # noqa: N818 (a violation, not a failure of the code)
    """Folding an event would break an invariant of the design."""

    def __init__(self, position: int, invariant: str, detail: str) -> None:
        super().__init__(f"position {position}: invariant {invariant!r} broken: {detail}")
        self.position = position
        self.invariant = invariant
        self.detail = detail
