"""``dracap agent --node NAME``: run the node agent of one node.

The agent talks only to NATS: it has no database login and takes no database URL. It
pulls the events addressed to its node from its durable consumer (which the
enforcement service creates) and asks the enforcement service (``dracap serve
enforcement``, also inside ``dracap up``) for views of the log and to append its
reports, until SIGINT or SIGTERM (see :mod:`services.enforcement.agent`). The server is
found like every command finds it (:mod:`services.runtime.bus.endpoints`): ``--nats``, else
``DRACAP_NATS_URL``, else ``<data-dir>/connection.json`` of ``dracap up``; one that
cannot be reached at start is one line and exit 1. With ``--config`` (an agent
configuration, ``deploy/agent-config.example.yaml``) the node's devices are discovered
at start and every ``--scan-interval`` seconds and published as ResourceSlices;
``--enforcer tc`` takes each device's interface from its ``ifName`` attribute and
``--enforcer mps`` each GPU's UUID, so both need ``--config``; ``--tc-backend`` says how
the tc enforcer talks to the kernel (``netlink``, the default, or ``tc`` processes).
``--enforcer none`` (the default) applies no limit and reports enforcement level
``none``. The agent writes only under its node's lease (``--lease-ttl``, a heartbeat
every third of it; ``docs/reclamation.md``). ``--checkpoint PATH`` is the durable record
of what the agent applied (``none``: keep none); on start the agent reconciles it with the
kernel and the log. Its metrics port (``--metrics-port``, default 9401) serves
``/metrics``, ``/healthz`` and ``/readyz``: ready while NATS answers and its consumer pulls
(:mod:`services.runtime.ops.health`).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final

from events.subjects import BusNames, SubjectError
from services.enforcement import checkpointing
from services.enforcement.agent import Agent
from services.enforcement.cdi import DEFAULT_SPEC_DIR, CdiSpecs
from services.enforcement.discovery import AgentConfig, ConfigError, ScanResult, load_config
from services.enforcement.enforcers import Enforcer, NoneEnforcer
from services.enforcement.leasing import DEFAULT_TTL_S
from services.enforcement.mps import MpsEnforcer, MpsSettings
from services.enforcement.scanning import InventoryScanner, gpu_uuids_of, interfaces_of
from services.enforcement.tc import BACKENDS, TcEnforcer
from services.exitcodes import CommandError, ExitCode
from services.runtime.bus.credentials import AUTH_DIR, AuthDir, Credential
from services.runtime.bus.endpoints import (
    Endpoints,
    add_endpoint_arguments,
    endpoints_from_args,
)
from services.runtime.ground.context import ServiceContext
from services.runtime.ground.metrics import add_metrics_arguments
from services.runtime.ground.printable import printable
from services.runtime.hosting.process import hosting, run_service
from services.runtime.ops.health import HealthMonitor, consumers_probe

ENFORCERS: Final = ("none", "tc", "mps")
DEFAULT_CHECKPOINT: Final = "/var/lib/dracap/agent/{node}.checkpoint.json"

log = logging.getLogger("dracap.agent")


def build_enforcer(args: argparse.Namespace, config: AgentConfig | None) -> Enforcer:
    """The enforcer ``--enforcer`` names; its device map is filled by each scan."""
    if args.enforcer == "none":
        return NoneEnforcer()
    if config is None:
        raise ConfigError("--config", f"--enforcer {args.enforcer} needs the agent config")
    if args.enforcer == "tc":
        return TcEnforcer({}, default_rate=args.tc_default_rate, backend=args.tc_backend)
    return MpsEnforcer(
        {}, cdi=CdiSpecs(Path(args.cdi_dir)), settings=MpsSettings(root=Path(args.mps_root))
    )


def device_maps(config: AgentConfig, enforcer: Enforcer) -> Callable[[ScanResult], None]:
    """A scan listener that gives the enforcer the devices the scan found."""

    def update(inventory: ScanResult) -> None:
        if isinstance(enforcer, TcEnforcer):
            enforcer.interfaces = interfaces_of(config, inventory)
        elif isinstance(enforcer, MpsEnforcer):
            enforcer.gpus = gpu_uuids_of(config, inventory)

    return update


def _login(args: argparse.Namespace, endpoints: Endpoints) -> Credential | None:
    """The agent's NATS login: ``--creds`` / ``DRACAP_NATS_CREDS``, else its node's file
    in ``<data-dir>/auth`` (never the operator's of ``connection.json``), else none."""
    if args.creds or os.environ.get("DRACAP_NATS_CREDS"):
        return endpoints.credential()
    auth = AuthDir(Path(args.data_dir) / AUTH_DIR)
    return auth.agent(args.node) if auth.has_agent(args.node) else None


async def serve(args: argparse.Namespace) -> int:
    """Run the agent until a signal arrives."""
    credential = _login(args, endpoints_from_args(args))
    async with hosting(
        args, "agent", nats=True, credential=credential, client_name=f"dracap-agent-{args.node}"
    ) as context:
        await _run_agent(args, context.service_context(None), context.health, context.stop)
    return ExitCode.OK


async def _run_agent(
    args: argparse.Namespace,
    context: ServiceContext[None],
    health: HealthMonitor,
    stop: asyncio.Event,
) -> None:
    """Build the agent, register its consumer's check, run it until ``stop``."""
    config = load_config(args.config, args.node) if args.config else None
    enforcer = build_enforcer(args, config)
    checkpoint = None
    if args.checkpoint != "none":
        path = Path(args.checkpoint or DEFAULT_CHECKPOINT.format(node=args.node))
        checkpoint = await asyncio.to_thread(checkpointing.load, path)
    agent = Agent(
        context,
        node=args.node,
        enforcer=enforcer,
        checkpoint=checkpoint,
        scan_interval=args.scan_interval,
        lease_ttl=args.lease_ttl,
        boot_id=args.boot_id,
        health_interval=args.health_interval,
    )
    if config is not None:
        agent.scanner = InventoryScanner(
            config,
            previous=agent.node_slices,
            publish=agent.publish,
            listeners=[device_maps(config, enforcer)],
        )
    health.register("consumers", consumers_probe(lambda: [agent.consumer]))
    log.info("agent of node %s started (enforcer %s)", args.node, args.enforcer)
    if args.kubelet_plugin:
        await _run_with_kubelet(args, agent, config, stop)
    else:
        await agent.run(stop)


def _drivers(args: argparse.Namespace, config: AgentConfig | None) -> list[str]:
    """``--driver`` names, else the enabled drivers of the config."""
    if args.driver:
        return sorted(set(args.driver))
    if config is not None:
        return sorted({c.driver for c in (config.network, config.gpu) if c.enabled})
    raise CommandError(
        "--kubelet-plugin needs --driver NAME or a --config that enables a driver",
        ExitCode.BAD_INPUT,
    )


async def _run_with_kubelet(
    args: argparse.Namespace, agent: Agent, config: AgentConfig | None, stop: asyncio.Event
) -> None:
    """The agent, its kubelet plugins and its slices on the API server, until ``stop``."""
    # gRPC's fork handlers log a line at every enforcer subprocess (tc) while its threads
    # run; the agent never forks a process that uses gRPC, so they are not needed
    os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
    from services.enforcement.kubernetes import run_kubernetes_mode
    from services.runtime.kube.client import KubeApi
    from services.runtime.kube.errors import KubeApiError

    drivers = _drivers(args, config)
    try:
        api = await KubeApi.from_environment(kubeconfig=args.kubeconfig)
    except KubeApiError as exc:
        raise CommandError(f"Kubernetes API: {exc}", ExitCode.BAD_INPUT) from exc
    async with api:
        side = asyncio.create_task(
            run_kubernetes_mode(
                agent,
                api,
                stop,
                drivers=drivers,
                registration_dir=Path(args.kubelet_registration_dir),
                plugins_dir=Path(args.kubelet_plugins_dir),
                cdi=CdiSpecs(Path(args.cdi_dir)),
            )
        )
        try:
            await agent.run(stop)
        finally:
            stop.set()
            await side


def run(args: argparse.Namespace) -> int:
    """Entry point of ``dracap agent``."""
    if args.lease_ttl <= 0.3:
        print("error: --lease-ttl must be more than 0.3 seconds", file=sys.stderr)
        return ExitCode.BAD_INPUT
    try:
        BusNames(endpoints_from_args(args).prefix).node_filter(args.node)
    except SubjectError as exc:
        print(f"error: {printable(str(exc))}", file=sys.stderr)
        return ExitCode.BAD_INPUT
    return run_service(lambda: serve(args), bad_input=(ConfigError,))


def register(sub: Any) -> None:
    """Add ``dracap agent`` to the command line."""
    parser = sub.add_parser(
        "agent",
        help="run the node agent of one node (applies and removes share limits)",
        description=__doc__.split("\n\n")[1] if __doc__ else None,
    )
    parser.add_argument("--node", required=True, help="the node this agent runs on")
    add_endpoint_arguments(parser, nats=True)
    parser.add_argument(
        "--enforcer",
        choices=ENFORCERS,
        default="none",
        help="how limits are made real: none (report level none), tc (bandwidth, HTB), "
        "mps (GPU memory, CUDA MPS); tc and mps need --config",
    )
    parser.add_argument(
        "--config", metavar="FILE", help="agent config (discovery, pools, sharing rules)"
    )
    parser.add_argument(
        "--scan-interval",
        type=float,
        default=60.0,
        metavar="S",
        help="seconds between inventory scans (default 60; 0: only at start)",
    )
    parser.add_argument(
        "--checkpoint",
        metavar="PATH",
        help=f"durable record of applied limits (default {DEFAULT_CHECKPOINT}; none: off)",
    )
    parser.add_argument(
        "--tc-default-rate",
        type=int,
        default=10 * 10**9,
        metavar="BIT/S",
        help="rate of the unclassified traffic's HTB class (default 10G)",
    )
    parser.add_argument(
        "--tc-backend",
        choices=BACKENDS,
        default="netlink",
        help="how --enforcer tc talks to the kernel: netlink (default: rtnetlink requests, "
        "no process) or tc (a tc process per request); both put the same classes and filters",
    )
    parser.add_argument(
        "--lease-ttl",
        type=float,
        default=DEFAULT_TTL_S,
        metavar="S",
        help=f"the node lease's time to live, renewed by a heartbeat every third of it "
        f"(default {DEFAULT_TTL_S:g})",
    )
    parser.add_argument(
        "--health-interval",
        type=float,
        default=10.0,
        metavar="S",
        help="seconds between device health checks: the enforcer's read-back and the last "
        "scan (default 10; 0: none)",
    )
    parser.add_argument(
        "--boot-id",
        help="the boot id the lease records (default: the kernel's; for containers whose "
        "/proc is not the node's, and for tests)",
    )
    parser.add_argument("--cdi-dir", default=str(DEFAULT_SPEC_DIR), help="CDI spec directory")
    kube = parser.add_argument_group("Kubernetes mode (docs/kubernetes.md)")
    kube.add_argument(
        "--kubelet-plugin",
        action="store_true",
        help="serve the kubelet's DRA plugin API and publish this node's ResourceSlices: "
        "limits of claims kube-scheduler allocated are applied when the kubelet prepares them",
    )
    kube.add_argument(
        "--driver",
        action="append",
        default=[],
        metavar="NAME",
        help="a DRA driver name to serve (repeatable; default: the config's drivers)",
    )
    kube.add_argument(
        "--kubeconfig",
        metavar="FILE",
        help="the kubeconfig (default: in-cluster, else $KUBECONFIG, else ~/.kube/config)",
    )
    kube.add_argument(
        "--kubelet-registration-dir",
        default="/var/lib/kubelet/plugins_registry",
        metavar="DIR",
        help="where the kubelet watches for plugin registration sockets",
    )
    kube.add_argument(
        "--kubelet-plugins-dir",
        default="/var/lib/kubelet/plugins",
        metavar="DIR",
        help="where each driver's service socket goes (<dir>/<driver>/dra.sock)",
    )
    parser.add_argument("--mps-root", default="/run/dracap/mps", help="MPS daemons' root")
    add_metrics_arguments(
        parser,
        port=9401,
        port_help="Prometheus port (0: off; default 9401, beside dracap up's 9400)",
    )
    parser.set_defaults(func=run)
