"""Hosting: what every service command wires around the service it runs.

``process`` (one service as its own process: servers found, NATS, signals, series at
0, health) and ``storehosting`` (the same with the event store and its fold), for
``dracap serve``, ``agent``, ``reclaim``, ``audit serve``, ``usage serve`` and
``replay snapshot`` (the command words themselves are ``services/commands/``).

Contract: the top floor of the runtime (``runtime-floors``); it imports any floor below
and no service (``runtime-imports-no-service``).
"""
