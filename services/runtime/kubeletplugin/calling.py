"""One kubelet call, answered for every claim: batching, isolation and the deadline.

The kubelet sends a batch of claims and needs an entry for each (a missing one is
retried). :func:`answer_claims` turns one handler call into exactly that:

1. The whole batch goes to the handler in one call, so a handler can batch its reads.
   A UID listed twice is passed once. An empty batch answers empty, without a call.
2. If that call raises and the batch has more than one claim, the handler is called
   again once per claim, concurrently, so the exception lands on the claim(s) that
   cause it (:class:`HandlerRaised`) while the others get their results. Prepare and
   unprepare are idempotent by the kubelet's contract, so the repeat is safe.
3. A claim the handler's answer leaves out gets :class:`ResultMissing`; entries for
   UIDs that were not asked for are dropped (and logged).
4. Everything above runs under one deadline. When it passes, the handler's calls are
   cancelled and every claim still unanswered gets :class:`DeadlineExceeded`; the
   reply still goes out in time, so the kubelet sees an error per claim instead of its
   own 45 s timeout.

Nothing here knows about gRPC: it works on :class:`ClaimRef` and the handler's answers.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import TypeVar

from services.runtime.kubeletplugin.contract import ClaimRef
from services.runtime.kubeletplugin.errors import (
    ClaimFailure,
    DeadlineExceeded,
    HandlerRaised,
    ResultMissing,
)

__all__ = ["answer_claims"]

_log = logging.getLogger(__name__)

T = TypeVar("T")
Call = Callable[[list[ClaimRef]], Awaitable[Mapping[str, T]]]


async def answer_claims(
    claims: list[ClaimRef], call: Call[T], *, deadline_s: float, what: str
) -> dict[str, T | ClaimFailure]:
    """An answer for every UID of ``claims``: the handler's, or why there is none.

    ``what`` names the call in messages and logs (e.g. ``gpu.example.com prepare``).
    """
    unique: dict[str, ClaimRef] = {}
    for claim in claims:
        unique.setdefault(claim.uid, claim)  # the first of duplicate UIDs wins
    answers: dict[str, T | ClaimFailure] = {}
    if not unique:
        return answers
    try:
        async with asyncio.timeout(deadline_s):
            await _answer(list(unique.values()), call, answers, what)
    except TimeoutError:
        for claim in unique.values():
            if claim.uid not in answers:
                answers[claim.uid] = DeadlineExceeded(
                    f"{what} of claim {_name(claim)} did not finish within {deadline_s:g} s",
                    uid=claim.uid,
                )
                _log.warning("%s: claim %s: deadline of %g s passed", what, claim.uid, deadline_s)
    return {uid: answers[uid] for uid in unique}


async def _answer(
    claims: list[ClaimRef], call: Call[T], answers: dict[str, T | ClaimFailure], what: str
) -> None:
    try:
        batch = await call(claims)
    except Exception as exc:
        if len(claims) == 1:
            answers[claims[0].uid] = _raised(claims[0], exc, what)
            return
        _log.warning("%s of %d claims raised %r; calling per claim", what, len(claims), exc)
        await asyncio.gather(*(_answer([claim], call, answers, what) for claim in claims))
        return
    asked = {c.uid for c in claims}
    extra = sorted(set(batch) - asked)
    if extra:
        _log.warning("%s: dropped answers for claims not asked for: %s", what, extra)
    for claim in claims:
        if claim.uid in batch:
            answers[claim.uid] = batch[claim.uid]
        else:
            answers[claim.uid] = ResultMissing(
                f"{what}: the driver returned no result for claim {_name(claim)}", uid=claim.uid
            )


def _raised(claim: ClaimRef, exc: Exception, what: str) -> HandlerRaised:
    _log.error("%s of claim %s raised", what, claim.uid, exc_info=exc)
    return HandlerRaised(
        f"{what} of claim {_name(claim)} failed: {type(exc).__name__}: {exc}", uid=claim.uid
    )


def _name(claim: ClaimRef) -> str:
    return f"{claim.namespace}/{claim.name} ({claim.uid})"
