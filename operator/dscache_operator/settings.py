"""Operator configuration, read once from environment variables.

The Helm chart sets these; each field documents its variable.
"""

from __future__ import annotations

import dataclasses
import json
import os
import socket
from typing import Any

from .api.models import VolumeMode
from .version import package_version

# <cacheRoot>/<namespace>/<cache> is deleted by wipes, so cacheRoot must be a
# directory of dscache's own: under /var, a namespace "lib" and a cache
# "kubelet" would name /var/lib/kubelet. The Helm chart refuses the same list.
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
LOG_FORMATS = ("text", "json")
VOLUME_TYPES = ("csi", "hostPath")


def _choice(name: str, value: str, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise ValueError(f"{name}={value!r}: must be one of {', '.join(allowed)}")
    return value


SYSTEM_DIRS = frozenset(
    {
        "/",
        "/bin",
        "/boot",
        "/dev",
        "/etc",
        "/home",
        "/lib",
        "/lib32",
        "/lib64",
        "/media",
        "/mnt",
        "/opt",
        "/proc",
        "/root",
        "/run",
        "/sbin",
        "/srv",
        "/sys",
        "/tmp",
        "/usr",
        "/usr/local",
        "/var",
        "/var/lib",
        "/var/log",
        "/var/run",
        "/var/tmp",
    }
)


def _cache_root(value: str) -> str:
    root = value.rstrip("/") or "/"
    if not root.startswith("/"):
        raise ValueError(f"DSCACHE_CACHE_ROOT must be an absolute path, got {value!r}")
    if root in SYSTEM_DIRS:
        raise ValueError(
            f"DSCACHE_CACHE_ROOT={value!r} is a system directory: wipes delete "
            f"<cacheRoot>/<namespace>/<cache>, so use a directory dedicated to dscache, "
            f"e.g. /mnt/nvme/dscache or /var/lib/dscache"
        )
    return root


def _weight(text: str) -> int:
    weight = int(text)
    if not 1 <= weight <= 100:
        raise ValueError(f"DSCACHE_PLACEMENT_WEIGHT must be 1-100 (a node affinity weight), got {text!r}")
    return weight


def _csv(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


@dataclasses.dataclass(frozen=True)
class Settings:
    cache_root: str = "/var/lib/dscache"
    """``DSCACHE_CACHE_ROOT``: host directory under which node copies live, as
    ``<cacheRoot>/<namespace>/<cache name>``. Only the admin chooses it."""

    stager_image: str = dataclasses.field(default_factory=lambda: f"dscache-stager:{package_version()}")
    """``DSCACHE_STAGER_IMAGE``: image of the init container and of pre-stage pods
    (it provides ``dscache-stage``); default tag: the package version."""

    stager_pull_policy: str = "IfNotPresent"
    """``DSCACHE_STAGER_PULL_POLICY``: imagePullPolicy of injected/helper containers."""

    stager_resources: dict[str, Any] = dataclasses.field(
        default_factory=lambda: {"requests": {"cpu": "500m", "memory": "256Mi"}, "limits": {"memory": "1Gi"}}
    )
    """``DSCACHE_STAGER_RESOURCES``: JSON resources of the init container when
    the DatasetCache sets none."""

    stager_concurrency: int | None = None
    """``DSCACHE_STAGER_CONCURRENCY``: ``--concurrency`` of the stager (unset: its default)."""

    namespace: str = "dscache-system"
    """``DSCACHE_NAMESPACE``: the operator's own namespace (where its node agents run)."""

    watch_namespaces: tuple[str, ...] = ()
    """``DSCACHE_WATCH_NAMESPACES``: comma-separated namespaces to watch;
    empty means cluster-wide."""

    webhook_addr: str = "0.0.0.0"
    """``DSCACHE_WEBHOOK_ADDR``: address the webhook listens on."""

    webhook_port: int = 9443
    """``DSCACHE_WEBHOOK_PORT``: HTTPS port of the admission webhook."""

    webhook_cert: str | None = None
    """``DSCACHE_WEBHOOK_CERT``: PEM serving certificate (reloaded when it changes)."""

    webhook_key: str | None = None
    """``DSCACHE_WEBHOOK_KEY``: PEM private key of the serving certificate."""

    reconcile_interval: float = 10.0
    """``DSCACHE_RECONCILE_INTERVAL``: seconds between level-based
    reconciliations of each DatasetCache (consumers, node states, wipes); one whose
    inputs have not changed since a reconciliation that changed nothing is only
    checked for that (quiet.py)."""

    source_retry_interval: float = 60.0
    """``DSCACHE_SOURCE_RETRY_INTERVAL``: seconds before a failed source check is retried."""

    health_port: int = 8080
    """``DSCACHE_HEALTH_PORT``: port of the liveness endpoint (``/healthz``); 0 disables it."""

    metrics_port: int = 9090
    """``DSCACHE_METRICS_PORT``: port of the Prometheus endpoint (``/metrics``); 0 disables it."""

    agent_port: int = 9477
    """``DSCACHE_AGENT_PORT``: port of the node agents (``dscache-node``, host network): the
    controller sends wipes there, the stager asks it for room under the node's byte budget."""

    service_account: str = "dscache-controller"
    """``DSCACHE_SERVICE_ACCOUNT``: the controller's own ServiceAccount (in ``namespace``): it asks
    for a token of it per node (audience ``dscache-agent/<node>``) to call that node's agent."""

    agent_ca_file: str | None = None
    """``DSCACHE_AGENT_CA_FILE``: the CA (PEM) of the agents' serving certificate: the controller
    calls them over TLS, and the webhook gives it to the stagers (``DSCACHE_PEER_CA``). Unset:
    plain HTTP."""

    peers: bool = True
    """``DSCACHE_PEERS``: fetch once per cluster: the webhook gives the stager its pod's projected
    ServiceAccount token (audience ``dscache-peer``), which other nodes' agents check, and the
    stager takes objects other nodes hold or copy from their agents. ``false``: every node
    reads the bucket itself."""

    volume_type: str = "csi"
    """``DSCACHE_VOLUME_TYPE`` (chart value ``volume.type``): how pre-staging pods get the node's
    copy, as the webhook's injection entries do: ``csi`` (the node agents' driver
    cache.dscache.io) or ``hostPath``."""

    placement_weight: int = 80
    """``DSCACHE_PLACEMENT_WEIGHT``: weight (1-100) of the preferred node affinity the webhook
    adds toward nodes that hold a pod's revision."""

    image_pull_secrets: tuple[str, ...] = ()
    """``DSCACHE_IMAGE_PULL_SECRETS``: comma-separated names of pull secrets put on the
    pre-stage pods the controller creates (the chart's ``imagePullSecrets``). A pull secret
    works only in its own namespace and pre-stage pods run in the cache's: a Secret of that
    name must exist there (a missing one is skipped by the kubelet, with a warning Event)."""

    leader_election: bool = True
    """``DSCACHE_LEADER_ELECTION``: the controller reconciles only while it holds a Lease
    (``DSCACHE_LEASE_NAME`` in ``DSCACHE_NAMESPACE``), so that two replicas can run;
    ``false``: it reconciles at once, and exactly one replica may run."""

    lease_name: str = "dscache-controller"
    """``DSCACHE_LEASE_NAME``: name of the controller's leader-election Lease."""

    pod_name: str = dataclasses.field(default_factory=socket.gethostname)
    """``DSCACHE_POD_NAME``: this replica's identity in the Lease (the chart sets the pod's
    name; default: the host name, which in a pod is its name)."""

    sts_endpoint: str | None = None
    """``DSCACHE_STS_ENDPOINT`` (chart value ``podIdentity.stsEndpoint``): the STS that exchanges
    ServiceAccount tokens for S3 credentials (AssumeRoleWithWebIdentity), for caches with
    ``spec.source.serviceAccountName``: the controller's source check uses it, and injected stagers
    get it as ``AWS_ENDPOINT_URL_STS``. Unset: AWS's regional STS."""

    sts_audience: str = "sts.amazonaws.com"
    """``DSCACHE_STS_AUDIENCE`` (chart value ``podIdentity.audience``): the audience of the
    ServiceAccount tokens the controller requests and the stagers' projected tokens carry."""

    log_level: str = "INFO"
    """``DSCACHE_LOG_LEVEL``: DEBUG, INFO, WARNING or ERROR."""

    log_format: str = "text"
    """``DSCACHE_LOG_FORMAT``: ``text`` or ``json`` (kopf's own JSON formatter, one object per line)."""

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> Settings:
        env = dict(os.environ if env is None else env)
        d = cls()
        get = env.get

        def opt(name: str) -> str | None:
            value = get(name, "").strip()
            return value or None

        return cls(
            cache_root=_cache_root(opt("DSCACHE_CACHE_ROOT") or d.cache_root),
            stager_image=opt("DSCACHE_STAGER_IMAGE") or d.stager_image,
            stager_pull_policy=opt("DSCACHE_STAGER_PULL_POLICY") or d.stager_pull_policy,
            stager_resources=(
                json.loads(get("DSCACHE_STAGER_RESOURCES", ""))
                if opt("DSCACHE_STAGER_RESOURCES")
                else d.stager_resources
            ),
            stager_concurrency=int(get("DSCACHE_STAGER_CONCURRENCY", ""))
            if opt("DSCACHE_STAGER_CONCURRENCY")
            else None,
            namespace=opt("DSCACHE_NAMESPACE") or d.namespace,
            watch_namespaces=tuple(_csv(get("DSCACHE_WATCH_NAMESPACES", ""))),
            webhook_addr=opt("DSCACHE_WEBHOOK_ADDR") or d.webhook_addr,
            webhook_port=int(opt("DSCACHE_WEBHOOK_PORT") or d.webhook_port),
            webhook_cert=opt("DSCACHE_WEBHOOK_CERT"),
            webhook_key=opt("DSCACHE_WEBHOOK_KEY"),
            reconcile_interval=float(opt("DSCACHE_RECONCILE_INTERVAL") or d.reconcile_interval),
            source_retry_interval=float(opt("DSCACHE_SOURCE_RETRY_INTERVAL") or d.source_retry_interval),
            health_port=int(opt("DSCACHE_HEALTH_PORT") or d.health_port),
            metrics_port=int(opt("DSCACHE_METRICS_PORT") or d.metrics_port),
            agent_port=int(opt("DSCACHE_AGENT_PORT") or d.agent_port),
            service_account=opt("DSCACHE_SERVICE_ACCOUNT") or d.service_account,
            agent_ca_file=opt("DSCACHE_AGENT_CA_FILE"),
            peers=(opt("DSCACHE_PEERS") or "true").lower() not in ("false", "0", "no"),
            volume_type=_choice("DSCACHE_VOLUME_TYPE", opt("DSCACHE_VOLUME_TYPE") or d.volume_type, VOLUME_TYPES),
            placement_weight=_weight(opt("DSCACHE_PLACEMENT_WEIGHT") or str(d.placement_weight)),
            image_pull_secrets=tuple(_csv(get("DSCACHE_IMAGE_PULL_SECRETS", ""))),
            leader_election=(opt("DSCACHE_LEADER_ELECTION") or "true").lower() not in ("false", "0", "no"),
            lease_name=opt("DSCACHE_LEASE_NAME") or d.lease_name,
            pod_name=opt("DSCACHE_POD_NAME") or d.pod_name,
            sts_endpoint=opt("DSCACHE_STS_ENDPOINT"),
            sts_audience=opt("DSCACHE_STS_AUDIENCE") or d.sts_audience,
            log_level=_choice("DSCACHE_LOG_LEVEL", (opt("DSCACHE_LOG_LEVEL") or d.log_level).upper(), LOG_LEVELS),
            log_format=_choice("DSCACHE_LOG_FORMAT", (opt("DSCACHE_LOG_FORMAT") or d.log_format).lower(), LOG_FORMATS),
        )

    @property
    def node_mode(self) -> VolumeMode:
        """The mode of a node copy's volume (volume_type)."""
        return VolumeMode.CSI if self.volume_type == "csi" else VolumeMode.HOST_PATH

    def cache_dir(self, namespace: str, name: str) -> str:
        """Host directory of one cache's node copy."""
        return f"{self.cache_root.rstrip('/')}/{namespace}/{name}"
