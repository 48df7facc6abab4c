"""The ids dracap mints for its events, ordered by the time they are made.

Every append inserts its event ids into a unique index (``events_event_id_key``), and
every consumer that records a message as handled inserts its event id into
``processed_messages``, keyed by consumer and event id. With random (version 4) UUIDs each
insert lands on a random leaf page of an index that grows with the log: once the
indexes outgrow PostgreSQL's buffers, each insert reads a page back and writes another
out, and after each checkpoint nearly every insert writes a full-page image of its leaf
to the WAL — a cost per claim that grows with the claims already live (issue 25).

Version 7 UUIDs (RFC 9562) start with the Unix time in milliseconds, so ids minted
one after another sort one after another: inserts go to the right edge of each index,
a few hot pages, whatever its size. The other 74 bits are random (a version 4 UUID has
122): two ids of the same millisecond collide with odds of 2^-74, and an id still says
nothing of another log's; its order says when it was minted, nothing more (the log's
order is its ``position``), and a clock set back only costs the index its locality.
Ids already stored stay as they are: the indexes mix both kinds without harm.

Share ids stay random (version 4), as upstream's allocator makes them
(its ``GenerateShareID``).
"""

from __future__ import annotations

import os
import time
from typing import Final

__all__ = ["time_ordered_uuid", "time_ordered_uuids"]

_HEX: Final = "0123456789abcdef"
#: The hex digit of a UUID's variant nibble (bits ``10xx``) for each random digit.
_VARIANT: Final = {d: _HEX[(i & 0x3) | 0x8] for i, d in enumerate(_HEX)}


def time_ordered_uuids(count: int) -> list[str]:
    """``count`` version 7 UUIDs of this millisecond, canonical text form (one
    ``os.urandom`` call for all of them)."""
    stamp = f"{time.time_ns() // 1_000_000 & 0xFFFF_FFFF_FFFF:012x}"
    head = f"{stamp[:8]}-{stamp[8:]}-7"
    digits = os.urandom(10 * count).hex()
    variant = _VARIANT
    out: list[str] = []
    for i in range(0, 20 * count, 20):
        h = digits[i : i + 20]
        out.append(f"{head}{h[:3]}-{variant[h[3]]}{h[4:7]}-{h[7:19]}")
    return out


def time_ordered_uuid() -> str:
    """One version 7 UUID (:func:`time_ordered_uuids`)."""
    return time_ordered_uuids(1)[0]
