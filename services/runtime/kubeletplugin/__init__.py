"""The kubelet side of a DRA driver: a gRPC transport around a driver handler.

A driver's node logic implements :class:`DriverHandler` (and optionally
:class:`HealthReporting`) on plain msgspec values; :class:`KubeletPlugin` serves it to
the kubelet (Kubernetes 1.34): plugin registration, the DRA service v1 and device
health v1alpha1, over Unix sockets. The modules:

* :mod:`.contract` — the values and the handler protocols;
* :mod:`.serving` — :class:`KubeletPlugin`, its sockets and servers;
* :mod:`.calling` — one call answered for every claim (isolation, deadline);
* :mod:`.healthfeed` — the latest health list fanned out to every watcher;
* :mod:`.wire` — protobuf to values and back; :mod:`.sockets` — socket paths;
* :mod:`.metering` — the two metrics; :mod:`.errors` — the typed errors.

:mod:`tests.fixtures.kubeletclient` is the kubelet's side, for tests and benchmarks.
See ``docs/kubelet-plugin.md``.
"""

from services.runtime.kubeletplugin.contract import (
    ClaimRef,
    DeviceHealthReport,
    DriverHandler,
    Health,
    HealthReporting,
    PreparedDevice,
    PrepareResult,
)
from services.runtime.kubeletplugin.errors import (
    ClaimFailure,
    DeadlineExceeded,
    HandlerRaised,
    KubeletPluginError,
    PluginCallFailed,
    PluginConfigError,
    PluginUnavailable,
    RegistrationRefused,
    ResultMissing,
    SocketPathTooLong,
)
from services.runtime.kubeletplugin.serving import (
    DEFAULT_CALL_TIMEOUT_S,
    DEFAULT_PLUGINS_DIR,
    DEFAULT_REGISTRATION_DIR,
    KUBELET_CALL_TIMEOUT_S,
    KubeletPlugin,
)

__all__ = [
    "DEFAULT_CALL_TIMEOUT_S",
    "DEFAULT_PLUGINS_DIR",
    "DEFAULT_REGISTRATION_DIR",
    "KUBELET_CALL_TIMEOUT_S",
    "ClaimFailure",
    "ClaimRef",
    "DeadlineExceeded",
    "DeviceHealthReport",
    "DriverHandler",
    "HandlerRaised",
    "Health",
    "HealthReporting",
    "KubeletPlugin",
    "KubeletPluginError",
    "PluginCallFailed",
    "PluginConfigError",
    "PluginUnavailable",
    "PrepareResult",
    "PreparedDevice",
    "RegistrationRefused",
    "ResultMissing",
    "SocketPathTooLong",
]
