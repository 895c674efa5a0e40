"""The agent's configuration, from its environment (the chart's DaemonSet sets it)."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from dscache_contract import AGENT_PORT
from dscache_stager.switches import flag

_QUANTITY = re.compile(r"^([0-9]+(?:\.[0-9]+)?)(Ki|Mi|Gi|Ti|Pi|k|M|G|T|P)?$")
_UNITS = {
    None: 1,
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "P": 10**15,
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
    "Pi": 2**50,
}


@dataclass(frozen=True)
class Size:
    """A byte count, or a share of the cacheRoot filesystem ("80%")."""

    bytes: int | None = None
    percent: float | None = None

    @classmethod
    def parse(cls, name: str, text: str) -> Size:
        text = text.strip()
        if text.endswith("%"):
            pct = float(text[:-1])
            if not 0 <= pct <= 100:
                raise ValueError(f"{name}={text!r}: a percentage must be 0-100%")
            return cls(percent=pct)
        m = _QUANTITY.match(text)
        if not m:
            raise ValueError(
                f"{name}={text!r} is neither a byte quantity (500Gi, 2T, 1073741824) nor a percentage (80%)"
            )
        return cls(bytes=int(float(m.group(1)) * _UNITS[m.group(2)]))

    def of(self, fs_size: int) -> int:
        return self.bytes if self.bytes is not None else int(fs_size * (self.percent or 0) / 100)


@dataclass(frozen=True)
class AgentSettings:
    node: str
    cache_root: str
    namespace: str = "dscache-system"
    port: int = AGENT_PORT
    #: The controller's ServiceAccount (in ``namespace``): the only caller whose wipes are taken.
    controller_service_account: str = "dscache-controller"
    #: The serving certificate and key (PEM files): TLS on the agent's port; unset: plain HTTP.
    tls_cert: str | None = None
    tls_key: str | None = None
    #: The most bytes all copies under cacheRoot may take together.
    budget: Size = Size(percent=80.0)
    #: Free space always left on the cacheRoot filesystem (the kubelet's DiskPressure
    #: threshold is nodefs.available < 10% by default).
    headroom: Size = Size(percent=15.0)
    max_labels: int = 16
    #: Seconds between two reads of the disk (a wipe or a reservation also triggers one).
    scan_interval: float = 5.0
    #: A lease whose pod the agent has never seen is released only once it is this old
    #: (a pod that just started staging may not be in the agent's view yet).
    unknown_lease_grace: float = 120.0
    log_level: str = "INFO"
    #: Serve the CSI driver cache.dscache.io (chart value volume.type: csi), under the kubelet's directory.
    csi: bool = False
    kubelet_dir: str = "/var/lib/kubelet"
    #: The uid the webhook runs stagers as: a published cache dir is theirs to write (contract.csi).
    stager_uid: int = 65532
    #: The release, as the CSI driver reports it (GetPluginInfo's vendor_version).
    version: str = "dev"
    #: Verify callers' ServiceAccount tokens here, against the API server's published keys (auth.py,
    #: jwks.py; issue 30). False (DSCACHE_LOCAL_TOKEN_CHECK=false): every token by TokenReview, as
    #: before, which also checks that the ServiceAccount still exists, at one call per token and agent.
    local_token_check: bool = True

    @property
    def controller_user(self) -> str:
        return f"system:serviceaccount:{self.namespace}:{self.controller_service_account}"

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> AgentSettings:
        env = dict(os.environ if env is None else env)
        d = cls(node="", cache_root="")
        node = env.get("DSCACHE_NODE_NAME", "").strip()
        if not node:
            raise ValueError("DSCACHE_NODE_NAME is not set: the DaemonSet sets it from spec.nodeName")
        root = env.get("DSCACHE_CACHE_ROOT", "").rstrip("/")
        if not root.startswith("/"):
            raise ValueError(f"DSCACHE_CACHE_ROOT must be an absolute path, got {root!r}")
        return cls(
            node=node,
            cache_root=root,
            namespace=env.get("DSCACHE_NAMESPACE") or d.namespace,
            port=int(env.get("DSCACHE_AGENT_PORT") or d.port),
            controller_service_account=env.get("DSCACHE_CONTROLLER_SERVICE_ACCOUNT") or d.controller_service_account,
            tls_cert=env.get("DSCACHE_AGENT_TLS_CERT") or None,
            tls_key=env.get("DSCACHE_AGENT_TLS_KEY") or None,
            budget=Size.parse("DSCACHE_NODE_BUDGET", env["DSCACHE_NODE_BUDGET"])
            if env.get("DSCACHE_NODE_BUDGET")
            else d.budget,
            headroom=Size.parse("DSCACHE_NODE_HEADROOM", env["DSCACHE_NODE_HEADROOM"])
            if env.get("DSCACHE_NODE_HEADROOM")
            else d.headroom,
            max_labels=int(env.get("DSCACHE_NODE_MAX_LABELS") or d.max_labels),
            scan_interval=float(env.get("DSCACHE_NODE_SCAN_INTERVAL") or d.scan_interval),
            unknown_lease_grace=float(env.get("DSCACHE_NODE_UNKNOWN_LEASE_GRACE") or d.unknown_lease_grace),
            log_level=(env.get("DSCACHE_LOG_LEVEL") or d.log_level).upper(),
            csi=flag(env.get("DSCACHE_CSI"), False),
            kubelet_dir=(env.get("DSCACHE_KUBELET_DIR") or d.kubelet_dir).rstrip("/"),
            stager_uid=int(env.get("DSCACHE_STAGER_UID") or d.stager_uid),
            version=env.get("DSCACHE_VERSION") or d.version,
            local_token_check=flag(env.get("DSCACHE_LOCAL_TOKEN_CHECK"), True),
        )
