"""The transport's metrics: one duration and one outcome count per kubelet call.

``dracap_kubelet_call_duration_seconds{method}`` times each unary call (registration,
prepare, unprepare) from arrival to reply; the health stream is long-lived, so it is
counted when it ends but not timed. ``dracap_kubelet_calls_total{method,outcome}``
counts calls by outcome:

* ``ok`` — every claim answered without an error (for the stream: it ended normally);
* ``claim_error`` — some claim's entry carries an error (the handler's, an exception
  it raised, or a missing result);
* ``deadline`` — the call's deadline passed and unanswered claims got an error;
* ``refused`` — the kubelet reported the registration as failed;
* ``cancelled`` — the kubelet went away during a health stream;
* ``error`` — the call itself failed (the kubelet got an error status).

Every (method, outcome) that can happen exists at 0 once a plugin starts.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Final

from services.runtime.ground.metrics import KUBELET_CALL_DURATION, KUBELET_CALLS

__all__ = ["OUTCOMES", "Outcome", "initialise_series", "measured"]

_CLAIM_CALL = ("ok", "claim_error", "deadline", "error")
OUTCOMES: Final[dict[str, tuple[str, ...]]] = {
    "GetInfo": ("ok", "error"),
    "NotifyRegistrationStatus": ("ok", "refused", "error"),
    "NodePrepareResources": _CLAIM_CALL,
    "NodeUnprepareResources": _CLAIM_CALL,
    "NodeWatchResources": ("ok", "cancelled", "error"),
}


class Outcome:
    """The outcome a call will be counted with; the call's code sets :attr:`value`."""

    def __init__(self, value: str = "ok") -> None:
        self.value = value


def initialise_series(methods: Iterable[str]) -> None:
    """Create each outcome series of ``methods`` at 0 (and each duration series)."""
    for method in methods:
        if method != "NodeWatchResources":
            KUBELET_CALL_DURATION.labels(method=method)
        for outcome in OUTCOMES[method]:
            KUBELET_CALLS.labels(method=method, outcome=outcome)


@contextmanager
def measured(method: str, *, timed: bool = True) -> Iterator[Outcome]:
    """Count (and unless ``timed`` is False, time) the call run in the block.

    An exception out of the block counts as ``error``, except a cancellation, which
    keeps the outcome the block set.
    """
    outcome = Outcome()
    start = time.perf_counter()
    try:
        yield outcome
    except Exception:
        outcome.value = "error"
        raise
    finally:
        if timed:
            KUBELET_CALL_DURATION.labels(method=method).observe(time.perf_counter() - start)
        KUBELET_CALLS.labels(method=method, outcome=outcome.value).inc()
