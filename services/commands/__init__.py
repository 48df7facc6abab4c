"""The command words of ``dracap``: one module for each, composed from the services.

``services/cli.py`` names each word's module (``COMMANDS``) and imports only the one a
command line asks for. Here: ``up`` (every service in one process), ``serve`` (one
service as its own process), ``agent`` (a node's agent), ``reclaim``, ``allocate``,
``replay``, ``audit`` and ``usage`` (with what those two share: ``querying``),
``simulate`` and ``plan`` (``plan``), ``report``, ``db`` and ``prove``.

A service's own package holds what the service decides and does; a command module
holds its command line and the wiring around it, so a service never imports a command.
Still beside their services: ``claim``, ``devices``, ``policy``, ``class``, ``node``
(:mod:`services.claims.command`) and ``apply``/``get``/``delete``
(:mod:`services.claims.objects`), which the stack uses to apply objects; and ``auth``
(:mod:`services.brokerauth`), whose accounts the stack and the durables use.

Contracts: ``services-layers`` (the commands above the stack and the services, below
the CLI) and ``commands-layers`` (``prove`` above ``up``, the words independent of each
other, above ``querying``).
"""
