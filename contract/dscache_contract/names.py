"""Fixed names shared by the webhook (which writes them into pods), the stager and the node agent."""

from __future__ import annotations

__all__ = [
    "ANNOTATION_AS_OF",
    "ANNOTATION_CACHE",
    "ANNOTATION_PLACEMENT",
    "ANNOTATION_REVISION",
    "COMPLETE_NAME",
    "DATA_DIR",
    "ENV_DIR",
    "ENV_MANIFEST",
    "ENV_POD_UID",
    "ENV_REVISION",
    "JOURNAL_NAME",
    "LABEL_CONSUMER",
    "LEASES_DIR",
    "LOCK_NAME",
    "MANIFEST_NAME",
    "META_DIR",
    "META_MOUNT_PATH",
    "POD_UID_ARG",
    "REVS_DIR",
    "STAGER_COMMAND",
    "STAGER_CONTAINER_NAME",
    "STAGE_MOUNT_PATH",
    "TERMINATION_LOG",
    "TMP_DIR",
    "VOLUME_NAME",
    "manifest_env_value",
]

# The pod volume that carries the node's cache dir C (hostPath) or an emptyDir.
VOLUME_NAME = "dscache-data"
# The injected init container; it must be the pod's first init container.
STAGER_CONTAINER_NAME = "dscache-stage"
# Console script of the stager image.
STAGER_COMMAND = "dscache-stage"
# Where the stager container mounts the volume (read-write): C itself.
STAGE_MOUNT_PATH = "/dscache"
# Where every training container sees the revision's meta dir (read-only,
# subPath revs/<rev>/meta), so that DSCACHE_DIR holds the data and nothing else.
META_MOUNT_PATH = "/var/run/dscache"

# Env vars set in training containers.
ENV_DIR = "DSCACHE_DIR"  # = spec.mountPath: the revision's data, nothing else
ENV_MANIFEST = "DSCACHE_MANIFEST"  # = META_MOUNT_PATH/manifest.jsonl
ENV_REVISION = "DSCACHE_REVISION"  # the revision id the pod was admitted with
# Env var of the stager container, filled from the downward API (metadata.uid).
ENV_POD_UID = "DSCACHE_POD_UID"
# Kubernetes expands $(VAR) in args from the container's env, so the webhook
# can write --pod-uid before the pod has a uid.
POD_UID_ARG = f"$({ENV_POD_UID})"

# Annotations.
ANNOTATION_CACHE = "dscache.io/cache"
ANNOTATION_REVISION = "dscache.io/revision"
# On a workload's pod template: "required" makes its pods wait for a node that
# holds their revision instead of copying elsewhere ("preferred" is the default).
ANNOTATION_PLACEMENT = "dscache.io/placement"
# Versioned buckets: the revision's versions time (dscache_contract.versions), beside the revision.
ANNOTATION_AS_OF = "dscache.io/revision-as-of"
# Label (value "true") the webhook puts on what it injects, Jobs and pods: the controller's
# and the node agents' watches ask the API server for consumer pods by it.
LABEL_CONSUMER = "dscache.io/consumer"

TERMINATION_LOG = "/dev/termination-log"

# On-node layout, under C = <cacheRoot>/<namespace>/<cache> (see paths.py).
LOCK_NAME = "lock"
REVS_DIR = "revs"
LEASES_DIR = "leases"
DATA_DIR = "data"
META_DIR = "meta"
TMP_DIR = "tmp"
MANIFEST_NAME = "manifest.jsonl"
COMPLETE_NAME = "complete"
JOURNAL_NAME = "journal.jsonl"


def manifest_env_value() -> str:
    """The value of DSCACHE_MANIFEST in training containers."""
    return f"{META_MOUNT_PATH}/{MANIFEST_NAME}"
