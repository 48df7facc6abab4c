"""The exit codes of every ``dracap`` command, in one table.

A script that runs ``dracap`` must be able to tell *why* a command failed without
reading its message, so each code has exactly one meaning, whichever command exits
with it:

====  ====================  =========================================================
code  name                  meaning
====  ====================  =========================================================
0     OK                    done (``replay verify``: the log and projections agree;
                            ``prove bandwidth``: every limit held)
1     ERROR                 an internal error, or a server or API that is not
                            configured, does not answer or gave up (``dracap up``
                            past its restart limit); ``claim apply --wait`` whose
                            claims did not all become Ready in time
2     BAD_INPUT             a flag, file or manifest that cannot be read, decoded or
                            accepted as given (``connection.json`` too); a claim
                            larger than the API takes; ``prove`` without
                            CAP_NET_ADMIN
3     NOT_FOUND             the object asked for does not exist
4     REJECTED              the control plane refused the request (admission, a
                            name conflict, a request that kept losing races)
5     INVARIANT_VIOLATED    a check ran to the end and found a guarantee broken:
                            ``replay verify`` (the fold of the log differs from the
                            projections), ``prove bandwidth`` (a share off its rate by
                            more than 3 %, pushed below it, or capacity not given back)
6     EVENTS_REFUSED        ``replay verify``: everything agrees, but the log holds
                            events the fold refuses (each listed with its position,
                            type, actor and reason; every reader skips them)
7     SNAPSHOT_MISMATCH     ``replay verify``: a stored snapshot (or a file's
                            checkpoint) that a reader would start from is not the
                            fold at its position: forged or stale
130   INTERRUPTED           stopped by SIGTERM before the command runs (while it
                            imports or connects: a service stopped once it runs
                            ends with 0), or by SIGINT where it does not answer it
====  ====================  =========================================================

``replay verify`` exits with the worst it found: 5 before 7 before 6. An event the fold
refuses used to be a violation (5) forever, since the log is append-only; it is its own
outcome now, so that a script can tell a log with known refused events from one whose
projections or snapshots are wrong.

A broken guarantee (``replay verify``, ``prove bandwidth``) used to share 1 with an
internal error, which left a script unable to tell a broken log from a database that
was down; it is 5 now. Every other meaning kept its code.

:class:`CommandError` ends a command with one of these codes after one line on
stderr. This module imports nothing from dracap, so every layer may use it.
"""

from __future__ import annotations

import enum

__all__ = ["CommandError", "ExitCode"]


class ExitCode(enum.IntEnum):
    """What a ``dracap`` process's exit status means (see the module docstring)."""

    OK = 0
    ERROR = 1
    BAD_INPUT = 2
    NOT_FOUND = 3
    REJECTED = 4
    INVARIANT_VIOLATED = 5
    EVENTS_REFUSED = 6
    SNAPSHOT_MISMATCH = 7
    INTERRUPTED = 130


class CommandError(Exception):
    """Ends a command with ``exit_code`` after printing the message to stderr."""

    def __init__(self, message: str, exit_code: ExitCode) -> None:
        super().__init__(message)
        self.exit_code = exit_code
