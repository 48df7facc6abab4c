"""The ground floor of the runtime: what every subsystem stands on, and nothing else.

The typed error tree (``errors``) and which failures are a server away (``outages``),
the settings read once from the environment (``settings``) and where a service's
database login lies (``loginfiles``), the clocks and waits every loop uses (``clock``,
``waiting``), every Prometheus metric defined once (``metrics``), the event loop and
the collector of long-running processes (``eventloop``, ``gctuning``), and what a
command needs first (``printable`` text, ``outputs`` checked, ``plotting``,
``deferred`` imports).

Contract: a module here imports no other floor of ``services/runtime/`` (the lowest
layer of ``runtime-floors``). A rule that needs the store, the bus or a subsystem
belongs in that subsystem.
"""
