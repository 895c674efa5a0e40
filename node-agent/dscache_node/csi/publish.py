"""Publish and unpublish one pod's dscache volume: the lease is the mount.

NodePublishVolume: write the lease ``C/leases/<rev>/<pod-uid>`` naming the target path,
then bind-mount C on the target. NodeUnpublishVolume: unmount, then delete the lease. In
that order a mount never exists without its lease, so a wipe or an eviction (which remove
only what no lease holds, under the same agent lock) never removes a revision a pod has
mounted. Both calls are idempotent, as the CSI spec requires: the kubelet repeats them
until they succeed.

After a restart, ``recover`` reads the two halves back: a lease whose target is not
mounted is a publish that never completed (the kubelet publishes again if the pod still
starts), so it goes; a mount with its lease stays as it is. Nothing is invented.
"""

from __future__ import annotations

import contextlib
import glob
import logging
import os
import threading
from dataclasses import dataclass

import dscache_contract as contract
from dscache_contract import csi
from dscache_contract.paths import validate_pod_uid, validate_revision

from .mounts import Mounter

log = logging.getLogger("dscache-node.csi")


class VolumeError(Exception):
    """A request the driver cannot carry out; ``code`` names the gRPC status."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class Volume:
    """One pod's volume, from a NodePublishVolume request (see ``from_context``)."""

    namespace: str
    cache: str
    revision: str
    pod_uid: str
    target: str
    readonly: bool = False

    @classmethod
    def from_context(cls, context: dict[str, str], target: str, readonly: bool) -> Volume:
        """The volume a request asks for. The namespace is the kubelet's (podInfoOnMount),
        never an attribute a pod's author wrote, so a pod mounts only its own namespace's caches."""
        if context.get(csi.ATTR_EPHEMERAL) != "true":
            raise VolumeError(
                "INVALID_ARGUMENT",
                f"{csi.DRIVER} volumes are inline (ephemeral) pod volumes only: the webhook writes them; "
                "a PersistentVolume of this driver is not supported",
            )
        missing = [
            k
            for k in (csi.ATTR_CACHE, csi.ATTR_REVISION, csi.ATTR_POD_NAMESPACE, csi.ATTR_POD_UID)
            if not context.get(k)
        ]
        if missing:
            raise VolumeError(
                "INVALID_ARGUMENT",
                f"volume attributes {', '.join(missing)} missing: the webhook writes cache and revision, and the "
                f"kubelet adds the pod's namespace and UID when the CSIDriver {csi.DRIVER} has podInfoOnMount: true",
            )
        try:
            validate_revision(context[csi.ATTR_REVISION])
            validate_pod_uid(context[csi.ATTR_POD_UID])
            contract.cache_dir("/", context[csi.ATTR_POD_NAMESPACE], context[csi.ATTR_CACHE])
        except ValueError as e:
            raise VolumeError("INVALID_ARGUMENT", str(e)) from e
        return cls(
            context[csi.ATTR_POD_NAMESPACE],
            context[csi.ATTR_CACHE],
            context[csi.ATTR_REVISION],
            context[csi.ATTR_POD_UID],
            os.path.normpath(target),
            readonly,
        )


class Publisher:
    """The node's published dscache volumes, as leases under cacheRoot and mounts on targets.

    ``lock`` is the agent's: wipes, evictions and scans hold it while they read leases and
    remove, so a lease written under it is seen by every removal that follows."""

    def __init__(
        self,
        cache_root: str,
        kubelet_dir: str,
        stager_uid: int,
        mounter: Mounter,
        lock: threading.RLock | None = None,
    ) -> None:
        self.root = cache_root
        self.pods_dir = os.path.join(os.path.normpath(kubelet_dir), "pods") + os.sep
        self.stager_uid = stager_uid
        self.mounter = mounter
        self.lock = lock or threading.RLock()

    # --- publish ------------------------------------------------------------------------------

    def publish(self, v: Volume) -> None:
        self._check_target(v.target)
        c = contract.cache_dir(self.root, v.namespace, v.cache)
        lease = contract.lease_path(c, v.revision, v.pod_uid)
        with self.lock:
            held = csi.lease_mount(lease)
            if held is not None and held != v.target and self.mounter.is_mount(held):
                raise VolumeError(
                    "FAILED_PRECONDITION",
                    f"pod {v.pod_uid} already mounts revision {v.revision} of {v.namespace}/{v.cache} at {held}: "
                    "a pod mounts a cache once",
                )
            if self.mounter.is_mount(v.target):
                if held == v.target and _same_file(c, v.target):
                    return  # published already: the kubelet asked again
                raise VolumeError("ALREADY_EXISTS", f"{v.target} is mounted already, and not with this volume")
            self._prepare(c)
            _write_atomic(lease, csi.lease_body(v.pod_uid, v.revision, v.target))
            try:
                os.makedirs(v.target, 0o750, exist_ok=True)
                self.mounter.bind(c, v.target, v.readonly)
            except OSError as e:
                with contextlib.suppress(OSError):
                    os.unlink(lease)
                raise VolumeError("INTERNAL", f"could not mount {c} on {v.target}: {e}") from e
        log.info(f"published {v.namespace}/{v.cache} {v.revision} for pod {v.pod_uid} at {v.target}")

    def _check_target(self, target: str) -> None:
        if not os.path.normpath(target).startswith(self.pods_dir):
            raise VolumeError("INVALID_ARGUMENT", f"target path {target} is not under the kubelet's {self.pods_dir}")

    def _prepare(self, c: str) -> None:
        """C, its lock and revs/ owned by the stager's uid (it runs as that uid, with no
        capability, and writes the copy through the volume); leases/ stays root's: a pod
        may read its leases, never write them."""
        os.makedirs(os.path.dirname(c), 0o755, exist_ok=True)
        os.makedirs(contract.leases_root(c), 0o755, exist_ok=True)
        os.makedirs(contract.revisions_root(c), 0o755, exist_ok=True)
        lock = contract.lock_path(c)
        fd = os.open(lock, os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        os.close(fd)
        for path in (c, contract.revisions_root(c), lock):
            st = os.lstat(path)
            if st.st_uid != self.stager_uid:
                os.lchown(path, self.stager_uid, self.stager_uid)

    # --- unpublish ----------------------------------------------------------------------------

    def unpublish(self, target: str) -> None:
        target = os.path.normpath(target)
        self._check_target(target)
        with self.lock:
            if self.mounter.is_mount(target):
                try:
                    self.mounter.unmount(target)
                except OSError as e:
                    raise VolumeError("INTERNAL", f"could not unmount {target}: {e}") from e
            with contextlib.suppress(FileNotFoundError):
                os.rmdir(target)
            released = [
                path for path in self._leases(_pod_uid_of(target, self.pods_dir)) if csi.lease_mount(path) == target
            ]
            for path in released:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
        for path in released:
            log.info(f"unpublished {target}: released {os.path.relpath(path, self.root)}")

    def _leases(self, pod_uid: str | None) -> list[str]:
        """Lease files of ``pod_uid`` (all leases: None) under cacheRoot."""
        name = glob.escape(pod_uid) if pod_uid else "*"
        pattern = os.path.join(glob.escape(self.root), "*", "*", contract.LEASES_DIR, "*", name)
        return sorted(glob.glob(pattern))

    # --- after a restart ----------------------------------------------------------------------

    def recover(self) -> tuple[int, int]:
        """Read the leases and the mounts back: (mount leases kept, leases of no mount removed)."""
        kept = removed = 0
        with self.lock:
            for path in self._leases(None):
                target = csi.lease_mount(path)
                if target is None:
                    continue  # a stager's lease (hostPath mode): not ours to judge
                if self.mounter.is_mount(target):
                    kept += 1
                    continue
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
                removed += 1
                log.info(f"lease {os.path.relpath(path, self.root)} names {target}, which is not mounted: released")
        return kept, removed


def _pod_uid_of(target: str, pods_dir: str) -> str | None:
    """The pod UID in a kubelet target path (<kubelet>/pods/<uid>/volumes/...)."""
    rest = target[len(pods_dir) :].split(os.sep, 1)[0]
    try:
        return validate_pod_uid(rest)
    except ValueError:
        return None


def _same_file(a: str, b: str) -> bool:
    try:
        sa, sb = os.stat(a), os.stat(b)
    except OSError:
        return False
    return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)


def _write_atomic(path: str, text: str) -> None:
    d = os.path.dirname(path)
    os.makedirs(d, 0o755, exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}-{threading.get_ident()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)
    os.replace(tmp, path)
