"""The CSI volume: the node agent's driver, what the webhook writes into a pod's inline
volume, and the lease a published volume holds.

The webhook gives each pod an inline (ephemeral) ``csi`` volume of driver ``cache.dscache.io``
whose attributes name the cache and the pinned revision; the kubelet adds the pod's
namespace and UID (``podInfoOnMount``). The agent's NodePublishVolume writes the lease
``C/leases/<rev>/<pod-uid>`` with the volume's target path in it, then bind-mounts C there;
NodeUnpublishVolume unmounts, then deletes the lease. So a lease that names a mount is held
exactly as long as the mount exists: no pod view, however stale, may release it
(``lease_mount``: the wipe and the agent's own release skip such leases).
"""

from __future__ import annotations

import json
import os
import stat
import time

DRIVER = "cache.dscache.io"
#: Volume attributes the webhook writes.
ATTR_CACHE = "cache"
ATTR_REVISION = "revision"
ATTR_AS_OF = "asOf"
#: Attributes the kubelet adds (CSIDriver podInfoOnMount, and every inline volume).
ATTR_POD_NAMESPACE = "csi.storage.k8s.io/pod.namespace"
ATTR_POD_UID = "csi.storage.k8s.io/pod.uid"
ATTR_POD_NAME = "csi.storage.k8s.io/pod.name"
ATTR_EPHEMERAL = "csi.storage.k8s.io/ephemeral"
#: The key of a lease file's JSON that names the mount holding it.
LEASE_MOUNT_KEY = "mount"


def lease_body(pod_uid: str, revision: str, mount: str | None = None) -> str:
    """A lease file's content; ``mount``: the target path of the published volume holding it."""
    body: dict[str, object] = {"pod_uid": pod_uid, "revision": revision, "at": time.time()}
    if mount is not None:
        body[LEASE_MOUNT_KEY] = mount
    return json.dumps(body) + "\n"


def lease_mount(path: str) -> str | None:
    """The target path of the volume that holds the lease at ``path``; None when the lease is a
    stager's (hostPath mode), unreadable or no regular file. Never follows a symlink."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        if not _regular(fd):
            return None
        data = os.read(fd, 8192)
    finally:
        os.close(fd)
    try:
        mount = json.loads(data).get(LEASE_MOUNT_KEY)
    except (ValueError, AttributeError):
        return None
    return mount if isinstance(mount, str) and mount else None


def _regular(fd: int) -> bool:
    return stat.S_ISREG(os.fstat(fd).st_mode)
