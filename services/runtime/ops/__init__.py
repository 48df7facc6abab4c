"""Operations: the process kept well, and what the fold says about the cluster.

``embedded`` and ``supervising`` (``dracap up``'s own PostgreSQL and nats-server,
restarted when they die), ``health`` (checks, ``/healthz`` and ``/readyz``),
``leadership`` (one active instance, the others standing by), ``selectorpool`` and
``selectorworker`` (tenants' CEL under a deadline in a worker process), ``slos``,
``series``, ``gauges`` and ``holdings`` (metrics read off the folded log).

Contract: ops may read the store (a fold, a session lock) but carries nothing
(``runtime-floors``: beside ``delivery``, independent of it, below ``hosting``).
"""
