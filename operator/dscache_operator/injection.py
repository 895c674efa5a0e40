"""What the webhook adds to a pod spec: pure functions, no I/O.

Every step is idempotent (keyed by our fixed names), so a reinvocation or a
Job's pod passing through the webhook again never injects twice.
"""

from __future__ import annotations

import copy
import posixpath
from typing import Any

from .models import CACHE_ANNOTATION, CONSUMER_LABEL, DatasetCacheSpec, VolumeMode
from .settings import Settings

INIT_NAME = "dscache-stage"
VOLUME_NAME = "dscache-data"
#: Where the init container sees the volume (never visible to training code).
STAGE_DIR = "/dscache"
#: Annotation recording the volume mode on the pod (for the controller).
MODE_ANNOTATION = "dscache.io/volume"
NONROOT_UID = 65532

Mode = VolumeMode


class InjectionError(Exception):
    """The pod cannot get the cache; the message names the cache and the fix."""


def manifest_path(mount_path: str) -> str:
    return posixpath.join(mount_path, ".dscache", "manifest.jsonl")


def _norm(path: str) -> str:
    return posixpath.normpath(path) if path else path


def stager_args(spec: DatasetCacheSpec, settings: Settings) -> list[str]:
    src = spec.source
    args = ["sync", src.uri, STAGE_DIR]
    if src.endpoint:
        args += ["--endpoint-url", src.endpoint]
    if src.region:
        args += ["--region", src.region]
    if src.addressingStyle:
        args += ["--addressing-style", src.addressingStyle]
    for glob in src.include:
        args += ["--include", glob]
    for glob in src.exclude:
        args += ["--exclude", glob]
    if settings.stager_concurrency:
        args += ["--concurrency", str(settings.stager_concurrency)]
    args += ["--termination-log", "/dev/termination-log"]
    return args


def stager_security_context(mode: Mode) -> dict[str, Any]:
    """Least privilege that can still write the volume.

    HostPath: the kubelet creates the directory root-owned 0755, so the stager
    runs as uid 0 but with no capability at all (the owner needs none).
    EmptyDir: the directory is world-writable, so the stager runs non-root,
    which also satisfies Pod Security ``restricted``.
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


def init_container(namespace: str, name: str, spec: DatasetCacheSpec,
                   settings: Settings, mode: Mode) -> dict[str, Any]:
    env: list[dict[str, Any]] = []
    secret = spec.source.secret_name
    if secret:
        for key, optional in (("AWS_ACCESS_KEY_ID", False), ("AWS_SECRET_ACCESS_KEY", False),
                              ("AWS_SESSION_TOKEN", True)):
            env.append({"name": key, "valueFrom": {"secretKeyRef": {
                "name": secret, "key": key, "optional": optional}}})
    if spec.source.region:
        env.append({"name": "AWS_REGION", "value": spec.source.region})
    resources = (spec.resources.model_dump(exclude_none=True) if spec.resources
                 else copy.deepcopy(settings.stager_resources))
    container: dict[str, Any] = {
        "name": INIT_NAME,
        "image": settings.stager_image,
        "imagePullPolicy": settings.stager_pull_policy,
        "command": ["dscache-stage"],
        "args": stager_args(spec, settings),
        "env": env,
        "volumeMounts": [{"name": VOLUME_NAME, "mountPath": STAGE_DIR}],
        "resources": resources,
        "securityContext": stager_security_context(mode),
        "terminationMessagePath": "/dev/termination-log",
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    return container


def volume(namespace: str, name: str, settings: Settings, mode: Mode) -> dict[str, Any]:
    if mode == VolumeMode.HOST_PATH:
        return {"name": VOLUME_NAME, "hostPath": {
            "path": settings.cache_dir(namespace, name), "type": "DirectoryOrCreate"}}
    return {"name": VOLUME_NAME, "emptyDir": {}}


def check_clashes(pod_spec: dict[str, Any], cache: str, mount_path: str) -> None:
    want = _norm(mount_path)
    for c in pod_spec.get("containers") or []:
        for m in c.get("volumeMounts") or []:
            if m.get("name") != VOLUME_NAME and _norm(m.get("mountPath", "")) == want:
                raise InjectionError(
                    f"DatasetCache {cache!r}: its mountPath {mount_path} clashes with the "
                    f"volume {m.get('name')!r} already mounted there in container "
                    f"{c.get('name')!r}; change spec.mountPath of the DatasetCache or "
                    f"move that mount.")
    for v in pod_spec.get("volumes") or []:
        if v.get("name") == VOLUME_NAME and not any(
                ic.get("name") == INIT_NAME for ic in pod_spec.get("initContainers") or []):
            raise InjectionError(
                f"DatasetCache {cache!r}: the pod already has a volume named "
                f"{VOLUME_NAME!r}, which dscache reserves; rename that volume.")


def inject(pod_spec: dict[str, Any], *, namespace: str, name: str,
           spec: DatasetCacheSpec, settings: Settings, mode: Mode) -> bool:
    """Mutate ``pod_spec`` in place; return True if anything changed."""
    check_clashes(pod_spec, name, spec.mountPath)
    changed = False

    volumes = pod_spec.setdefault("volumes", [])
    if not any(v.get("name") == VOLUME_NAME for v in volumes):
        volumes.append(volume(namespace, name, settings, mode))
        changed = True

    inits = pod_spec.setdefault("initContainers", [])
    if not any(c.get("name") == INIT_NAME for c in inits):
        # Appended last: native sidecars (e.g. a mesh proxy) start before us.
        inits.append(init_container(namespace, name, spec, settings, mode))
        changed = True

    env_values = {"DSCACHE_DIR": spec.mountPath, "DSCACHE_MANIFEST": manifest_path(spec.mountPath)}
    for c in pod_spec.get("containers") or []:
        mounts = c.setdefault("volumeMounts", [])
        if not any(m.get("name") == VOLUME_NAME for m in mounts):
            mounts.append({"name": VOLUME_NAME, "mountPath": spec.mountPath, "readOnly": True})
            changed = True
        env = c.setdefault("env", [])
        present = {e.get("name") for e in env}
        for key, value in env_values.items():
            if key not in present:
                env.append({"name": key, "value": value})
                changed = True
    return changed


def inject_object(obj: dict[str, Any], *, kind: str, namespace: str, cache_name: str,
                  spec: DatasetCacheSpec, settings: Settings, mode: Mode) -> bool:
    """Inject into a Job's pod template or a Pod; mutate ``obj`` in place."""
    if kind == "Job":
        template = obj.setdefault("spec", {}).setdefault("template", {})
        pod_spec = template.setdefault("spec", {})
        meta = template.setdefault("metadata", {})
    else:
        pod_spec = obj.setdefault("spec", {})
        meta = obj.setdefault("metadata", {})
    existing = next((v for v in pod_spec.get("volumes") or [] if v.get("name") == VOLUME_NAME), None)
    if existing is not None:
        # Already injected (e.g. a Job's pod): keep the mode it was injected with.
        mode = VolumeMode.HOST_PATH if "hostPath" in existing else VolumeMode.EMPTY_DIR
    changed = inject(pod_spec, namespace=namespace, name=cache_name, spec=spec,
                     settings=settings, mode=mode)
    annotations = meta.get("annotations") or {}
    # The pods carry the cache name (for the controller's consumer index) and the mode.
    wanted = {CACHE_ANNOTATION: cache_name, MODE_ANNOTATION: VolumeMode(mode).value}
    if any(annotations.get(k) != v for k, v in wanted.items()):
        meta["annotations"] = {**annotations, **wanted}
        changed = True
    changed = _label(meta) or changed
    if kind == "Job":
        # The Job itself too: the controller watches only labelled Jobs.
        jmeta = obj.setdefault("metadata", {})
        changed = _label(jmeta) or changed
        jann = jmeta.get("annotations") or {}
        if jann.get(CACHE_ANNOTATION) != cache_name:
            jmeta["annotations"] = {**jann, CACHE_ANNOTATION: cache_name}
            changed = True
    return changed


def _label(meta: dict[str, Any]) -> bool:
    labels = meta.get("labels") or {}
    if labels.get(CONSUMER_LABEL) == "true":
        return False
    meta["labels"] = {**labels, CONSUMER_LABEL: "true"}
    return True


def requested_cache(obj: dict[str, Any], kind: str) -> str | None:
    """The cache a Job (metadata or template) or a Pod asks for, if any."""
    meta = obj.get("metadata") or {}
    name = (meta.get("annotations") or {}).get(CACHE_ANNOTATION)
    if name is None and kind == "Job":
        tmeta = ((obj.get("spec") or {}).get("template") or {}).get("metadata") or {}
        name = (tmeta.get("annotations") or {}).get(CACHE_ANNOTATION)
    return name
