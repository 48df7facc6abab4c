"""What a process does when one of its readers meets a refused event: count it, log it once.

The fold's driver (:mod:`events.folding`) decides that a stored event is refused and
skips it; every reader of the log (the live state, the audit and billing catch-up, the
consumers' confirmation, the forensic replay) hands the :class:`~events.folding.Refusal`
to :func:`note`, with the event's id and actor. Several readers of one process meet the
same event (``dracap up`` runs them all), and a reader meets it again after a retry or a
restart of its fold; so :func:`note` keeps the ids it has seen (the newest
:data:`REMEMBERED`) and, the first time only,

* counts ``dracap_events_refused_total{reason}`` (undecodable, invariant, error: the
  rule ``DracapEventsRefused`` in ``deploy/prometheus/rules.yaml`` fires on any increase),
* logs one line (``dracap.refusals``, level ERROR) with the event's id, position, type,
  actor, reason and detail. It is logged as the log says it, so a line never carries a
  traceback; ``dracap replay verify`` lists every refused event of the log.

Events are told apart by their id (a UUID), not their position: tests and tools fold
several logs in one process.
"""

from __future__ import annotations

import collections
import logging
from typing import Final

from events.folding import REFUSAL_REASONS, Refusal
from services.runtime.ground.metrics import EVENTS_REFUSED

__all__ = ["REMEMBERED", "note"]

log = logging.getLogger("dracap.refusals")

#: Event ids remembered as noted (a refused event is rare; an id costs ~100 bytes).
REMEMBERED: Final = 65_536
_seen: collections.OrderedDict[str, None] = collections.OrderedDict()
for _reason in REFUSAL_REASONS:  # every series from 0, so that the first refusal is an increase
    EVENTS_REFUSED.labels(reason=_reason)


def note(refusal: Refusal, event_id: str, actor: str | None = None) -> bool:
    """Count and log ``refusal`` unless this process did already; True if it was new."""
    key = str(event_id)
    if key in _seen:
        return False
    _seen[key] = None
    while len(_seen) > REMEMBERED:
        _seen.popitem(last=False)
    EVENTS_REFUSED.labels(reason=refusal.reason).inc()
    log.error(
        "refused event at position %d (%s, actor %s): %s: %s; skipped",
        refusal.position,
        refusal.type,
        actor or "?",
        refusal.reason,
        refusal.detail,
        extra={"event_id": key, "position": refusal.position},
    )
    return True
