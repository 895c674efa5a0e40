"""The stager's command line, as types that both build and parse it.

The webhook builds the init container's args with ``StageArgs(...).to_argv()``
and the operator the wipe helper's with ``WipeArgs(...).to_argv()``; the
stager parses them with ``from_argv`` through the same ``build_parser``, so the
two sides cannot drift (tests/unit/test_contract.py round-trips them).
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass, field
from typing import Any, NoReturn

from .names import STAGE_MOUNT_PATH
from .paths import validate_pod_uid, validate_revision
from .selection import parse_source
from .summary import EXIT_CODE_HELP


class ArgsError(ValueError):
    """The argv does not parse; the message says what is wrong."""


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """argparse's own, sized as it sizes itself, but without importing shutil for it.

    Every add_argument builds a formatter, and argparse's asks shutil for the
    terminal's width: importing shutil loads zlib, bz2 and lzma, ~7 ms of a
    stager's start (issue 30), which prints no help.
    """

    def __init__(
        self,
        prog: str,
        indent_increment: int = 2,
        max_help_position: int = 24,
        width: int | None = None,
        **kwargs: Any,  # what newer argparse versions add
    ) -> None:
        width = _columns() - 2 if width is None else width
        super().__init__(prog, indent_increment, max_help_position, width, **kwargs)


def _columns() -> int:
    """The terminal's width as shutil.get_terminal_size() finds it: $COLUMNS, stdout's terminal, 80."""
    try:
        columns = int(os.environ["COLUMNS"])
    except (KeyError, ValueError):
        columns = 0
    if columns <= 0:
        try:
            columns = os.get_terminal_size(sys.__stdout__.fileno()).columns  # type: ignore[union-attr]
        except (AttributeError, ValueError, OSError):
            columns = 0
    return columns if columns > 0 else 80


class _Parser(argparse.ArgumentParser):
    # Raise instead of exiting, so callers (and the stager) decide what happens.
    def error(self, message: str) -> NoReturn:
        raise ArgsError(f"{self.prog}: {message}")


def _exit_codes() -> str:
    return "exit codes:\n" + "\n".join(f"  {int(c):>3}  {text}" for c, text in EXIT_CODE_HELP.items())


def _csv(value: str) -> list[str]:
    return [v for v in value.split(",") if v]


def build_parser() -> argparse.ArgumentParser:
    """The whole ``dscache-stage`` command line."""
    fmt = _Formatter
    p = _Parser(
        prog="dscache-stage",
        formatter_class=fmt,
        epilog=_exit_codes(),
        description="Stage a pinned revision of an S3 prefix onto the node's disk, or release and "
        "remove staged revisions.",
    )
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    def source_options(s: argparse.ArgumentParser) -> None:
        s.add_argument("source", metavar="s3://BUCKET/PREFIX")
        s.add_argument("--endpoint-url", help="S3-compatible endpoint (MinIO, Ceph RGW, OBS, OSS...)")
        s.add_argument("--region", help="bucket region (default: us-east-1; the environment is not consulted)")
        s.add_argument(
            "--addressing-style",
            choices=["path", "virtual"],
            help="default: path with --endpoint-url, virtual otherwise",
        )
        s.add_argument(
            "--include",
            action="append",
            default=[],
            metavar="GLOB",
            help="only keys (relative to PREFIX) matching a GLOB; repeatable",
        )
        s.add_argument(
            "--exclude",
            action="append",
            default=[],
            metavar="GLOB",
            help="skip keys (relative to PREFIX) matching a GLOB; repeatable; wins over --include",
        )
        s.add_argument(
            "--retry-timeout",
            type=float,
            metavar="SECONDS",
            help="keep retrying a failing S3 request this long (default: 120)",
        )

    s = sub.add_parser(
        "sync",
        formatter_class=fmt,
        epilog=_exit_codes(),
        help="stage revision REV of s3://BUCKET/PREFIX into CACHE_DIR/revs/REV",
    )
    source_options(s)
    s.add_argument("cache_dir", metavar="CACHE_DIR", help="the cache dir C (the volume's mount point)")
    s.add_argument(
        "--revision",
        required=True,
        metavar="REV",
        help="the revision the pod was admitted with (r-...); 'dscache-stage revision' prints one",
    )
    s.add_argument(
        "--as-of",
        metavar="TIME",
        help="versioned bucket: REV's versions time (YYYY-MM-DDTHH:MM:SSZ, printed with REV); per key the "
        "newest version not after TIME is staged, so overwritten or deleted objects stay served",
    )
    s.add_argument(
        "--pod-uid",
        metavar="UID",
        help="this pod's UID, for its lease on REV (default: $DSCACHE_POD_UID; none: no lease)",
    )
    s.add_argument(
        "--concurrency",
        type=int,
        metavar="N",
        help="requests in flight (default: 256; small objects' bodies are held to 64 MiB)",
    )
    s.add_argument(
        "--termination-log",
        metavar="PATH",
        help="where the final line also goes (default: /dev/termination-log if it exists)",
    )
    s.add_argument("--progress-interval", type=float, default=3.0, metavar="SECONDS")
    s.add_argument(
        "--agent",
        metavar="URL",
        help="the node agent (dscache-node) to ask for room under the node's byte budget before copying, "
        "e.g. http://$(DSCACHE_NODE_IP):9477; unset or unreachable: only free space is checked",
    )
    s.add_argument(
        "--cache",
        metavar="NAMESPACE/NAME",
        help="the DatasetCache this copy belongs to, as the agent names it (needed with --agent)",
    )
    s.add_argument(
        "--bytes",
        type=int,
        metavar="N",
        help="the revision's total size (the operator's listing): what is asked of the agent",
    )
    s.add_argument(
        "--prestage",
        action="store_true",
        help="this copy pre-stages the cache (spec.prestage): the agent evicts no other pre-staged copy "
        "and no copy in use to make room for it, and refuses it instead (needs --agent)",
    )
    s.add_argument(
        "--peer-token-file",
        metavar="PATH",
        help="the pod's projected token for the agents (needs --agent): objects other nodes hold or are copying are taken "
        "from them, verified, and the bucket serves each object once per cluster; missing or empty file: "
        "everything comes from the bucket",
    )
    s.add_argument(
        "--cohort",
        action="store_true",
        help="this pod starts together with pods on other nodes (a JobSet, a PyTorchJob, a parallel Job; "
        "needs --peer-token-file): a node that sees no other one yet looks again a moment later before it "
        "lists the bucket, so the gang lists it once; without it a lone node lists at once",
    )

    w = sub.add_parser(
        "wipe",
        formatter_class=fmt,
        epilog=_exit_codes(),
        help="release leases, then remove a revision (or the whole cache dir) nobody holds, "
        "or the copy that predates revisions",
    )
    w.add_argument("cache_dir", metavar="CACHE_DIR")
    w.add_argument("--root", required=True, metavar="ROOT", help="the node's cache root; nothing outside is touched")
    which = w.add_mutually_exclusive_group(required=True)
    which.add_argument("--revision", metavar="REV", help="remove CACHE_DIR/revs/REV once no lease holds it")
    which.add_argument("--all", action="store_true", help="remove CACHE_DIR once no lease at all remains")
    which.add_argument(
        "--legacy",
        action="store_true",
        help="remove the top-level entries of CACHE_DIR that predate revisions (a version 1 copy: "
        "everything but lock, revs/ and leases/); the operator asks only once no pod reads them",
    )
    w.add_argument(
        "--release",
        type=_csv,
        action="extend",
        default=[],
        metavar="UID[,UID...]",
        help="lease files to delete first (pods known to be finished); repeatable",
    )
    w.add_argument("--termination-log", metavar="PATH")

    r = sub.add_parser(
        "revision",
        formatter_class=fmt,
        help="list the source and print its current revision id, objects and bytes (JSON)",
    )
    source_options(r)
    return p


def _opt(argv: list[str], flag: str, value: object) -> None:
    if value is not None:
        argv += [flag, str(value)]


@dataclass(frozen=True)
class StageArgs:
    """``dscache-stage sync`` as one value."""

    source: str
    revision: str
    cache_dir: str = STAGE_MOUNT_PATH
    as_of: str | None = None
    pod_uid: str | None = None
    endpoint_url: str | None = None
    region: str | None = None
    addressing_style: str | None = None
    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    concurrency: int | None = None
    termination_log: str | None = None
    progress_interval: float = 3.0
    retry_timeout: float | None = None
    agent: str | None = None
    cache: str | None = None
    bytes: int | None = None
    peer_token_file: str | None = None
    prestage: bool = False
    cohort: bool = False

    def __post_init__(self) -> None:
        if self.peer_token_file is not None and self.agent is None:
            raise ArgsError("--peer-token-file needs --agent (peers are found through the node agent)")
        if self.cohort and self.peer_token_file is None:
            raise ArgsError("--cohort needs --peer-token-file (it is about peers starting together)")
        if self.agent is not None and (self.cache is None or self.cache.count("/") != 1):
            raise ArgsError(f"--agent needs --cache NAMESPACE/NAME, got {self.cache!r}")
        try:
            parse_source(self.source)
            validate_revision(self.revision)
            if self.as_of is not None:
                from .versions import parse_as_of  # only with --as-of: a cold start does without it

                parse_as_of(self.as_of)
            # $(DSCACHE_POD_UID) is expanded by the kubelet; check what reaches the stager.
            if self.pod_uid is not None and not self.pod_uid.startswith("$("):
                validate_pod_uid(self.pod_uid)
        except ValueError as e:
            raise ArgsError(str(e)) from e
        if self.concurrency is not None and self.concurrency < 1:
            raise ArgsError(f"--concurrency must be at least 1, got {self.concurrency}")
        if self.addressing_style not in (None, "path", "virtual"):
            raise ArgsError(f"--addressing-style must be path or virtual, got {self.addressing_style!r}")
        object.__setattr__(self, "include", tuple(self.include))
        object.__setattr__(self, "exclude", tuple(self.exclude))

    def to_argv(self) -> list[str]:
        """The container args (after the command ``dscache-stage``)."""
        argv = ["sync", self.source, self.cache_dir, "--revision", self.revision]
        _opt(argv, "--as-of", self.as_of)
        _opt(argv, "--pod-uid", self.pod_uid)
        _opt(argv, "--endpoint-url", self.endpoint_url)
        _opt(argv, "--region", self.region)
        _opt(argv, "--addressing-style", self.addressing_style)
        # "--include=GLOB": a glob may start with '-' and must not read as an option.
        argv += [f"--include={g}" for g in self.include]
        argv += [f"--exclude={g}" for g in self.exclude]
        _opt(argv, "--concurrency", self.concurrency)
        _opt(argv, "--termination-log", self.termination_log)
        if self.progress_interval != 3.0:
            argv += ["--progress-interval", repr(self.progress_interval)]
        if self.retry_timeout is not None:
            argv += ["--retry-timeout", repr(self.retry_timeout)]
        _opt(argv, "--agent", self.agent)
        _opt(argv, "--cache", self.cache)
        _opt(argv, "--bytes", self.bytes)
        _opt(argv, "--peer-token-file", self.peer_token_file)
        if self.prestage:
            argv.append("--prestage")
        if self.cohort:
            argv.append("--cohort")
        return argv

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace) -> StageArgs:
        return cls(
            source=ns.source,
            revision=ns.revision,
            cache_dir=ns.cache_dir,
            as_of=ns.as_of,
            pod_uid=ns.pod_uid,
            endpoint_url=ns.endpoint_url,
            region=ns.region,
            addressing_style=ns.addressing_style,
            include=tuple(ns.include),
            exclude=tuple(ns.exclude),
            concurrency=ns.concurrency,
            termination_log=ns.termination_log,
            progress_interval=ns.progress_interval,
            retry_timeout=ns.retry_timeout,
            agent=ns.agent,
            cache=ns.cache,
            bytes=ns.bytes,
            peer_token_file=ns.peer_token_file,
            prestage=ns.prestage,
            cohort=ns.cohort,
        )

    @classmethod
    def from_argv(cls, argv: list[str]) -> StageArgs:
        ns = build_parser().parse_args(argv)
        if ns.command != "sync":
            raise ArgsError(f"expected a sync command line, got {ns.command!r}")
        return cls.from_namespace(ns)


@dataclass(frozen=True)
class WipeArgs:
    """``dscache-stage wipe`` as one value: exactly one of ``revision``, ``all_revisions``
    or ``legacy`` (the version 1 copy at the top of the cache dir; it has no leases)."""

    cache_dir: str
    root: str
    revision: str | None = None
    all_revisions: bool = False
    release: tuple[str, ...] = field(default=())
    termination_log: str | None = None
    legacy: bool = False

    def __post_init__(self) -> None:
        if (self.revision is not None) + self.all_revisions + self.legacy != 1:
            raise ArgsError("wipe needs exactly one of --revision REV, --all or --legacy")
        if self.legacy and self.release:
            raise ArgsError("wipe --legacy takes no --release: a version 1 copy has no leases")
        try:
            if self.revision is not None:
                validate_revision(self.revision)
            for uid in self.release:
                validate_pod_uid(uid)
        except ValueError as e:
            raise ArgsError(str(e)) from e
        object.__setattr__(self, "release", tuple(self.release))

    def to_argv(self) -> list[str]:
        argv = ["wipe", self.cache_dir, "--root", self.root]
        if self.revision is not None:
            argv += ["--revision", self.revision]
        else:
            argv.append("--legacy" if self.legacy else "--all")
        if self.release:
            argv += ["--release", ",".join(self.release)]
        _opt(argv, "--termination-log", self.termination_log)
        return argv

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace) -> WipeArgs:
        return cls(
            cache_dir=ns.cache_dir,
            root=ns.root,
            revision=ns.revision,
            all_revisions=ns.all,
            release=tuple(ns.release),
            termination_log=ns.termination_log,
            legacy=ns.legacy,
        )

    @classmethod
    def from_argv(cls, argv: list[str]) -> WipeArgs:
        ns = build_parser().parse_args(argv)
        if ns.command != "wipe":
            raise ArgsError(f"expected a wipe command line, got {ns.command!r}")
        return cls.from_namespace(ns)
