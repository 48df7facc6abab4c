"""The tenant's writes: ``claims.apply``, ``delete``, ``reserve`` and ``unreserve``.

Each is a pure decision (:func:`services.claims.admission.decide_apply`, the others in
:mod:`services.claims.adminwrites`) on a frozen live state, appended with the claim
stream's expected version and decided again on the whole log when it lost a race. An
admitted claim counts against its namespace's quota from the decision until its append
is folded (:meth:`TenantWrites._hold`), so concurrent applies of this instance cannot
overrun it; what other replicas wrote and this fold lacks is the database's to catch:
every admission appends with its premise (the fold's position, the classes the claim
names and, with a quota, the claims in flight it counted,
:class:`~services.runtime.store.appends.AdmissionPremise`), which the append refuses as a
conflict when another claim of the namespace was admitted meanwhile (with a quota), or
the namespace's access record or a named class's mode or existence changed, and the
apply is decided again on the whole log (at most :data:`QUOTA_RACES` times;
docs/tenancy.md). A refusal carries no premise: one by a rule that reads the fold
(:data:`~services.claims.admission.FOLD_RULES`) is decided again on the whole log before
it is recorded or answered, so what another replica wrote before the request came (an
administrator's grant, a delete that freed quota) is never missed. Long
selector expressions are compiled in the selector pool before admission, at most
:data:`CHECKS_PER_NAMESPACE` applies of a namespace at a time.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from typing import Final

from events.actors import Actor
from events.catalog import ClaimSubmitted
from events.envelopes import claim_stream
from events.selectors import INLINE_COMPILE_CHARS, is_checked, record_verdict
from events.state import ClusterState
from services.claims.adminwrites import AdminWrite, Reservation, decide_delete, decide_reservation
from services.claims.admission import (
    FOLD_RULES,
    ApplyDecision,
    Refusal,
    class_names,
    decide_apply,
    quota_of,
    read_claim,
    selector_expressions,
)
from services.claims.apicore import (
    ApiCore,
    NameRequest,
    decode_request,
    not_found_reply,
    refusal_reply,
)
from services.runtime.bus.queries import error_reply, ok_reply
from services.runtime.ground.errors import ConflictError
from services.runtime.ground.metrics import ADMISSION_RACES, CLAIMS, REJECTIONS
from services.runtime.store.appends import AdmissionPremise
from services.runtime.store.livestate import SEEN

__all__ = ["CHECKS_PER_NAMESPACE", "QUOTA_RACES", "TenantWrites", "premise_stream"]

log = logging.getLogger("dracap.claims")

#: Applies of one namespace that may wait for the selector pool at once (see apply).
CHECKS_PER_NAMESPACE: Final = 4


#: Races an apply may lose to other admissions of its namespace before it is answered
#: ``conflict`` (besides :attr:`ApiCore.max_attempts` for its own stream). Each lost race
#: is another claim of the namespace admitted meanwhile, so a burst at the quota ends in
#: a refusal by quota long before; the bound only keeps a request from circling forever.
QUOTA_RACES: Final = 64


def premise_stream(namespace: str) -> str:
    """The stream a broken quota premise names (``dracap_expect_admissions``)."""
    return f"admissions:{namespace}"


def _premise(
    decision: ApplyDecision, quota: int | None, seen: int, admitting: Collection[str]
) -> AdmissionPremise | None:
    """What an admission takes for granted (:class:`AdmissionPremise`): that nothing
    after the fold's position ``seen`` changed the namespace's access record or the
    classes the claim names, and, in a namespace with a ``quota``, that no claim of the
    namespace was admitted meanwhile but the ones this instance is admitting. The
    database checks it with the append, where every replica's admissions meet.

    ``admitting`` is taken when the append is sent, not at the decision: a claim this
    instance decided meanwhile counted this one, so together they stay within the quota
    whichever is appended first (docs/tenancy.md has the argument)."""
    if decision.refusal is not None or not decision.events:
        return None
    classes = tuple(
        name
        for event in decision.events
        if isinstance(event, ClaimSubmitted)
        for name in class_names(event.claim)
    )
    if quota is None:  # the namespace's policy and the classes only
        return AdmissionPremise(decision.namespace, seen, quota=False, classes=classes)
    others = tuple(sorted(name for name in admitting if name != decision.name))
    return AdmissionPremise(decision.namespace, seen, others, classes=classes)


def _recheck(decision: ApplyDecision, tries: int) -> bool:
    """Whether a refusal by a rule that reads the fold must be decided again on the whole
    log first: the fold may lack what another replica wrote before this request came
    (an administrator's grant, a delete that freed quota), and a refusal carries no
    premise for the database to check. Only the first decision, made on what this
    instance has heard of, is rechecked: every later one is on the whole log already."""
    refusal = decision.refusal
    return tries == 0 and refusal is not None and refusal.kind in FOLD_RULES


class TenantWrites(ApiCore):
    """The tenant endpoints that write (see the module docstring)."""

    async def apply(self, namespace: str, data: bytes, actor: Actor | None = None) -> bytes:
        """``claims.apply``: admit or reject a ResourceClaim manifest."""
        actor = actor or Actor.anonymous(namespace)
        busy = await self._check_selectors(namespace, data)
        if busy is not None:
            return busy
        attempt = races = rechecks = 0
        while attempt < self.max_attempts:
            # the whole log after any lost race, and before a refusal by the fold's rules
            await self._fresh(attempt + races + rechecks)
            async with self.live.frozen() as state:
                decision = decide_apply(
                    state,
                    namespace,
                    data,
                    self.gates,
                    limits=self._device_limits(state),
                    admitting=self._admitting.get(namespace, ()),
                )
                if _recheck(decision, attempt + races + rechecks):
                    rechecks += 1
                    continue
                held = self._hold(namespace, decision)  # before any await: the quota sees it
                quota = quota_of(state, namespace)
                seen = state.position
                stream = claim_stream(namespace, decision.name or "")
                version = await self.live.stream_version(stream) if decision.events else 0
            # the claims this instance admits now: the ones decided meanwhile counted this one
            premise = _premise(decision, quota, seen, self._admitting.get(namespace, ()))
            try:
                return await self._record_apply(
                    namespace, decision, stream, version, actor, premise
                )
            except ConflictError as exc:
                if exc.stream == premise_stream(namespace) and races < QUOTA_RACES:
                    races += 1  # somebody else took quota: decide again, on the whole log
                    ADMISSION_RACES.inc()
                else:
                    attempt += 1
            finally:
                if held is not None:
                    self._unhold(namespace, held)
        return error_reply("conflict", "the claim kept changing while it was applied; retry")

    def _hold(self, namespace: str, decision: ApplyDecision) -> str | None:
        """Count an admitted claim against the quota until its append is folded."""
        name = decision.name
        admitting = self._admitting.setdefault(namespace, set())
        if decision.refusal is not None or name is None or name in admitting:
            if not admitting:
                del self._admitting[namespace]
            return None
        admitting.add(name)
        return name

    def _unhold(self, namespace: str, name: str) -> None:
        admitting = self._admitting.get(namespace)
        if admitting is not None:
            admitting.discard(name)
            if not admitting:
                del self._admitting[namespace]

    async def _record_apply(
        self,
        namespace: str,
        decision: ApplyDecision,
        stream: str,
        version: int,
        actor: Actor,
        premise: AdmissionPremise | None,
    ) -> bytes:
        """Append an apply's decision and reply; :class:`ConflictError`: it lost a race
        (the claim's stream moved, or its quota premise broke), decide again."""
        if decision.events:
            await self._append(stream, version, list(decision.events), actor, premise)
            self._count(decision.refusal)
        elif decision.refusal is not None:
            REJECTIONS.labels(reason=decision.refusal.kind).inc()
        if decision.refusal is not None:
            return refusal_reply(decision.refusal)
        assert decision.name is not None
        state = await self.live.fresh(SEEN)
        claim = state.claim(namespace, decision.name)
        assert claim is not None
        (view,) = await self._views(state, [claim])
        return ok_reply(claim=view)

    async def _check_selectors(self, namespace: str, data: bytes) -> bytes | None:
        """Have the claim's long selector expressions compiled in the pool, off this loop.

        Admission then takes the pool's verdicts (:func:`events.selectors.record_verdict`)
        instead of parsing them here: 10 KiB of CEL costs cel-python half a second. A
        namespace may have :data:`CHECKS_PER_NAMESPACE` applies waiting for the pool;
        one more is answered ``conflict`` (retry) at once, so that one tenant's applies
        cannot take every request slot of the API while they wait. Returns that reply.
        """
        if b"expression" not in data:
            return None
        claim = read_claim(data, namespace)
        if isinstance(claim, Refusal):
            return None  # admission refuses it again, without reaching the selectors
        flag = self.gates.consumable_capacity
        long = [
            e
            for e in selector_expressions(claim)
            if len(e) > INLINE_COMPILE_CHARS and not is_checked(e, consumable_capacity=flag)
        ]
        if not long:
            return None
        if self._checking[namespace] >= CHECKS_PER_NAMESPACE:
            return error_reply(
                "conflict",
                f"namespace {namespace!r} has {CHECKS_PER_NAMESPACE} claims whose selectors "
                "are being compiled; retry when they are done",
                rule=f"at most {CHECKS_PER_NAMESPACE} applies with long selectors in flight",
            )
        self._checking[namespace] += 1
        try:
            verdicts = await self.selectors.check(long, owner=namespace, consumable_capacity=flag)
        finally:
            self._checking[namespace] -= 1
            if not self._checking[namespace]:
                del self._checking[namespace]
        for expression, problem in verdicts.items():
            record_verdict(expression, problem, consumable_capacity=flag)
        return None

    @staticmethod
    def _count(refusal: Refusal | None) -> None:
        if refusal is None:
            CLAIMS.labels(outcome="admitted").inc()
        else:
            CLAIMS.labels(outcome="rejected").inc()
            REJECTIONS.labels(reason=refusal.kind).inc()

    async def delete(self, namespace: str, data: bytes, actor: Actor | None = None) -> bytes:
        """``claims.delete``: release an allocated claim, withdraw any other."""
        actor = actor or Actor.anonymous(namespace)
        request: NameRequest = decode_request(data, NameRequest)
        stream = claim_stream(namespace, request.name)
        for attempt in range(self.max_attempts):
            await self._fresh(attempt)
            async with self.live.frozen() as state:
                deletion = decide_delete(state, namespace, request.name)
                event = deletion.event
                version = await self.live.stream_version(stream) if event is not None else 0
            if not deletion.found:
                return not_found_reply(namespace, request.name)
            if event is not None:
                try:
                    await self._append(stream, version, [event], actor)
                except ConflictError:
                    continue
            return ok_reply(phase=deletion.phase)
        return error_reply("conflict", "the claim kept changing while it was deleted; retry")

    async def reserve(self, namespace: str, data: bytes, actor: Actor | None = None) -> bytes:
        """``claims.reserve``: a consumer reserves the claim (``status.reservedFor``)."""
        return await self._reservation(namespace, data, actor, reserve=True)

    async def unreserve(self, namespace: str, data: bytes, actor: Actor | None = None) -> bytes:
        """``claims.unreserve``: a consumer gives its reservation up."""
        return await self._reservation(namespace, data, actor, reserve=False)

    async def _reservation(
        self, namespace: str, data: bytes, actor: Actor | None, *, reserve: bool
    ) -> bytes:
        who = actor or Actor.anonymous(namespace)
        request: Reservation = decode_request(data, Reservation)
        stream = claim_stream(namespace, request.name)

        def reply(state: ClusterState, write: AdminWrite) -> bytes:
            claim = state.claim(namespace, request.name)
            return ok_reply(
                applied=list(write.applied),
                unchanged=list(write.unchanged),
                reserved_for=list(claim.reserved_for) if claim is not None else [],
            )

        return await self._write_at_version(
            stream,
            lambda state: decide_reservation(state, namespace, request, reserve=reserve),
            who,
            "the claim kept changing while it was reserved",
            reply,
        )
