"""Command line of ``dscache-stage``."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from .errors import EXIT_CODES, StageError, UsageError
from .keys import Filters
from .progress import Progress
from .source import S3Source
from .sync import SyncOptions, default_concurrency, sync
from .wipe import wipe

DEFAULT_TERMINATION_LOG = "/dev/termination-log"


def _parser() -> argparse.ArgumentParser:
    codes = "\n".join(f"  {code}  {text}" for code, text in EXIT_CODES.items())
    p = argparse.ArgumentParser(
        prog="dscache-stage",
        description="Stage an S3 prefix onto local disk before training starts, or wipe a staged copy.",
        epilog=f"exit codes:\n{codes}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("sync", help="make DEST an exact copy of s3://BUCKET/PREFIX",
                       epilog=f"exit codes:\n{codes}", formatter_class=argparse.RawDescriptionHelpFormatter)
    s.add_argument("source", metavar="s3://BUCKET/PREFIX")
    s.add_argument("dest", metavar="DEST", type=Path)
    s.add_argument("--endpoint-url", help="S3-compatible endpoint (MinIO, Ceph RGW, OBS, OSS...)")
    s.add_argument("--region", help="bucket region (default: AWS_REGION, else us-east-1)")
    s.add_argument("--addressing-style", choices=["path", "virtual"],
                   help="default: path with --endpoint-url, virtual otherwise")
    s.add_argument("--include", action="append", default=[], metavar="GLOB",
                   help="copy only keys (relative to PREFIX) matching a GLOB; repeatable")
    s.add_argument("--exclude", action="append", default=[], metavar="GLOB",
                   help="skip keys (relative to PREFIX) matching a GLOB; repeatable; wins over --include")
    s.add_argument("--concurrency", type=int, default=default_concurrency(), metavar="N",
                   help="requests in flight (default: %(default)s on this machine)")
    s.add_argument("--termination-log", metavar="PATH",
                   help=f"where the final line also goes (default: {DEFAULT_TERMINATION_LOG} if it exists)")
    s.add_argument("--progress-interval", type=float, default=3.0, metavar="SECONDS")

    w = sub.add_parser("wipe", help="delete DIR, only if it lies inside ROOT, never following symlinks")
    w.add_argument("dir", metavar="DIR")
    w.add_argument("--root", required=True, metavar="ROOT")
    w.add_argument("--termination-log", metavar="PATH")
    return p


def entry() -> None:
    """Console-script entry: run, flush, and leave without interpreter teardown.

    obstore's Rust runtime keeps worker threads; tearing the interpreter down
    under them aborts the process now and then (SIGABRT after the work is
    done and reported). Everything is written and flushed by then, so skip it.
    """
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    log = args.termination_log or (DEFAULT_TERMINATION_LOG if os.path.exists(DEFAULT_TERMINATION_LOG) else None)
    try:
        if args.command == "sync":
            result = _sync(args)
        else:
            removed = wipe(args.dir, args.root)
            result = {"wiped": args.dir, "existed": removed}
    except StageError as e:
        return _fail(log, e.exit_code, str(e))
    except KeyboardInterrupt:
        return _fail(log, 130, "interrupted")
    except Exception as e:  # noqa: BLE001 - a bug; still leave a reason behind
        import traceback

        traceback.print_exc()
        return _fail(log, 1, f"internal error: {type(e).__name__}: {e}")
    line = json.dumps(result)
    print(line, flush=True)
    _write_log(log, line)
    return 0


def _sync(args: argparse.Namespace) -> dict:
    if args.concurrency < 1:
        raise UsageError(f"--concurrency must be at least 1, got {args.concurrency}")
    source = S3Source.parse(args.source, endpoint_url=args.endpoint_url, region=args.region,
                            addressing_style=args.addressing_style)
    opts = SyncOptions(source=source, dest=args.dest.absolute(),
                       filters=Filters(include=args.include, exclude=args.exclude),
                       concurrency=args.concurrency, progress_interval=args.progress_interval)
    progress = Progress()
    progress.note(f"syncing {source.uri} -> {opts.dest} ({opts.concurrency} requests in flight)")
    return sync(opts, progress).to_dict()


def _fail(log: str | None, code: int, message: str) -> int:
    line = f"error: {message}"
    print(f"dscache-stage: {line}", file=sys.stderr, flush=True)
    _write_log(log, line)
    return code


def _write_log(path: str | None, line: str) -> None:
    if not path:
        return
    try:
        with open(path, "w") as f:
            f.write(line[:4000] + "\n")  # the kubelet keeps at most 4096 bytes
    except OSError as e:
        print(f"dscache-stage: cannot write termination log {path}: {e.strerror}", file=sys.stderr)
