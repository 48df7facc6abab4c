"""The I/O runtime of dracap: every socket, SQL statement and subprocess, in floors.

The services (``services/claims``, ``reservation``, ...) are thin loops around pure
decisions; everything they do to the outside world is here, in subsystems that each
import only the floors below them (the ``runtime-floors`` contract in
``pyproject.toml``; ``docs/architecture.md``, "The floors of services/runtime/")::

    hosting                     one service as a process: its wiring, its store
    delivery | ops              the log carried to its readers | the process kept well
    store | bus | kube | kubeletplugin
                                the event log | NATS | Kubernetes | the kubelet
    ground                      errors, settings, clocks, metrics: no subsystem

* :mod:`~services.runtime.ground` -- what every floor stands on;
* :mod:`~services.runtime.store` -- the PostgreSQL event log, its rows, appends and the
  fold kept live, snapshots, the database's logins;
* :mod:`~services.runtime.bus` -- NATS: the connection and the events stream,
  credentials, where the servers are, replies of any size, queries, the API client;
* :mod:`~services.runtime.delivery` -- the log carried on: the relay, the bus rebuilt,
  durable consumers with confirmation, catch-up projectors and the subscribers;
* :mod:`~services.runtime.ops` -- embedded servers and their supervision, health,
  one active instance, the selector pool, the SLOs and gauges read off the fold;
* :mod:`~services.runtime.hosting` -- what every service command wires around a service;
* :mod:`~services.runtime.kube` and :mod:`~services.runtime.kubeletplugin` -- the two
  Kubernetes sides of a DRA driver (the API server; the kubelet's gRPC).

The store and the bus do not know each other: what joins them (the relay, the
consumers) is the delivery floor above both.
"""
