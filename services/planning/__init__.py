"""Capacity planning: ``dracap simulate`` and ``dracap plan`` (``docs/placement.md``).

* :mod:`~services.planning.traces` -- the trace format (CSV / NDJSON) and the
  synthetic generator;
* :mod:`~services.planning.fleets` -- a simulated fleet per mode (consumable,
  whole-device, fixed slices) as a real inventory and real claims;
* :mod:`~services.planning.simulating` -- the discrete-event simulation over the real
  allocator, and the search for the devices a trace needs (pure: no I/O);
* :mod:`~services.planning.capacity` -- the capacity math of ``dracap plan``;
* :mod:`~services.planning.reporting` / :mod:`~services.planning.plotting` -- tables,
  JSON and the comparison PNG;
* :mod:`~services.commands.plan` -- the two commands.

It builds on the allocator only (``services.reservation``), and on the admin API's
client for ``dracap plan --live``.
"""
