"""Delivery: the log carried to its readers, exactly once and in order.

``relaying`` (the outbox relay: the log published to the stream in position order),
``rebuilding`` (the stream and durables rebuilt from the log by their owner),
``highwater`` (a reader's position, stored off the hot path); ``pulling``,
``consuming``, ``handlers`` and ``confirming`` (durable, idempotent consumers whose
every message is confirmed against the log before a handler sees it); ``projecting``
and ``subscribers`` (catch-up read models and the audit and billing subscribers).

Contract: the one floor that joins the store and the bus (``runtime-floors``: above
both, beside ``ops``, below ``hosting``).
"""
