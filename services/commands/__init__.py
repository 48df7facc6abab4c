"""The command words of ``dracap``: one module for each, composed from the services.

``services/cli.py`` names each word's module (``COMMANDS``) and imports only the one a
command line asks for. Here: ``up`` (every service in one process), ``serve`` (one
service as its own process), ``agent`` (a node's agent), ``reclaim``, ``allocate``,
``replay``, ``audit`` and ``usage`` (with what those two share: ``querying``),
``simulate`` and ``plan`` (``plan``), ``report``, ``db``, ``prove``, ``auth``,
``claim``/``devices``/``policy``/``class``/``node`` (``claim``) and
``apply``/``get``/``delete`` (``objects``; with ``claim`` they share ``showing``).

A service's own package holds what the service decides and does; a command module
holds its command line and the wiring around it, so a service never imports a command.
What the stack imports stays below it: applying objects by kind
(:mod:`services.claims.objects`) and the broker's accounts (:mod:`services.brokerauth`);
the ``apply`` and ``auth`` command lines above them are here.

Contracts: ``services-layers`` (the commands above the stack and the services, below
the CLI) and ``commands-layers`` (``prove`` above ``up``, the words independent of each
other, above ``querying`` and ``showing``).
"""
