"""Command line of ``dscache-stage``; the parser is the contract's (dscache_contract.build_parser)."""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
from collections.abc import Callable
from typing import Any, TypeVar

from dscache_contract import (
    ENV_POD_UID,
    TERMINATION_LOG,
    ArgsError,
    ExitCode,
    Selection,
    StageArgs,
    StageSummary,
    WipeArgs,
    build_parser,
)

from .errors import StageError, UsageError
from .progress import Progress
from .source import S3Source, roots_from_one_file

T = TypeVar("T")


def entry() -> None:
    """Console-script entry: run, flush, and leave without interpreter teardown.

    obstore's Rust runtime keeps worker threads; tearing the interpreter down
    under them aborts the process now and then (SIGABRT after the work is
    done and reported). Everything is written and flushed by then, so skip it.
    """
    # Start-up allocates what lives as long as the process (modules, classes, the parser), yet
    # the collector ran 46 times over a cold start's imports for ~550 objects of garbage (issue
    # 30: ~4 ms of CPU). stage.sync turns it back on once the cold path's modules are in
    # (gc_from_here); a warm start ends first; the other commands (wipe, revision: whole trees
    # and listings) get it back once parsed (main).
    gc.disable()
    code = main(owns_process=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(argv: list[str] | None = None, *, owns_process: bool = False) -> int:
    """Run one command; ``owns_process``: this is dscache-stage's own process (entry), whose
    environment it may adjust (source.roots_from_one_file), not a caller's (tests)."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        ns = build_parser().parse_args(argv)
    except ArgsError as e:
        print(f"{e}\nrun 'dscache-stage --help' for the synopsis", file=sys.stderr, flush=True)
        log = _log_from_argv(argv)
        _write_log(log, f"error: {e}")
        return ExitCode.USAGE
    log = getattr(ns, "termination_log", None) or (TERMINATION_LOG if os.path.exists(TERMINATION_LOG) else None)
    if ns.command != "sync":
        gc.enable()  # entry's start-up pause is for sync's cold start only
    try:
        if ns.command == "sync":
            line = _sync(ns, owns_process).to_json()
        elif ns.command == "wipe":
            from .wipe import wipe

            line = wipe(_args(WipeArgs.from_namespace, ns)).to_json()
        else:
            line = json.dumps(_revision(ns))
    except StageError as e:
        return _fail(log, e.exit_code, str(e))
    except KeyboardInterrupt:
        return _fail(log, ExitCode.INTERRUPTED, "interrupted")
    except Exception as e:
        import traceback

        traceback.print_exc()
        return _fail(log, ExitCode.INTERNAL, f"internal error: {type(e).__name__}: {e}")
    print(line, flush=True)
    _write_log(log, line)
    return ExitCode.OK


def _args(build: Callable[[argparse.Namespace], T], ns: argparse.Namespace) -> T:
    try:
        return build(ns)
    except ArgsError as e:
        raise UsageError(str(e)) from e


def _source(ns: argparse.Namespace) -> S3Source:
    return S3Source.parse(
        ns.source,
        endpoint_url=ns.endpoint_url,
        region=ns.region,
        addressing_style=ns.addressing_style,
        **({"retry_timeout": ns.retry_timeout} if getattr(ns, "retry_timeout", None) else {}),
    )


def _sync(ns: argparse.Namespace, owns_process: bool = False) -> StageSummary:
    from .stage import sync
    from .sync_options import SyncOptions, default_concurrency

    args: StageArgs = _args(StageArgs.from_namespace, ns)
    pod_uid = args.pod_uid or os.environ.get(ENV_POD_UID) or None
    if pod_uid and pod_uid.startswith("$("):
        raise UsageError(
            f"--pod-uid {pod_uid} was not expanded: set env {ENV_POD_UID} from the downward "
            f"API (fieldRef metadata.uid) in the stager container"
        )
    if pod_uid:
        from dscache_contract import validate_pod_uid

        try:
            validate_pod_uid(pod_uid)
        except ValueError as e:
            raise UsageError(str(e)) from e
    opts = SyncOptions(
        source=_source(ns),
        cache_dir=os.path.abspath(args.cache_dir),
        revision=args.revision,
        as_of=args.as_of,
        pod_uid=pod_uid,
        include=args.include,
        exclude=args.exclude,
        concurrency=args.concurrency or default_concurrency(),
        progress_interval=args.progress_interval,
        agent=args.agent,
        cache=args.cache,
        bytes=args.bytes,
        peer_token_file=args.peer_token_file,
        prestage=args.prestage,
        cohort=args.cohort,
    )
    if owns_process:
        roots_from_one_file(opts.source)  # before any thread starts: it sets the environment
    return sync(opts, Progress())


def _revision(ns: argparse.Namespace) -> dict[str, Any]:
    from .sync import current_revision

    source = _source(ns)
    return current_revision(source, Selection(source.prefix, tuple(ns.include), tuple(ns.exclude)))


def _log_from_argv(argv: list[str]) -> str | None:
    for i, a in enumerate(argv):
        if a == "--termination-log" and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith("--termination-log="):
            return a.split("=", 1)[1]
    return TERMINATION_LOG if os.path.exists(TERMINATION_LOG) else None


def _fail(log: str | None, code: int, message: str) -> int:
    line = f"error: {message}"
    print(f"dscache-stage: {line}", file=sys.stderr, flush=True)
    _write_log(log, line)
    return int(code)


def _write_log(path: str | None, line: str) -> None:
    if not path:
        return
    try:
        with open(path, "w") as f:
            f.write(line[:4000] + "\n")  # the kubelet keeps at most 4096 bytes
    except OSError as e:
        print(f"dscache-stage: cannot write termination log {path}: {e.strerror}", file=sys.stderr)
