#!/usr/bin/env python3
"""Benchmark dscache-stage against s5cmd, rclone, aws-cli and dd, in one run.

Everything runs against one real S3 server (versitygw) on loopback, writing
to the same disk. Each tool's destination is emptied and the page cache's
dirty data flushed (untimed) before every timed run; tools rotate within a
round so slow drift of the machine hits them all alike. Seconds are medians.

dscache stages a pinned revision: the bench asks `dscache-stage revision` for
it once (untimed), as the operator would. Every dscache result is verified
byte for byte (sha256 against the generated source) and against its summary:
the cold small run, the warm run (which must report warm: no listing) and the
large run.

The last line printed is one JSON object (see the issue for the fields):
small_s / large_s / dd_s / warm_s as before, plus cold_s (dscache's cold copy
of the small set, the same number as small_s.dscache) and warm_speedup.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.support.s3server import S3Server  # noqa: E402
from tests.support.tools import tool_bin  # noqa: E402

BUCKET = "bench"


def log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def make_source(root: Path, count: int, size: int, large_count: int, large_size: int) -> tuple[Path, dict[str, str]]:
    """Files to upload: small/ spread over 100 dirs, large/ a few big ones; and {key: sha256}."""
    src = root / "src"
    digests: dict[str, str] = {}
    block = os.urandom(max(size, 1 << 20))
    for i in range(count):
        d = src / "small" / f"d{i % 100:03d}"
        d.mkdir(parents=True, exist_ok=True)
        # Distinct content per file, cheaply.
        body = i.to_bytes(8, "little") + block[8:size]
        (d / f"f{i:06d}.bin").write_bytes(body)
        digests[f"small/d{i % 100:03d}/f{i:06d}.bin"] = hashlib.sha256(body).hexdigest()
    (src / "large").mkdir(parents=True, exist_ok=True)
    chunk = os.urandom(16 << 20)
    for j in range(large_count):
        h = hashlib.sha256()
        with open(src / "large" / f"blob{j}.bin", "wb") as f:
            for off in range(0, large_size, len(chunk)):
                piece = j.to_bytes(8, "little") + chunk[8 : min(len(chunk), large_size - off)]
                f.write(piece)
                h.update(piece)
        digests[f"large/blob{j}.bin"] = h.hexdigest()
    return src, digests


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def verify_dscache(dest: Path, revision: str, prefix: str, digests: dict[str, str], summary: dict, warm: bool) -> None:
    """The staged revision holds exactly the source's bytes, and the summary says what happened."""
    data = dest / "revs" / revision / "data"
    want = {k[len(prefix) + 1 :]: v for k, v in digests.items() if k.startswith(prefix + "/")}
    got = {}
    for root, _, files in os.walk(data):
        for f in files:
            p = os.path.join(root, f)
            got[os.path.relpath(p, data)] = sha256_file(p)
    if got != want:
        bad = sorted(set(got) ^ set(want) | {k for k in got if got.get(k) != want.get(k)})[:5]
        raise RuntimeError(f"dscache {prefix} ({'warm' if warm else 'cold'}): tree differs from the source: {bad}")
    if (summary.get("warm"), summary.get("revision"), summary.get("objects")) != (warm, revision, len(want)):
        raise RuntimeError(f"dscache {prefix}: unexpected summary {summary}")
    if warm and summary.get("fetched_bytes") != 0:
        raise RuntimeError(f"dscache warm run fetched data: {summary}")


class Tools:
    def __init__(self, server: S3Server, env: dict[str, str]) -> None:
        self.ep = server.endpoint
        self.env = env
        self.s5cmd = str(tool_bin("s5cmd") / "s5cmd")
        self.stage = shutil.which("dscache-stage") or str(Path(sys.executable).parent / "dscache-stage")
        self.aws = shutil.which("aws") or str(Path(sys.executable).parent / "aws")
        self.rclone = shutil.which("rclone")

    def revision(self, prefix: str) -> str:
        out = subprocess.run(
            [self.stage, "revision", f"s3://{BUCKET}/{prefix}", "--endpoint-url", self.ep],
            env=self.env,
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        return json.loads(out)["revision"]

    def command(
        self,
        tool: str,
        prefix: str,
        dest: Path,
        large_size: int = 0,
        large_count: int = 0,
        revision: str = "",
        pod: str = "bench",
    ) -> list[str]:
        uri = f"s3://{BUCKET}/{prefix}"
        if tool in ("dscache", "warm"):
            return [
                self.stage,
                "sync",
                uri,
                str(dest),
                "--revision",
                revision,
                "--pod-uid",
                pod,
                "--endpoint-url",
                self.ep,
                "--progress-interval",
                "60",
            ]
        if tool == "s5cmd":
            return [self.s5cmd, "--endpoint-url", self.ep, "cp", f"{uri}/*", f"{dest}/"]
        if tool == "awscli":
            return [self.aws, "s3", "sync", uri, str(dest), "--endpoint-url", self.ep, "--only-show-errors"]
        if tool == "rclone":
            return [
                self.rclone,
                "copy",
                f":s3:{BUCKET}/{prefix}",
                str(dest),
                "--s3-provider",
                "Other",
                "--s3-endpoint",
                self.ep,
                "--s3-access-key-id",
                self.env["AWS_ACCESS_KEY_ID"],
                "--s3-secret-access-key",
                self.env["AWS_SECRET_ACCESS_KEY"],
                "--s3-region",
                "us-east-1",
                "--s3-force-path-style",
            ]
        if tool in ("dd", "dd-fdatasync"):
            # "dd": the plain sequential write (into the page cache, as the
            # other tools' writes are). "dd-fdatasync": the disk itself.
            mib = large_size >> 20
            sync = " conv=fdatasync" if tool == "dd-fdatasync" else ""
            return [
                "bash",
                "-c",
                " && ".join(
                    f"dd if=/dev/zero of={dest}/blob{j}.bin bs=1M count={mib} status=none{sync}"
                    for j in range(large_count)
                ),
            ]
        raise ValueError(tool)


def timed(cmd: list[str], env: dict[str, str]) -> tuple[float, str]:
    """Seconds, and the last stdout line (dscache's summary)."""
    t = time.perf_counter()
    proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    dt = time.perf_counter() - t
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd[0]} failed ({proc.returncode}): {proc.stderr[-2000:]}")
    lines = proc.stdout.strip().splitlines()
    return dt, lines[-1] if lines else ""


def fresh(dest: Path) -> None:
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    os.sync()  # flush earlier runs' dirty pages outside the timed region


def tree_bytes(dest: Path) -> tuple[int, int]:
    n = b = 0
    for root, dirs, files in os.walk(dest):
        for f in files:
            n += 1
            b += os.lstat(os.path.join(root, f)).st_size
    return n, b


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smaller data set (well under 10 minutes)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--small-count", type=int)
    ap.add_argument("--small-size", type=int, default=64 << 10)
    ap.add_argument("--large-count", type=int, default=2)
    ap.add_argument("--large-size", type=int)
    ap.add_argument("--peers", default="s5cmd,rclone,awscli", help="comma list of peer tools for the small set")
    ap.add_argument("--workdir", type=Path, help="default: a temp dir under build/")
    args = ap.parse_args()
    small_count = args.small_count or (5000 if args.quick else 20000)
    large_size = args.large_size or ((256 << 20) if args.quick else (1 << 30))

    (REPO / "build").mkdir(exist_ok=True)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="bench-", dir=REPO / "build"))
    server = S3Server(root=work / "s3root").start()
    env = {**os.environ, **server.env}
    # The endpoint is plain http; rclone's AWS SDK refuses to start with a CA bundle set.
    env.pop("AWS_CA_BUNDLE", None)
    try:
        tools = Tools(server, env)
        peers = [p for p in args.peers.split(",") if p]
        if "rclone" in peers and not tools.rclone:
            log("rclone not found (apt-get install rclone); leaving it out")
            peers.remove("rclone")
        log(f"generating {small_count} x {args.small_size} B and {args.large_count} x {large_size} B")
        src, digests = make_source(work, small_count, args.small_size, args.large_count, large_size)
        server.make_bucket(BUCKET)
        t = time.perf_counter()
        subprocess.run(
            [tools.s5cmd, "--endpoint-url", server.endpoint, "cp", f"{src}/*", f"s3://{BUCKET}/"],
            env=env,
            check=True,
            stdout=subprocess.DEVNULL,
        )
        log(f"uploaded in {time.perf_counter() - t:.1f}s")
        shutil.rmtree(src)
        revs = {p: tools.revision(p) for p in ("small", "large")}
        log(f"revisions (as the operator pins them): {revs}")

        small: dict[str, list[float]] = {t: [] for t in ["dscache", *peers]}
        warm: list[float] = []
        large: dict[str, list[float]] = {"dscache": [], "s5cmd": [], "dd": [], "dd-fdatasync": []}
        for r in range(args.runs):
            order = list(small)[r % len(small) :] + list(small)[: r % len(small)]
            for tool in order:
                dest = work / "dest" / tool
                fresh(dest)
                dt, out = timed(tools.command(tool, "small", dest, revision=revs["small"], pod=f"cold-{r}"), env)
                n, b = tree_bytes(dest / "revs" / revs["small"] / "data" if tool == "dscache" else dest)
                if (n, b) != (small_count, small_count * args.small_size):
                    raise RuntimeError(
                        f"{tool} copied {n} files / {b} B, expected {small_count} / {small_count * args.small_size}"
                    )
                small[tool].append(dt)
                log(f"small run {r + 1} {tool}: {dt:.2f}s ({small_count / dt:.0f} obj/s)")
                if tool == "dscache":
                    verify_dscache(dest, revs["small"], "small", digests, json.loads(out), warm=False)
                    # A second pod of the same revision on the same node.
                    dt, out = timed(tools.command("warm", "small", dest, revision=revs["small"], pod=f"warm-{r}"), env)
                    verify_dscache(dest, revs["small"], "small", digests, json.loads(out), warm=True)
                    warm.append(dt)
                    log(f"small run {r + 1} dscache warm: {dt:.3f}s (verified: no listing, same bytes)")
            for tool in list(large)[r % len(large) :] + list(large)[: r % len(large)]:
                dest = work / "dest" / f"large-{tool}"
                fresh(dest)
                dt, out = timed(
                    tools.command(tool, "large", dest, large_size, args.large_count, revision=revs["large"]), env
                )
                if tool == "dscache":
                    verify_dscache(dest, revs["large"], "large", digests, json.loads(out), warm=False)
                large[tool].append(dt)
                log(f"large run {r + 1} {tool}: {dt:.2f}s ({args.large_count * large_size / dt / 1e6:.0f} MB/s)")
            shutil.rmtree(work / "dest")
    finally:
        server.stop()
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)

    med = {k: round(statistics.median(v), 3) for k, v in small.items()}
    lmed = {k: round(statistics.median(v), 3) for k, v in large.items()}
    result = {
        "small_objects": small_count,
        "small_bytes": small_count * args.small_size,
        "small_s": med,
        "large_bytes": args.large_count * large_size,
        "large_s": {"dscache": lmed["dscache"], "s5cmd": lmed["s5cmd"]},
        "dd_s": lmed["dd"],
        "warm_s": round(statistics.median(warm), 3),
        "cold_s": med["dscache"],
        "warm_runs_s": [round(w, 3) for w in warm],
    }
    result["warm_speedup"] = round(med["dscache"] / result["warm_s"], 1)
    log(
        f"small: dscache is {med['s5cmd'] / med['dscache']:.2f}x s5cmd (target 1.5)"
        + (f", {med['awscli'] / med['dscache']:.1f}x aws-cli (target 5)" if "awscli" in med else "")
    )
    log(
        f"large: {lmed['s5cmd'] / lmed['dscache']:.2f}x s5cmd (target 0.9), {lmed['dd'] / lmed['dscache']:.2f}x dd (target 0.8); "
        f"{lmed['dd-fdatasync'] / lmed['dscache']:.2f}x dd with fdatasync ({lmed['dd-fdatasync']}s, the disk itself)"
    )
    log(
        f"warm: {result['warm_speedup']}x faster than cold at {small_count} objects "
        f"({result['warm_s']}s vs {med['dscache']}s; target 50)"
    )
    log(f"load average at the end: {os.getloadavg()[0]:.1f} (noise from other work on the machine)")
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
