"""The bus: NATS as dracap uses it, for whoever speaks to it.

``jetstream`` (connecting, the one stream of events and its durable consumers'
configuration), ``credentials`` (who a process is on the bus, who sent a request),
``endpoints`` (where the servers are: one resolution for every command), ``replies``
(replies of any size over request/reply), ``queries`` (read-only query endpoints of a
subscriber) and ``apiclient`` (the client of the claims and admin APIs).

Contract: the bus knows nothing of the event store (``runtime-floors``: ``store`` and
``bus`` are independent); the node agent, which reaches NATS only, is built from here
and the ground (``agent-off-the-database``).
"""
