"""Every Prometheus metric of dracap, defined once, and the scrape endpoint.

Services import the metric objects from here and never create their own, so names,
units and labels stay consistent and one grep shows what an operator can chart.
Conventions (STYLE.md): the ``dracap_`` prefix, base units (seconds, plain counts,
ratios in [0, 1]), ``_total`` for counters, and only low-cardinality labels (outcome,
reason, class, capacity, consumer, server, check, service) — never a claim, share or
event id.

The metrics live in a registry of their own (:data:`REGISTRY`) together with the
standard process, platform and GC collectors; :func:`start_metrics_server` serves it
over HTTP from a daemon thread on ``/metrics`` (``/`` too, as the client library does);
any other path is ``404`` (:mod:`services.runtime.ops.health` adds ``/healthz`` and
``/readyz`` beside it). ``dracap_build_info{version}`` is always 1, the
usual way to publish the running version. :func:`add_metrics_arguments` gives a
long-running command its ``--metrics-port`` and ``--metrics-addr`` flags.
"""

from __future__ import annotations

import argparse
from importlib import metadata
from threading import Thread
from typing import TYPE_CHECKING, Final
from wsgiref.simple_server import WSGIServer

from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    start_http_server,
)

from services.runtime.ground.settings import SettingsError

if TYPE_CHECKING:
    from collections.abc import Iterable
    from wsgiref.types import StartResponse, WSGIApplication, WSGIEnvironment

__all__ = [
    "BUILD_INFO",
    "CAPACITY_ALLOCATED_RATIO",
    "CLAIMS",
    "CONSUMER_REDELIVERIES",
    "DEAD_LETTERS",
    "EMBEDDED_SERVER_RESTARTS",
    "ENFORCEMENT_LATENCY",
    "EVENTS_REFUSED",
    "HEALTH_CHECK_UP",
    "KUBELET_CALLS",
    "KUBELET_CALL_DURATION",
    "LEASE_RENEWALS",
    "LEASE_RENEWAL_STATEMENTS",
    "LOG_APPEND_DURATION",
    "LOG_DIVERGENCES",
    "NODE_REQUESTS",
    "REGISTRY",
    "REJECTIONS",
    "RELAY_LAG",
    "RELAY_MESSAGES",
    "REPLAN_FAILURES",
    "SCHEDULING_LATENCY",
    "SELECTOR_JOBS",
    "SERVICE_ACTIVE",
    "SNAPSHOTS_WRITTEN",
    "SNAPSHOT_CHECKS",
    "SNAPSHOT_FAILURES",
    "SNAPSHOT_POSITION",
    "TAKE_UP_FAILURES",
    "UNCONFIRMED_MESSAGES",
    "USAGE",
    "MetricsPortError",
    "add_metrics_arguments",
    "not_found",
    "only_metrics",
    "start_metrics_server",
    "version",
]

REGISTRY: Final = CollectorRegistry()
for _collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
    REGISTRY.register(_collector)

_LATENCY_BUCKETS: Final = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
_SLOW_BUCKETS: Final = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

SCHEDULING_LATENCY: Final = Histogram(
    "dracap_scheduling_latency_seconds",
    "From a claim's admission to its first decision, allocated or found unschedulable, "
    "by DeviceClass (the wait for capacity after it is dracap_capacity_wait_seconds).",
    ["class"],
    buckets=(*_LATENCY_BUCKETS, 5.0, 10.0),
    registry=REGISTRY,
)
CLAIMS: Final = Counter(
    "dracap_claims_total",
    "Claims by outcome (admitted, rejected, allocated, unschedulable, ready, released, "
    "not_started_release, not_started_stall).",
    ["outcome"],
    registry=REGISTRY,
)
REJECTIONS: Final = Counter(
    "dracap_rejections_total",
    "Admission rejections by reason (the rule that refused the claim).",
    ["reason"],
    registry=REGISTRY,
)
ADMISSION_RACES: Final = Counter(
    "dracap_admission_races_total",
    "Applies decided again because another claim of their namespace was admitted after "
    "the position they were decided at (the quota's premise broke: claims API replicas "
    "racing at a namespace with a quota).",
    registry=REGISTRY,
)
CAPACITY_ALLOCATED_RATIO: Final = Gauge(
    "dracap_capacity_allocated_ratio",
    "Allocated / total capacity summed over the devices of a DeviceClass.",
    ["class", "capacity"],
    registry=REGISTRY,
)
CAPACITY_STRANDED_RATIO: Final = Gauge(
    "dracap_capacity_stranded_ratio",
    "Free capacity no share can take (below the device's smallest grant) / total, per class.",
    ["class", "capacity"],
    registry=REGISTRY,
)
ENFORCEMENT_LATENCY: Final = Histogram(
    "dracap_enforcement_latency_seconds",
    "From an allocation being bound to its node agent reporting the limit applied, by DeviceClass.",
    ["class"],
    buckets=_SLOW_BUCKETS,
    registry=REGISTRY,
)
LOG_APPEND_DURATION: Final = Histogram(
    "dracap_log_append_duration_seconds",
    "Time one append statement to the event log takes, from sending it to its answer, "
    "whatever the answer (the wait for the log's head lock, the guards and the commit "
    "included).",
    buckets=(0.0005, *_LATENCY_BUCKETS),
    registry=REGISTRY,
)
RELAY_LAG: Final = Gauge(
    "dracap_relay_lag_events",
    "Events in the Postgres log that the relay has not yet published to JetStream.",
    registry=REGISTRY,
)
RELAY_MESSAGES: Final = Counter(
    "dracap_relay_messages_total",
    "Events the relay went past, by what became of them: stored by the stream, "
    "recognised as a duplicate of one stored before (a relay taking over from the "
    "checkpoint, or two relays publishing at once), or unread: not published, since no "
    "durable consumer reads them (and events the fold refuses to decode).",
    ["outcome"],
    registry=REGISTRY,
)
SERVICE_ACTIVE: Final = Gauge(
    "dracap_service_active",
    "1 while this instance of a single-active service (relay, snapshot writer) holds its "
    "lease and acts; 0 while it stands by.",
    ["service"],
    registry=REGISTRY,
)
EMBEDDED_SERVER_RESTARTS: Final = Counter(
    "dracap_embedded_server_restarts_total",
    "Times dracap up started an embedded server (postgres, nats) again after it died.",
    ["server"],
    registry=REGISTRY,
)
HEALTH_CHECK_UP: Final = Gauge(
    "dracap_health_check_up",
    "1 while a readiness check of dracap up passes (postgres, nats, services), else 0.",
    ["check"],
    registry=REGISTRY,
)
USAGE: Final = Counter(
    "dracap_usage_unit_seconds_total",
    "Billed usage: a capacity's amount in its base unit (bytes of memory, bit/s of "
    "bandwidth) times seconds held, per namespace and DeviceClass; state held or unknown "
    "(counted when a stretch closes: at a release, fence, unknown mark or confirmation).",
    ["namespace", "class", "capacity", "state"],
    registry=REGISTRY,
)
CONSUMER_REDELIVERIES: Final = Counter(
    "dracap_consumer_redeliveries_total",
    "Messages a consumer received again (after a nak or an ack timeout).",
    ["consumer"],
    registry=REGISTRY,
)
DEAD_LETTERS: Final = Counter(
    "dracap_dead_letters_total",
    "Messages a consumer gave up on (MessageDeadLettered written, message terminated).",
    ["consumer"],
    registry=REGISTRY,
)
SELECTOR_JOBS: Final = Counter(
    "dracap_selector_jobs_total",
    "Tenant selectors evaluated in the worker process, by outcome (evaluated, deadline).",
    ["outcome"],
    registry=REGISTRY,
)
UNCONFIRMED_MESSAGES: Final = Counter(
    "dracap_unconfirmed_messages_total",
    "Bus messages a consumer dropped because the log does not hold them as sent.",
    ["consumer"],
    registry=REGISTRY,
)
NODE_TRANSITIONS: Final = Counter(
    "dracap_node_transitions_total",
    "Node lease transitions a reclamation service recorded (expired, fenced_by_hook).",
    ["transition"],
    registry=REGISTRY,
)
FENCE_HOOK_RUNS: Final = Counter(
    "dracap_fence_hook_runs_total",
    "Runs of the configured fence hook, by outcome (off, failed, timeout).",
    ["outcome"],
    registry=REGISTRY,
)
KUBERNETES_MIRROR: Final = Counter(
    "dracap_kubernetes_mirror_decisions_total",
    "ResourceClaim changes the Kubernetes bridge recorded in the log, by outcome "
    "(mirrored, refused, released, reserved, withdrawn).",
    ["outcome"],
    registry=REGISTRY,
)
KUBERNETES_STATUS_WRITES: Final = Counter(
    "dracap_kubernetes_status_writes_total",
    "ResourceClaim status.devices writes the Kubernetes bridge made.",
    registry=REGISTRY,
)
KUBELET_CALL_DURATION: Final = Histogram(
    "dracap_kubelet_call_duration_seconds",
    "Time to answer a kubelet gRPC call on the DRA plugin sockets, by method (the kubelet "
    "gives up after 45 s).",
    ["method"],
    buckets=(*_LATENCY_BUCKETS, 5.0, 10.0, 20.0, 40.0),
    registry=REGISTRY,
)
KUBELET_CALLS: Final = Counter(
    "dracap_kubelet_calls_total",
    "Kubelet gRPC calls on the DRA plugin sockets, by method and outcome (ok, claim_error, "
    "deadline, refused, cancelled, error).",
    ["method", "outcome"],
    registry=REGISTRY,
)
REPLAN_FAILURES: Final = Counter(
    "dracap_reservation_replan_failures_total",
    "Planning rounds a reservation worker ran without a message (selectors evaluated in "
    "the pool, a trigger dead-lettered) that failed, the database or the bus away; each "
    "is tried again a second later.",
    registry=REGISTRY,
)
TAKE_UP_FAILURES: Final = Counter(
    "dracap_agent_take_up_failures_total",
    "Times a node agent could not carry out, from the log, its bound and releasing claims "
    "after its durable consumer was lost with their messages; the next reconcile (a new "
    "lease, a restart) does it.",
    registry=REGISTRY,
)
SNAPSHOTS_WRITTEN: Final = Counter(
    "dracap_snapshots_written_total",
    "Snapshots of the fold this process's snapshot writer stored.",
    registry=REGISTRY,
)
SNAPSHOT_FAILURES: Final = Counter(
    "dracap_snapshot_failures_total",
    "Snapshots this process's writer was due to store and could not (database, encoding); "
    "it tries again at its next check.",
    registry=REGISTRY,
)
SNAPSHOT_POSITION: Final = Gauge(
    "dracap_snapshot_position",
    "Log position of the newest snapshot this process's writer knows stored (read at its "
    "start, then each one it writes); a start folds the events after it.",
    registry=REGISTRY,
)
NODE_REQUESTS: Final = Counter(
    "dracap_node_requests_total",
    "Node agents' requests the enforcement service answered, by verb (lease, heartbeat, "
    "view, report) and outcome (ok, or the refusal's code: conflict, stale_epoch, "
    "forbidden, invalid, unavailable, internal).",
    ["verb", "outcome"],
    registry=REGISTRY,
)
LEASE_RENEWAL_STATEMENTS: Final = Counter(
    "dracap_lease_renewal_statements_total",
    "Statements the enforcement service sent to renew node leases: one per tick with "
    "heartbeats, whatever the number of nodes.",
    registry=REGISTRY,
)
LEASE_RENEWALS: Final = Counter(
    "dracap_lease_renewals_total",
    "Node lease renewals by outcome: held (extended by its ttl) or lost (expired, fenced "
    "or superseded).",
    ["outcome"],
    registry=REGISTRY,
)
EVENTS_REFUSED: Final = Counter(
    "dracap_events_refused_total",
    "Stored events this process's readers skipped because the fold refuses them, by reason "
    "(undecodable, invariant, error); each event counted once per process.",
    ["reason"],
    registry=REGISTRY,
)
LOG_DIVERGENCES: Final = Counter(
    "dracap_log_divergences_total",
    "Times one of this process's readers of the log (a live view, the relay) found events "
    "it had read gone from the log (a database failover lost commits it had seen) and read "
    "the log again from there.",
    registry=REGISTRY,
)
SNAPSHOT_CHECKS: Final = Counter(
    "dracap_snapshot_checks_total",
    "Background checks of the snapshot a live state started from against a fold from "
    "position 0, by outcome (verified, mismatch: the state was refolded; failed: the check "
    "could not finish and is tried again).",
    ["outcome"],
    registry=REGISTRY,
)
BUILD_INFO: Final = Gauge(
    "dracap_build_info",
    "Always 1; the label carries the running dracap version.",
    ["version"],
    registry=REGISTRY,
)


def version() -> str:
    """The installed dracap version (``0+unknown`` when running from a bare tree)."""
    try:
        return metadata.version("dracap")
    except metadata.PackageNotFoundError:
        return "0+unknown"


BUILD_INFO.labels(version=version()).set(1)


def add_metrics_arguments(parser: argparse.ArgumentParser, *, port: int, port_help: str) -> None:
    """``--metrics-port`` (default ``port``, 0: off) and ``--metrics-addr`` of a
    long-running command (``dracap up``, ``dracap agent``)."""
    parser.add_argument("--metrics-port", type=int, default=port, help=port_help)
    parser.add_argument(
        "--metrics-addr",
        default="127.0.0.1",
        metavar="ADDR",
        help="address the metrics endpoint binds (default 127.0.0.1; 0.0.0.0 for a scraper "
        "on another machine)",
    )


class MetricsPortError(SettingsError):
    """The metrics server cannot listen where it was told (a port in use): a setting to
    change, said in one line by the command, never a traceback."""


def start_metrics_server(port: int, addr: str = "0.0.0.0") -> tuple[WSGIServer, Thread]:
    """Serve :data:`REGISTRY` on ``http://addr:port/metrics`` (port 0: any free port).

    Returns the server (``server.server_port`` is the bound port; ``shutdown()``
    stops it) and its daemon thread. Paths other than ``/metrics`` and ``/`` are 404.
    :class:`MetricsPortError` when it cannot listen there.
    """
    try:
        server, thread = start_http_server(port, addr=addr, registry=REGISTRY)
    except OSError as exc:  # the port taken, or the address not this host's
        raise MetricsPortError(f"--metrics-port {port} on {addr}: {exc.strerror or exc}") from exc
    metrics = server.get_app()
    assert metrics is not None, "the metrics server has no application"
    server.set_app(only_metrics(metrics))
    return server, thread


#: The paths the metrics application answers.
METRICS_PATHS: Final = frozenset({"/metrics", "/"})


def only_metrics(metrics: WSGIApplication) -> WSGIApplication:
    """``metrics`` on :data:`METRICS_PATHS`, ``404 Not Found`` on any other path."""

    def app(environ: WSGIEnvironment, start_response: StartResponse) -> Iterable[bytes]:
        if environ.get("PATH_INFO") in METRICS_PATHS:
            return metrics(environ, start_response)
        return not_found(start_response)

    return app


def not_found(start_response: StartResponse) -> list[bytes]:
    """A plain ``404 Not Found`` answer."""
    body = b"not found: /metrics, /healthz and /readyz are served here\n"
    headers = [("Content-Type", "text/plain"), ("Content-Length", str(len(body)))]
    start_response("404 Not Found", headers)
    return [body]
