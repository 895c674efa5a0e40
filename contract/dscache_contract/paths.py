"""The on-node layout, as pure path functions (no I/O).

    C = <cacheRoot>/<namespace>/<cache>   the hostPath volume source (DirectoryOrCreate)
    C/lock                                flock target: stagers (to stage), wipes (to release/delete)
    C/revs/<rev>/data/                    exactly the revision's objects; immutable once complete
    C/revs/<rev>/meta/manifest.jsonl      one ManifestEntry per line, sorted by path
    C/revs/<rev>/meta/complete            written last (the StageSummary JSON); presence = whole
    C/revs/<rev>/meta/journal.jsonl       objects placed by an unfinished run (resume)
    C/revs/<rev>/tmp/                     downloads in flight (same fs, renamed into data/)
    C/leases/<rev>/<pod-uid>              one lease file per pod using <rev> on this node

Why revisions side by side: a complete revision is never modified, so a pod
reading revision A never sees bytes change while B is staged next to it.
Why C is never removed by a revision wipe: C is the source of every pod's
hostPath mount; removing it would leave running pods' mounts dangling.

Version 1 staged straight into C (the data at its top, metadata in
C/.dscache/). Anything at the top of C but TOP_NAMES is such a leftover,
which only ``wipe --legacy`` removes.
"""

from __future__ import annotations

import os
import re

from .names import (
    COMPLETE_NAME,
    DATA_DIR,
    JOURNAL_NAME,
    LEASES_DIR,
    LOCK_NAME,
    MANIFEST_NAME,
    META_DIR,
    REVS_DIR,
    TMP_DIR,
)

#: The entries at the top of C that the current layout names (everything else
#: there predates revisions).
TOP_NAMES = frozenset({LOCK_NAME, REVS_DIR, LEASES_DIR})

# "r-" + 20 hex digits of a sha256 (see revision.py): short enough for a label
# value and a path component, 80 bits against accidental collisions.
REVISION_RE = re.compile(r"^r-[0-9a-f]{20}$")
# Kubernetes pod UIDs are RFC 4122 UUIDs; accept any plain token so the
# stager can be run by hand, but never anything that could be a path.
POD_UID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
# DNS-1123 label (namespace) / subdomain (DatasetCache name).
_NAME_RE = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")


def validate_revision(rev: str) -> str:
    if not isinstance(rev, str) or not REVISION_RE.match(rev):
        raise ValueError(f"revision {rev!r} is not a dscache revision id (r- and 20 hex digits)")
    return rev


def validate_pod_uid(uid: str) -> str:
    if not isinstance(uid, str) or not POD_UID_RE.match(uid) or uid in (".", ".."):
        raise ValueError(f"pod uid {uid!r} is not a plain token (letters, digits, '-', '_', '.')")
    return uid


def cache_dir(root: str, namespace: str, cache: str) -> str:
    """C for one DatasetCache under the node's cache root."""
    for what, name in (("namespace", namespace), ("cache name", cache)):
        if not _NAME_RE.match(name) or ".." in name:
            raise ValueError(f"{what} {name!r} is not a Kubernetes name")
    return os.path.join(root, namespace, cache)


def lock_path(c: str) -> str:
    return os.path.join(c, LOCK_NAME)


def revisions_root(c: str) -> str:
    return os.path.join(c, REVS_DIR)


def revision_dir(c: str, rev: str) -> str:
    return os.path.join(c, REVS_DIR, validate_revision(rev))


def data_dir(c: str, rev: str) -> str:
    return os.path.join(revision_dir(c, rev), DATA_DIR)


def meta_dir(c: str, rev: str) -> str:
    return os.path.join(revision_dir(c, rev), META_DIR)


def manifest_path(c: str, rev: str) -> str:
    return os.path.join(meta_dir(c, rev), MANIFEST_NAME)


def complete_path(c: str, rev: str) -> str:
    return os.path.join(meta_dir(c, rev), COMPLETE_NAME)


def journal_path(c: str, rev: str) -> str:
    return os.path.join(meta_dir(c, rev), JOURNAL_NAME)


def tmp_dir(c: str, rev: str) -> str:
    return os.path.join(revision_dir(c, rev), TMP_DIR)


def leases_root(c: str) -> str:
    return os.path.join(c, LEASES_DIR)


def lease_dir(c: str, rev: str) -> str:
    return os.path.join(c, LEASES_DIR, validate_revision(rev))


def lease_path(c: str, rev: str, pod_uid: str) -> str:
    return os.path.join(lease_dir(c, rev), validate_pod_uid(pod_uid))


def data_subpath(rev: str) -> str:
    """volumeMount.subPath of a training container: the revision's data, nothing else."""
    return f"{REVS_DIR}/{validate_revision(rev)}/{DATA_DIR}"


def meta_subpath(rev: str) -> str:
    """volumeMount.subPath for META_MOUNT_PATH: the manifest and completion marker."""
    return f"{REVS_DIR}/{validate_revision(rev)}/{META_DIR}"
