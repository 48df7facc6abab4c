"""The event store: the PostgreSQL log, what is appended to it, and the fold kept live.

* appending: ``appends`` (what one append is made of, pure), ``eventstore`` (the log
  and the guards of its invariants), ``committing`` (group commit), ``failover``
  (through a primary's loss), ``dbclock`` (the database's clock);
* reading: ``rows`` (the row codec), ``handover`` (this process's own commits passed to
  a reader), ``refusals`` (a refused event counted and logged once), ``recorded`` (what
  the log holds beyond the fold);
* the fold kept live: ``livestate``, ``snapshots`` and ``snapshotcheck``;
* who connects: ``dbroles``, ``servicestores`` (a store per role), ``provisioning``,
  ``logins``; and ``payloadchecks`` (the database's checks, generated from the catalog).

Contract: the store speaks SQL only (``store-speaks-sql``: no module here imports
nats), knows neither the bus nor the floors above (``runtime-floors``); its readers
stand above it (``store-layers``: consumers > their handlers > the store > appends).
"""
