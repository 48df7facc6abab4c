"""The Kubernetes API side of dracap as a DRA driver: client, claim informer, slice sync.

* :mod:`~services.runtime.kube.client` — :class:`KubeApi`, a typed client of
  ``resource.k8s.io/v1`` ResourceClaims and ResourceSlices (kubeconfig, in-cluster, or a
  URL and token);
* :mod:`~services.runtime.kube.informer` — :class:`ClaimInformer`, list + watch with a
  cache, resumption and exactly-once events across 410 Gone;
* :mod:`~services.runtime.kube.slices` — :func:`sync_slices`, a node's pool on the server;
* :mod:`~services.runtime.kube.errors` — the typed errors.

Tests run all of it against ``tests/fixtures/k8s_standin.py``, a stand-in API server.
"""

from services.runtime.kube.client import Bookmark, ConfigError, KubeApi, Listed, WatchEvent
from services.runtime.kube.errors import (
    AlreadyExists,
    Conflict,
    Gone,
    Invalid,
    KubeApiError,
    NotFound,
    Permanent,
    Retryable,
)
from services.runtime.kube.informer import Checkpoint, ClaimEvent, ClaimInformer
from services.runtime.kube.slices import SliceSync, sync_slices

__all__ = [
    "AlreadyExists",
    "Bookmark",
    "Checkpoint",
    "ClaimEvent",
    "ClaimInformer",
    "ConfigError",
    "Conflict",
    "Gone",
    "Invalid",
    "KubeApi",
    "KubeApiError",
    "Listed",
    "NotFound",
    "Permanent",
    "Retryable",
    "SliceSync",
    "WatchEvent",
    "sync_slices",
]
