"""The seam between the dscache operator and its stager, shipped in both images.

Everything both sides must agree on lives here, and only here: the names
(volume, container, env, annotations, labels, mount points), the on-node layout, the
stager's command line (built by the operator, parsed by the stager, with one
type), the JSON summary and exit codes, the include/exclude rule, the S3
defaults, the revision digest, how a revision is pinned (versions.py), the
node agent's API and the peers' protocol, and the one timestamp format (clock.py).

Standard library only: the stager imports this on every warm start, whose
whole budget is tens of milliseconds (pydantic alone would cost ~100 ms).

The package imports lazily (PEP 562): ``from dscache_contract import X`` loads
only X's module. A stager's cold start (issue 30) needs a few of them; the
whole package (email.utils, the node agent's and the peers' types) cost it
~20 ms of CPU per run.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

from .names import *  # noqa: F403 - the names are the API (constants only: cheap)

if TYPE_CHECKING:
    from .args import ArgsError, StageArgs, WipeArgs, build_parser
    from .node import (
        AGENT_LABEL,
        AGENT_PORT,
        ENV_NODE_IP,
        INVENTORY_ANNOTATION,
        RESERVE_PATH,
        WARM_LABEL_PREFIX,
        WIPE_PATH,
        HeldRevision,
        Inventory,
        ReserveAnswer,
        ReserveRequest,
        WipeRequest,
        cache_digest,
        parse_warm_label,
        warm_label,
    )
    from .paths import (
        TOP_NAMES,
        cache_dir,
        complete_path,
        data_dir,
        data_subpath,
        journal_path,
        lease_dir,
        lease_path,
        leases_root,
        lock_path,
        manifest_path,
        meta_dir,
        meta_subpath,
        revision_dir,
        revisions_root,
        tmp_dir,
        validate_pod_uid,
        validate_revision,
    )
    from .peers import PeersAnswer, PeersRequest
    from .revision import RevisionHasher, normalize_etag
    from .s3 import DEFAULT_REGION, resolve_addressing_style, resolve_region
    from .selection import Selection, normalize_key, parse_source, selected
    from .summary import EXIT_CODE_HELP, ExitCode, ManifestEntry, StageSummary, WipeSummary, human_bytes
    from .versions import (
        ObjectVersion,
        Pin,
        RevisionRef,
        VersionPicker,
        format_as_of,
        page_versions,
        parse_as_of,
        pin,
    )

#: Which module holds each lazily imported name.
_WHERE: dict[str, str] = {
    **dict.fromkeys(("ArgsError", "StageArgs", "WipeArgs", "build_parser"), "args"),
    **dict.fromkeys(
        (
            "AGENT_LABEL",
            "AGENT_PORT",
            "ENV_NODE_IP",
            "INVENTORY_ANNOTATION",
            "RESERVE_PATH",
            "WARM_LABEL_PREFIX",
            "WIPE_PATH",
            "HeldRevision",
            "Inventory",
            "ReserveAnswer",
            "ReserveRequest",
            "WipeRequest",
            "cache_digest",
            "parse_warm_label",
            "warm_label",
        ),
        "node",
    ),
    **dict.fromkeys(
        (
            "TOP_NAMES",
            "cache_dir",
            "complete_path",
            "data_dir",
            "data_subpath",
            "journal_path",
            "lease_dir",
            "lease_path",
            "leases_root",
            "lock_path",
            "manifest_path",
            "meta_dir",
            "meta_subpath",
            "revision_dir",
            "revisions_root",
            "tmp_dir",
            "validate_pod_uid",
            "validate_revision",
        ),
        "paths",
    ),
    **dict.fromkeys(("PeersAnswer", "PeersRequest"), "peers"),
    **dict.fromkeys(("RevisionHasher", "normalize_etag"), "revision"),
    **dict.fromkeys(("DEFAULT_REGION", "resolve_addressing_style", "resolve_region"), "s3"),
    **dict.fromkeys(("Selection", "normalize_key", "parse_source", "selected"), "selection"),
    **dict.fromkeys(
        ("EXIT_CODE_HELP", "ExitCode", "ManifestEntry", "StageSummary", "WipeSummary", "human_bytes"), "summary"
    ),
    **dict.fromkeys(
        ("ObjectVersion", "Pin", "RevisionRef", "VersionPicker", "format_as_of", "page_versions", "parse_as_of", "pin"),
        "versions",
    ),
}


def __getattr__(name: str) -> Any:
    """Import the module that holds ``name`` on first use, then keep the name here."""
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_WHERE})


__all__ = [
    "AGENT_LABEL",
    "AGENT_PORT",
    "DEFAULT_REGION",
    "ENV_NODE_IP",
    "EXIT_CODE_HELP",
    "INVENTORY_ANNOTATION",
    "RESERVE_PATH",
    "TOP_NAMES",
    "WARM_LABEL_PREFIX",
    "WIPE_PATH",
    "ArgsError",
    "ExitCode",
    "HeldRevision",
    "Inventory",
    "ManifestEntry",
    "ObjectVersion",
    "PeersAnswer",
    "PeersRequest",
    "Pin",
    "ReserveAnswer",
    "ReserveRequest",
    "RevisionHasher",
    "RevisionRef",
    "Selection",
    "StageArgs",
    "StageSummary",
    "VersionPicker",
    "WipeArgs",
    "WipeRequest",
    "WipeSummary",
    "build_parser",
    "cache_digest",
    "cache_dir",
    "complete_path",
    "data_dir",
    "data_subpath",
    "format_as_of",
    "human_bytes",
    "journal_path",
    "lease_dir",
    "lease_path",
    "leases_root",
    "lock_path",
    "manifest_path",
    "meta_dir",
    "meta_subpath",
    "normalize_etag",
    "normalize_key",
    "page_versions",
    "parse_as_of",
    "parse_source",
    "parse_warm_label",
    "pin",
    "resolve_addressing_style",
    "resolve_region",
    "revision_dir",
    "revisions_root",
    "selected",
    "tmp_dir",
    "validate_pod_uid",
    "validate_revision",
    "warm_label",
]
