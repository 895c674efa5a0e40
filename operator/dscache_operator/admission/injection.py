"""What the webhook adds to a pod spec: pure functions, no I/O.

The pod layout (names and paths from dscache_contract, shared with the stager):
- volume ``dscache-data``: the node's cache dir C, as an inline CSI volume of the node
  agent's driver (contract.csi: publishing it takes the pod's lease on the revision,
  unpublishing releases it) or a hostPath (DirectoryOrCreate); or an emptyDir with the
  same layout inside;
- the stager init container, FIRST of all init containers, mounts C read-write
  at /dscache and runs ``StageArgs(...).to_argv()``: the pinned revision and, with a
  hostPath, this pod's UID (downward API) for the lease it writes itself;
- every training container mounts ``revs/<rev>/data`` read-only at
  spec.mountPath (so a directory walk of DSCACHE_DIR sees the dataset and
  nothing else) and ``revs/<rev>/meta`` read-only at /var/run/dscache, where
  DSCACHE_MANIFEST points;
- any other mount of ``dscache-data`` (a user's own, in a container or an init
  container) is forced read-only and, without a subPath, narrowed to the
  revision's data: only the stager may write the node's copy, so no pod can
  poison it for the next Job or make a wipe fail.

Every step is idempotent (keyed by our fixed names), so a reinvocation or a
Job's pod passing through the webhook again never injects twice.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import os
import posixpath
from typing import Any

import dscache_contract as contract
from dscache_contract import (
    ANNOTATION_CACHE,
    ENV_DIR,
    ENV_MANIFEST,
    ENV_POD_UID,
    ENV_REVISION,
    LABEL_CONSUMER,
    META_MOUNT_PATH,
    POD_UID_ARG,
    STAGE_MOUNT_PATH,
    STAGER_COMMAND,
    STAGER_CONTAINER_NAME,
    TERMINATION_LOG,
    VOLUME_NAME,
    RevisionRef,
    csi,
)
from dscache_contract.peers import (
    PEER_AUDIENCE,
    PEER_CA_ENV,
    PEER_TOKEN_DIR,
    PEER_TOKEN_EXPIRY_S,
    PEER_TOKEN_FILE,
    PEER_TOKEN_KEY,
    PEER_VOLUME_NAME,
)

from ..api.models import MODE_ANNOTATION, NODE_MODES, DatasetCacheSpec, VolumeMode
from ..settings import Settings
from .cohort import starts_together

NONROOT_UID = 65532


#: The key of our volume's source in a pod spec -> the mode it was injected with.
INJECTED_AS = {"csi": VolumeMode.CSI, "hostPath": VolumeMode.HOST_PATH, "emptyDir": VolumeMode.EMPTY_DIR}


class InjectionError(Exception):
    """The pod cannot get the cache; the message names the cache and the fix."""


#: The stager's own projected ServiceAccount token (pod identity), and where it reads it.
WEB_IDENTITY_VOLUME = "dscache-web-identity"
WEB_IDENTITY_DIR = "/var/run/secrets/dscache.io/web-identity"
WEB_IDENTITY_FILE = f"{WEB_IDENTITY_DIR}/token"
#: Its lifetime; the kubelet renews a projected token at 80% of it.
WEB_IDENTITY_SECONDS = 3600


@dataclasses.dataclass(frozen=True)
class WebIdentity:
    """What the stager of a pod-identity cache needs to be its pod (IRSA's variables, which
    boto3 and obstore's boto3 provider read): the role of the pod's own ServiceAccount, the
    audience of the token the kubelet projects for it, and the STS to exchange it at.

    dscache mounts its own token rather than copying EKS's webhook's: that webhook injects pods,
    not Jobs' templates, and clusters without it (or with another STS) get the same stager."""

    role_arn: str
    audience: str
    sts_endpoint: str | None = None

    def env(self) -> list[dict[str, Any]]:
        env = [
            {"name": "AWS_ROLE_ARN", "value": self.role_arn},
            {"name": "AWS_WEB_IDENTITY_TOKEN_FILE", "value": WEB_IDENTITY_FILE},
        ]
        if self.sts_endpoint:
            env.append({"name": "AWS_ENDPOINT_URL_STS", "value": self.sts_endpoint})
        return env

    def volume(self) -> dict[str, Any]:
        # 0444: the stager of a CSI volume runs as NONROOT_UID and the kubelet writes the file
        # root-owned; only the stager mounts this volume.
        token = {"audience": self.audience, "expirationSeconds": WEB_IDENTITY_SECONDS, "path": "token"}
        return {
            "name": WEB_IDENTITY_VOLUME,
            "projected": {"defaultMode": 0o444, "sources": [{"serviceAccountToken": token}]},
        }


def manifest_path(mount_path: str | None = None) -> str:
    """DSCACHE_MANIFEST: in the revision's meta dir, outside DSCACHE_DIR."""
    return contract.manifest_env_value()


def _norm(path: str) -> str:
    return posixpath.normpath(path) if path else path


def stage_args(
    spec: DatasetCacheSpec,
    settings: Settings,
    revision: RevisionRef,
    cache: str | None = None,
    nbytes: int | None = None,
    lease: bool = True,
    cohort: bool = False,
) -> contract.StageArgs:
    """``cache`` (NAMESPACE/NAME, node modes only): the stager asks its node's agent for room
    under the node's byte budget, for ``nbytes`` (the revision's size, when the webhook knows it).
    ``lease``: the stager writes the pod's lease itself (hostPath; a CSI volume's mount holds it).
    ``cohort``: the pod starts with pods on other nodes (cohort.starts_together)."""
    peers = bool(cache) and settings.peers
    src = spec.source
    return contract.StageArgs(
        source=src.uri,
        revision=revision.id,
        as_of=revision.as_of,
        cache_dir=STAGE_MOUNT_PATH,
        pod_uid=POD_UID_ARG if lease else None,
        endpoint_url=src.endpoint,
        region=src.region,
        addressing_style=src.addressingStyle,
        include=tuple(src.include),
        exclude=tuple(src.exclude),
        concurrency=settings.stager_concurrency or None,
        termination_log=TERMINATION_LOG,
        agent=f"{'https' if settings.agent_ca_file else 'http'}://$({contract.ENV_NODE_IP}):{settings.agent_port}"
        if cache
        else None,
        cache=cache,
        bytes=nbytes if cache else None,
        peer_token_file=PEER_TOKEN_FILE if peers else None,
        cohort=cohort and peers,
    )


def stager_args(
    spec: DatasetCacheSpec,
    settings: Settings,
    revision: RevisionRef,
    cache: str | None = None,
    nbytes: int | None = None,
    lease: bool = True,
    cohort: bool = False,
) -> list[str]:
    return stage_args(spec, settings, revision, cache, nbytes, lease, cohort).to_argv()


def stager_security_context(mode: VolumeMode) -> dict[str, Any]:
    """Least privilege that can still write the volume.

    HostPath: the kubelet creates the directory root-owned 0755, so the stager
    runs as uid 0 but with no capability at all (the owner needs none).
    CSI: the node agent hands the cache dir to NONROOT_UID when it publishes it;
    EmptyDir: the directory is world-writable. In both the stager runs non-root,
    which satisfies Pod Security ``restricted``.
    """
    ctx: dict[str, Any] = {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    if mode == VolumeMode.HOST_PATH:
        ctx.update(runAsUser=0, runAsGroup=0, runAsNonRoot=False)
    else:
        ctx.update(runAsUser=NONROOT_UID, runAsGroup=NONROOT_UID, runAsNonRoot=True)
    return ctx


def init_container(
    namespace: str,
    name: str,
    spec: DatasetCacheSpec,
    settings: Settings,
    mode: VolumeMode,
    revision: RevisionRef,
    nbytes: int | None = None,
    web_identity: WebIdentity | None = None,
    cohort: bool = False,
) -> dict[str, Any]:
    host_path = mode == VolumeMode.HOST_PATH
    on_node = mode in NODE_MODES
    env: list[dict[str, Any]] = []
    if host_path:
        # The lease file is named by the pod's UID, which exists only once the pod
        # does: the kubelet expands $(DSCACHE_POD_UID) in the args from this.
        env.append({"name": ENV_POD_UID, "valueFrom": {"fieldRef": {"fieldPath": "metadata.uid"}}})
    if on_node:
        # The node agent listens on its node's IP (host network): $(DSCACHE_NODE_IP) in --agent.
        env.append({"name": contract.ENV_NODE_IP, "valueFrom": {"fieldRef": {"fieldPath": "status.hostIP"}}})
        ca = peer_ca(settings)
        if ca:
            # The CA of the agents' certificate, for the stager's calls to its own and its peers' agents.
            env.append({"name": PEER_CA_ENV, "value": ca})
    secret = spec.source.secret_name
    if secret:
        for key, optional in (
            ("AWS_ACCESS_KEY_ID", False),
            ("AWS_SECRET_ACCESS_KEY", False),
            ("AWS_SESSION_TOKEN", True),
        ):
            env.append({"name": key, "valueFrom": {"secretKeyRef": {"name": secret, "key": key, "optional": optional}}})
    if web_identity is not None and not secret:
        env.extend(web_identity.env())
    if spec.source.region:
        env.append({"name": "AWS_REGION", "value": spec.source.region})
    resources = (
        spec.resources.model_dump(exclude_none=True) if spec.resources else copy.deepcopy(settings.stager_resources)
    )
    return {
        "name": STAGER_CONTAINER_NAME,
        "image": settings.stager_image,
        "imagePullPolicy": settings.stager_pull_policy,
        "command": [STAGER_COMMAND],
        "args": stager_args(
            spec,
            settings,
            revision,
            f"{namespace}/{name}" if on_node else None,
            nbytes,
            lease=host_path,
            cohort=cohort,
        ),
        "env": env,
        "volumeMounts": [{"name": VOLUME_NAME, "mountPath": STAGE_MOUNT_PATH}]
        + (
            [{"name": PEER_VOLUME_NAME, "mountPath": PEER_TOKEN_DIR, "readOnly": True}]
            if on_node and settings.peers
            else []
        )
        + (
            [{"name": WEB_IDENTITY_VOLUME, "mountPath": WEB_IDENTITY_DIR, "readOnly": True}]
            if web_identity is not None and not secret
            else []
        ),
        "resources": resources,
        "securityContext": stager_security_context(mode),
        "terminationMessagePath": TERMINATION_LOG,
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }


def peer_token_volume() -> dict[str, Any]:
    """The pod's own projected ServiceAccount token for the agents (audience ``dscache-peer``,
    PEER_TOKEN_EXPIRY_S; the kubelet renews it), for the stager only: the agents check it by
    TokenReview and serve only a pod of the cache's namespace that names the cache."""
    # 0444: the kubelet writes the files root-owned and the stager of a CSI volume runs as
    # NONROOT_UID; only the stager mounts this volume, so no other container sees the token.
    token = {"audience": PEER_AUDIENCE, "expirationSeconds": PEER_TOKEN_EXPIRY_S, "path": PEER_TOKEN_KEY}
    return {"name": PEER_VOLUME_NAME, "projected": {"defaultMode": 0o444, "sources": [{"serviceAccountToken": token}]}}


def peer_ca(settings: Settings) -> str | None:
    """The agents' CA (PEM) the stagers trust; None without one (plain HTTP)."""
    if not settings.agent_ca_file:
        return None
    try:
        return _read_ca(settings.agent_ca_file, os.stat(settings.agent_ca_file).st_mtime)
    except OSError:
        return None


@functools.lru_cache(maxsize=4)
def _read_ca(path: str, mtime: float) -> str:
    with open(path) as f:
        return f.read().strip()


def volume(namespace: str, name: str, settings: Settings, mode: VolumeMode, revision: RevisionRef) -> dict[str, Any]:
    if mode == VolumeMode.CSI:
        # The kubelet adds the pod's namespace and UID (podInfoOnMount): the agent trusts those,
        # never a namespace written here.
        attributes = {csi.ATTR_CACHE: name, csi.ATTR_REVISION: revision.id}
        if revision.as_of:
            attributes[csi.ATTR_AS_OF] = revision.as_of
        return {"name": VOLUME_NAME, "csi": {"driver": csi.DRIVER, "volumeAttributes": attributes}}
    if mode == VolumeMode.HOST_PATH:
        return {
            "name": VOLUME_NAME,
            "hostPath": {"path": settings.cache_dir(namespace, name), "type": "DirectoryOrCreate"},
        }
    return {"name": VOLUME_NAME, "emptyDir": {}}


def training_mounts(mount_path: str, revision: str) -> list[dict[str, Any]]:
    return [
        {"name": VOLUME_NAME, "mountPath": mount_path, "readOnly": True, "subPath": contract.data_subpath(revision)},
        {
            "name": VOLUME_NAME,
            "mountPath": META_MOUNT_PATH,
            "readOnly": True,
            "subPath": contract.meta_subpath(revision),
        },
    ]


def check_clashes(pod_spec: dict[str, Any], cache: str, mount_path: str) -> None:
    ours = {_norm(mount_path): "its mountPath", META_MOUNT_PATH: f"the metadata path {META_MOUNT_PATH}"}
    for c in pod_spec.get("containers") or []:
        for m in c.get("volumeMounts") or []:
            where = ours.get(_norm(m.get("mountPath", "")))
            if m.get("name") != VOLUME_NAME and where:
                raise InjectionError(
                    f"DatasetCache {cache!r}: {where} {m.get('mountPath')} clashes with the "
                    f"volume {m.get('name')!r} already mounted there in container "
                    f"{c.get('name')!r}; change spec.mountPath of the DatasetCache or "
                    f"move that mount."
                )
    for v in pod_spec.get("volumes") or []:
        if v.get("name") == VOLUME_NAME and not any(
            ic.get("name") == STAGER_CONTAINER_NAME for ic in pod_spec.get("initContainers") or []
        ):
            raise InjectionError(
                f"DatasetCache {cache!r}: the pod already has a volume named "
                f"{VOLUME_NAME!r}, which dscache reserves; rename that volume."
            )
    for c in pod_spec.get("initContainers") or []:
        if c.get("name") == STAGER_CONTAINER_NAME and not any(
            m.get("name") == VOLUME_NAME for m in c.get("volumeMounts") or []
        ):
            raise InjectionError(
                f"DatasetCache {cache!r}: the pod already has an init container named "
                f"{STAGER_CONTAINER_NAME!r}, which dscache reserves; rename that container."
            )


def _force_read_only(c: dict[str, Any], revision: str) -> bool:
    """A user's own mount of dscache-data: read-only, and narrowed to the revision's
    data when it names no subPath (C also holds other revisions and the leases)."""
    changed = False
    for m in c.get("volumeMounts") or []:
        if m.get("name") != VOLUME_NAME:
            continue
        if m.get("readOnly") is not True:
            m["readOnly"] = True
            changed = True
        if not m.get("subPath") and not m.get("subPathExpr"):
            m["subPath"] = contract.data_subpath(revision)
            changed = True
        if m.get("mountPropagation") not in (None, "None"):
            m["mountPropagation"] = "None"  # Bidirectional would need a privileged container
            changed = True
    return changed


def inject(
    pod_spec: dict[str, Any],
    *,
    namespace: str,
    name: str,
    spec: DatasetCacheSpec,
    settings: Settings,
    mode: VolumeMode,
    revision: RevisionRef,
    nbytes: int | None = None,
    web_identity: WebIdentity | None = None,
    cohort: bool = False,
) -> bool:
    """Mutate ``pod_spec`` in place; return True if anything changed."""
    check_clashes(pod_spec, name, spec.mountPath)
    changed = False

    volumes = pod_spec.setdefault("volumes", [])
    if not any(v.get("name") == VOLUME_NAME for v in volumes):
        volumes.append(volume(namespace, name, settings, mode, revision))
        changed = True
    if mode in NODE_MODES and settings.peers and not any(v.get("name") == PEER_VOLUME_NAME for v in volumes):
        volumes.append(peer_token_volume())
        changed = True
    if (
        mode in NODE_MODES
        and settings.peers
        and not (pod_spec.get("serviceAccountName") or pod_spec.get("serviceAccount"))
    ):
        # A projected token needs a named ServiceAccount (API validation, for a Job's pod template too,
        # where the ServiceAccount admission plugin has not defaulted it yet): the one it gets anyway.
        pod_spec["serviceAccountName"] = "default"
        changed = True
    if (
        web_identity is not None
        and not spec.source.secret_name
        and not any(v.get("name") == WEB_IDENTITY_VOLUME for v in volumes)
    ):
        volumes.append(web_identity.volume())
        changed = True

    inits = pod_spec.setdefault("initContainers", [])
    ours = next((c for c in inits if c.get("name") == STAGER_CONTAINER_NAME), None)
    if ours is None:
        ours = init_container(namespace, name, spec, settings, mode, revision, nbytes, web_identity, cohort)
        inits.insert(0, ours)
        changed = True
    elif inits[0] is not ours:
        # First, before any user init container (or native sidecar): nothing of the
        # user's runs before the stager has taken its lease on the revision.
        inits.remove(ours)
        inits.insert(0, ours)
        changed = True
    for c in inits[1:]:
        changed = _force_read_only(c, revision.id) or changed

    env_values = {ENV_DIR: spec.mountPath, ENV_MANIFEST: manifest_path(), ENV_REVISION: revision.id}
    wanted_mounts = training_mounts(spec.mountPath, revision.id)
    by_path = {_norm(w["mountPath"]): w for w in wanted_mounts}
    for c in pod_spec.get("containers") or []:
        mounts = c.setdefault("volumeMounts", [])
        for i, m in enumerate(mounts):
            if m.get("name") != VOLUME_NAME:
                continue
            want = by_path.get(_norm(m.get("mountPath", "")))
            if want is None:
                changed = _force_read_only({"volumeMounts": [m]}, revision.id) or changed
            elif m != want:
                mounts[i] = dict(want)  # a user's mount at our path becomes exactly ours
                changed = True
        have = {_norm(m.get("mountPath", "")) for m in mounts if m.get("name") == VOLUME_NAME}
        for path, want in by_path.items():
            if path not in have:
                mounts.append(dict(want))
                changed = True
        env = c.setdefault("env", [])
        present = {e.get("name") for e in env}
        for key, value in env_values.items():
            if key not in present:
                env.append({"name": key, "value": value})
                changed = True
    return changed


def inject_object(
    obj: dict[str, Any],
    *,
    kind: str,
    namespace: str,
    cache_name: str,
    spec: DatasetCacheSpec,
    settings: Settings,
    mode: VolumeMode,
    revision: RevisionRef,
    nbytes: int | None = None,
    web_identity: WebIdentity | None = None,
) -> bool:
    """Inject into a Job's pod template or a Pod; mutate ``obj`` in place.

    ``revision`` is the one to pin when the object carries none yet; a revision
    already on the pod template / pod (a Job's pods inherit it) always wins, so
    every pod of one Job stages the same bytes, whenever it is created.
    """
    if kind == "Job":
        template = obj.setdefault("spec", {}).setdefault("template", {})
        pod_spec = template.setdefault("spec", {})
        meta = template.setdefault("metadata", {})
    else:
        pod_spec = obj.setdefault("spec", {})
        meta = obj.setdefault("metadata", {})
    annotations = meta.get("annotations") or {}
    try:
        revision = RevisionRef.from_annotations(annotations, cache_name) or revision
    except ValueError as e:
        raise InjectionError(str(e)) from None
    existing = next((v for v in pod_spec.get("volumes") or [] if v.get("name") == VOLUME_NAME), None)
    if existing is not None and any(
        c.get("name") == STAGER_CONTAINER_NAME for c in pod_spec.get("initContainers") or []
    ):
        # Already injected (e.g. a Job's pod): keep the mode it was injected with.
        mode = next((m for key, m in INJECTED_AS.items() if key in existing), VolumeMode.EMPTY_DIR)
    changed = inject(
        pod_spec,
        namespace=namespace,
        name=cache_name,
        spec=spec,
        settings=settings,
        mode=mode,
        revision=revision,
        nbytes=nbytes,
        web_identity=web_identity,
        cohort=starts_together(kind, obj),
    )
    # The pods carry the cache name (for the controller's consumer index), the
    # mode and the revision (for wipe planning per node and revision).
    wanted = {ANNOTATION_CACHE: cache_name, MODE_ANNOTATION: VolumeMode(mode).value, **revision.to_annotations()}
    if any(annotations.get(k) != v for k, v in wanted.items()):
        meta["annotations"] = {**annotations, **wanted}
        changed = True
    changed = _label(meta) or changed
    if kind == "Job":
        # The Job itself too: the controller watches only labelled Jobs.
        jmeta = obj.setdefault("metadata", {})
        changed = _label(jmeta) or changed
        jann = jmeta.get("annotations") or {}
        if jann.get(ANNOTATION_CACHE) != cache_name:
            jmeta["annotations"] = {**jann, ANNOTATION_CACHE: cache_name}
            changed = True
    return changed


def _label(meta: dict[str, Any]) -> bool:
    labels = meta.get("labels") or {}
    if labels.get(LABEL_CONSUMER) == "true":
        return False
    meta["labels"] = {**labels, LABEL_CONSUMER: "true"}
    return True


def requested_cache(obj: dict[str, Any], kind: str) -> str | None:
    """The cache a Job (metadata or template) or a Pod asks for, if any."""
    meta = obj.get("metadata") or {}
    name = (meta.get("annotations") or {}).get(ANNOTATION_CACHE)
    if name is None and kind == "Job":
        tmeta = ((obj.get("spec") or {}).get("template") or {}).get("metadata") or {}
        name = (tmeta.get("annotations") or {}).get(ANNOTATION_CACHE)
    return name


def direct_owner_uid(obj: dict[str, Any]) -> str | None:
    """The controller owner's UID of a Pod or Job at admission (None: no owner)."""
    for ref in (obj.get("metadata") or {}).get("ownerReferences") or []:
        if ref.get("controller") and ref.get("uid"):
            return str(ref["uid"])
    return None
