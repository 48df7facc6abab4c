"""The production overlay's NATS configuration, run: three nats-servers form one
JetStream cluster with dracap's accounts, and the relay's credential keeps the events
stream on all three (deploy/kubernetes/overlays/production/nats.yaml).

The ConfigMap's ``nats.conf`` is run as it is but for what only a Kubernetes cluster
gives: each pod's address (here 127.0.0.2 to 127.0.0.4, on the manifests' own ports),
the peers' DNS names (``nats-<i>.nats-cluster``, here those addresses), the volume and
the pid directory (here temporary directories); every one of these substitutions must
find its text, so a changed configuration fails here rather than being run half
rewritten. Each server gets the ``SERVER_NAME`` the StatefulSet gives it (its pod's
name) and an ``accounts.conf`` of ``dracap auth init`` beside the configuration, as
the projected volume puts it. Waits on the servers' own health, never on time.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from nats.js.api import StreamInfo
from nats.js.client import JetStreamContext

from events.quantities import parse_quantity
from events.subjects import BusNames
from services.brokerauth import Installation, init_auth
from services.runtime.bus.credentials import ACCOUNTS, AuthDir, read_credential
from services.runtime.bus.jetstream import connect_bus, ensure_stream
from services.runtime.ground.errors import RetryableError
from tests.fixtures.replicas import nats_binary
from tests.unit.test_kubernetes_manifests import _one, _rendered

pytestmark = pytest.mark.skipif(nats_binary() is None, reason="no nats-server binary")

START_TIMEOUT_S = 60.0
SERVERS = 3


def _address(index: int) -> str:
    return f"127.0.0.{index + 2}"


def _replace(text: str, old: str, new: str) -> str:
    assert old in text, f"nats.conf no longer has {old!r}: update this test"
    return text.replace(old, new)


def _config_for(template: str, index: int, root: Path) -> str:
    """The ConfigMap's nats.conf for server ``index`` on loopback (module docstring)."""
    text = template
    for peer in range(SERVERS):
        text = _replace(text, f"nats-{peer}.nats-cluster:", f"{_address(peer)}:")
    text = _replace(text, "listen: 0.0.0.0:", f"listen: {_address(index)}:")
    text = _replace(text, "http: 0.0.0.0:", f"http: {_address(index)}:")
    text = _replace(text, "store_dir: /data", f'store_dir: "{root / "data"}"')
    return _replace(text, "/var/run/nats/nats.pid", str(root / "nats.pid"))


def _monitor(index: int, path: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://{_address(index)}:8222/{path}", timeout=1.0) as reply:
        found: dict[str, Any] = json.load(reply)
        return found


def _healthy(index: int) -> bool:
    """JetStream up and the cluster's meta leader known (until then no stream is placed)."""
    try:
        if _monitor(index, "healthz").get("status") != "ok":
            return False
        meta = _monitor(index, "jsz").get("meta_cluster")
        return isinstance(meta, dict) and bool(meta.get("leader"))
    except (OSError, ValueError):
        return False


@contextlib.contextmanager
def _servers(tmp_path: Path, auth: AuthDir) -> Iterator[None]:
    binary = nats_binary()
    assert binary is not None
    template = _one(_rendered("production"), "ConfigMap", "nats-config")["data"]["nats.conf"]
    processes: list[subprocess.Popen[bytes]] = []
    try:
        for index in range(SERVERS):
            root = tmp_path / f"nats-{index}"
            (root / "data").mkdir(parents=True)
            (root / "nats.conf").write_text(_config_for(template, index, root))
            shutil.copy(auth.accounts, root / "accounts.conf")
            log = (root / "nats.log").open("wb")
            processes.append(
                subprocess.Popen(
                    [str(binary), "--config", str(root / "nats.conf")],
                    stdout=log,
                    stderr=log,
                    env={**os.environ, "SERVER_NAME": f"nats-{index}"},
                    start_new_session=True,
                )
            )
            log.close()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not all(_healthy(i) for i in range(SERVERS)):
            assert all(p.poll() is None for p in processes), f"a server exited: see {tmp_path}"
            assert time.monotonic() < deadline, f"no JetStream cluster: see {tmp_path}"
            time.sleep(0.1)
        yield
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            try:
                process.wait(15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


async def _ensure_stream_of_three(js: JetStreamContext) -> StreamInfo:
    """The events stream on three servers, asked again after a retryable failure, as
    the relay's keeper does: a young cluster can take longer than one request's timeout
    to place a stream's first raft group when the machine is busy."""
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        try:
            return await ensure_stream(js, BusNames(), replicas=SERVERS)
        except RetryableError:
            if time.monotonic() > deadline:
                raise


async def test_the_production_nats_configuration_forms_a_jetstream_cluster_of_three(
    tmp_path: Path,
) -> None:
    auth = AuthDir(tmp_path / "auth")
    principals = init_auth(auth, Installation(namespaces={"tenant-a": ["alice"]}, nodes=["n1"]))
    sts = _one(_rendered("production"), "StatefulSet", "nats")
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    volume = parse_quantity(claim["spec"]["resources"]["requests"]["storage"]).nanos // 10**9
    with _servers(tmp_path, auth):
        for index in range(SERVERS):
            varz = _monitor(index, "varz")
            assert varz["server_name"] == f"nats-{index}"
            assert varz["cluster"]["name"] == "dracap"
            assert 0 < varz["jetstream"]["config"]["max_storage"] < volume
            routes = _monitor(index, "routez")["routes"]
            peers = {route["remote_name"] for route in routes}
            assert peers == {f"nats-{i}" for i in range(SERVERS) if i != index}
        (relay,) = [p for p in principals if p.account == ACCOUNTS["relay"]]
        credential = read_credential(auth.creds_path(relay))
        servers = ",".join(f"nats://{_address(i)}:4222" for i in range(SERVERS))
        nc, js = await connect_bus(servers, credential=credential)
        try:
            info = await _ensure_stream_of_three(js)
            assert info.config.num_replicas == SERVERS
            assert info.cluster is not None and info.cluster.name == "dracap"
            placed = {info.cluster.leader} | {r.name for r in info.cluster.replicas or []}
            assert placed == {f"nats-{i}" for i in range(SERVERS)}
        finally:
            await nc.close()
