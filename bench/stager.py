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

Profiles (issue 9):
 - ``loopback``: the server on 127.0.0.1, as always;
 - ``wan``: the same server behind toxiproxy (Shopify's, in Go, built here
   through the Go module proxy) adding ~20 ms of round trip, half on each
   direction's data; small files only: what decides speed against real S3 is
   requests in flight and connection reuse. The proxy is a third party whose
   cost is its own process's, not the benchmark's (issue 18: our own Python
   proxy spent CPU per connection on the shared cores, which lowered s5cmd's
   figure, as it opens a connection per request); wan still reports the
   proxy's and the server's CPU per object and each tool's connections, read
   from toxiproxy's log;
 - ``--scale``: 1,000,000 x 1 KiB objects, written straight onto versitygw's
   posix backend (a file plus its ``user.etag`` xattr is all it needs for an
   object; the API would take an hour), then dscache cold, warm, s5cmd, and
   the operator's source check (its real code, in a child process).

Every tool runs as a child process; its CPU (user + sys) and peak RSS come
from its own rusage (os.wait4), so those figures do not depend on how busy
the shared 2-core machine is. Wall times do: compare tools within one run,
and read the load averages printed with each profile.

The last line printed is one JSON object (see the issue for the fields):
small_s / large_s / dd_s / warm_s as before, plus cold_s (dscache's cold copy
of the small set, the same number as small_s.dscache) and warm_speedup, and
now wan (with its own server_cpu_ms_per_1k_small, proxy_cpu_ms_per_1k_small and
connections), cpu_ms_per_1k_small, cpu_s_per_gib, peak_rss_mib,
server_cpu_ms_per_1k_small, loadavg and scale.
The fixed set (one 1 KiB object) adds to fixed_s and fixed_cpu_s the same
runs with the page cache kept (fixed_cached_s, fixed_cached_cpu_s) and what
each tool read from disk after the drop (fixed_read_mib: its own binaries,
shared objects and modules).
"""

from __future__ import annotations

import argparse
import dataclasses
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

from bench import shipped  # noqa: E402
from bench.procstat import cpu_seconds  # noqa: E402
from dscache_stager.fetch import PART_SIZE, SPLICE_THREADS  # noqa: E402
from tests.support.s3server import S3Server  # noqa: E402
from tests.support.tools import tool_bin  # noqa: E402
from tests.support.toxiproxy import ToxiProxy  # noqa: E402

BUCKET = "bench"
# dscache's two data planes (issue 18): "dscache" is what ships (the native
# plane, dscache_native, when installed), "dscache_python" the pure-Python
# fallback (DSCACHE_NATIVE=0), measured in the same run.
DSCACHE_TOOLS = ("dscache", "dscache_python")
# Opt-in variants of the native plane, named as peers (--peers s5cmd,dscache_rename):
# "dscache_rename" places small objects by temp file + rename in tmp/, as before issue 30
# (DSCACHE_NATIVE_TMPFILE=0), for a same-run comparison with what ships; "dscache_proclink"
# links them through /proc/self/fd (DSCACHE_NATIVE_LINK=proc), as on kernels before 6.10.
# "dscache_sync" copies every revision on asyncio (DSCACHE_ONEPAGE=0), as large objects were
# before issue 30's large35 round; the large set measures it with --large-variants dscache_sync.
DSCACHE_VARIANTS = ("dscache_rename", "dscache_proclink", "dscache_sync")
STAGED = (*DSCACHE_TOOLS, *DSCACHE_VARIANTS)


def native_installed() -> bool:
    import importlib.util

    return importlib.util.find_spec("dscache_native") is not None


def tool_env(tool: str, env: dict[str, str], workers: int | None = None) -> dict[str, str]:
    """The environment a tool runs with: dscache's plane, and the native threads for the --workers sweep."""
    if tool == "dscache_python":
        return {**env, "DSCACHE_NATIVE": "0"}
    if tool == "dscache_rename":
        return {**env, "DSCACHE_NATIVE": "1", "DSCACHE_NATIVE_TMPFILE": "0"}
    if tool == "dscache_proclink":
        return {**env, "DSCACHE_NATIVE": "1", "DSCACHE_NATIVE_LINK": "proc"}
    if tool == "dscache_sync":
        return {**env, "DSCACHE_NATIVE": "1", "DSCACHE_ONEPAGE": "0"}
    if tool in ("dscache", "warm"):
        out = {**env, "DSCACHE_NATIVE": "1"}
        if workers:
            out["DSCACHE_NATIVE_WORKERS"] = str(workers)
        return out
    return env


def byte_compile() -> None:
    """Compile the stager's Python sources once, untimed, as its image does (compileall).

    Without it, a run with PYTHONDONTWRITEBYTECODE set (as here, and in the
    image) compiles every module of the stager and the contract again: about
    45 ms of CPU per run that the shipped stager never spends, billed to
    both of dscache's planes.
    """
    import importlib.util

    for name in ("dscache_stager", "dscache_contract"):
        spec = importlib.util.find_spec(name)
        for where in (spec.submodule_search_locations or []) if spec else []:
            subprocess.run([sys.executable, "-m", "compileall", "-q", where], check=True)


def log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def make_source(
    root: Path, count: int, size: int, large_count: int, large_size: int, wan_count: int = 0
) -> tuple[Path, dict[str, str]]:
    """Files to upload: small/ and wan/ spread over 100 dirs, large/ a few big ones; and {key: sha256}."""
    src = root / "src"
    digests: dict[str, str] = {}
    block = os.urandom(max(size, 1 << 20))
    for prefix, n in (("small", count), ("wan", wan_count)):
        for i in range(n):
            d = src / prefix / f"d{i % 100:03d}"
            d.mkdir(parents=True, exist_ok=True)
            # Distinct content per file, cheaply.
            body = i.to_bytes(8, "little") + prefix.encode() + block[8 + len(prefix) : size]
            (d / f"f{i:06d}.bin").write_bytes(body)
            digests[f"{prefix}/d{i % 100:03d}/f{i:06d}.bin"] = hashlib.sha256(body).hexdigest()
    # One object: what a copy costs whatever its size (start-up, access proof, listing, seal).
    (src / "tiny").mkdir(parents=True, exist_ok=True)
    (src / "tiny" / "one.bin").write_bytes(block[:1024])
    digests["tiny/one.bin"] = hashlib.sha256(block[:1024]).hexdigest()
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
    def __init__(self, server: S3Server, env: dict[str, str], stage: str | None = None) -> None:
        self.server = server
        self.ep = server.endpoint
        self.env = env
        self.s5cmd = str(tool_bin("s5cmd") / "s5cmd")
        # The stager as the image ships it (bench/shipped.py), or the venv's (--dev-stager).
        self.stage = stage or shutil.which("dscache-stage") or str(Path(sys.executable).parent / "dscache-stage")
        self.aws = shutil.which("aws") or str(Path(sys.executable).parent / "aws")
        self.rclone = shutil.which("rclone")
        # (presigned URL, start, end) of every part of the large set: the "get" peer's requests.
        self.large_parts: list[tuple[str, int, int]] = []

    def presign_large(self, large_count: int, large_size: int) -> None:
        import boto3
        from botocore.config import Config

        # SigV4 (versitygw refuses boto3's default V2 presigning), the server's own keys.
        client = boto3.client(
            "s3",
            endpoint_url=self.ep,
            region_name="us-east-1",
            aws_access_key_id=self.env["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=self.env["AWS_SECRET_ACCESS_KEY"],
            config=Config(signature_version="s3v4"),
        )
        self.large_parts = []
        for j in range(large_count):
            url = client.generate_presigned_url(
                "get_object", Params={"Bucket": BUCKET, "Key": f"large/blob{j}.bin"}, ExpiresIn=6 * 3600
            )
            self.large_parts += [(url, s, min(s + PART_SIZE, large_size)) for s in range(0, large_size, PART_SIZE)]

    def revision(self, prefix: str) -> str:
        return self.revision_info(prefix)["revision"]

    def revision_info(self, prefix: str) -> dict:
        out = subprocess.run(
            [self.stage, "revision", f"s3://{BUCKET}/{prefix}", "--endpoint-url", self.ep],
            env=self.env,
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        return json.loads(out)

    def command(
        self,
        tool: str,
        prefix: str,
        dest: Path,
        large_size: int = 0,
        large_count: int = 0,
        revision: str = "",
        pod: str = "bench",
        endpoint: str = "",
    ) -> list[str]:
        uri = f"s3://{BUCKET}/{prefix}"
        ep = endpoint or self.ep
        if tool in (*STAGED, "warm"):
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
                ep,
                "--progress-interval",
                "60",
            ]
        if tool == "s5cmd":
            return [self.s5cmd, "--endpoint-url", ep, "cp", f"{uri}/*", f"{dest}/"]
        if tool == "awscli":
            return [self.aws, "s3", "sync", uri, str(dest), "--endpoint-url", ep, "--only-show-errors"]
        if tool == "rclone":
            return [
                self.rclone,
                "copy",
                f":s3:{BUCKET}/{prefix}",
                str(dest),
                "--s3-provider",
                "Other",
                "--s3-endpoint",
                ep,
                "--s3-access-key-id",
                self.env["AWS_ACCESS_KEY_ID"],
                "--s3-secret-access-key",
                self.env["AWS_SECRET_ACCESS_KEY"],
                "--s3-region",
                "us-east-1",
                "--s3-force-path-style",
            ]
        if tool == "get":
            # The server's ceiling for the large set: the same ranged GETs the
            # stager makes (PART_SIZE parts, SPLICE_THREADS in flight, one
            # connection each), read by curl into /dev/null, so nothing is
            # written on the client side. Presigned URLs (untimed, signed
            # once per run): curl only reads.
            argv = ["curl", "-sS", "--parallel", "--parallel-max", str(SPLICE_THREADS)]
            for i, (url, start, end) in enumerate(self.large_parts):
                argv += [*(["--next"] if i else []), "-sS", "--fail", "-o", "/dev/null"]
                argv += ["-w", "%{size_download}\\n", "-r", f"{start}-{end - 1}", url]
            return argv
        if tool == "source-read":
            # The server's disk: its backing files read into /dev/null, cold
            # (the page cache is dropped before every run, as for the others).
            files = [str(self.server.root / BUCKET / "large" / f"blob{j}.bin") for j in range(large_count)]
            return ["bash", "-c", 'for f in "$@"; do dd if="$f" of=/dev/null bs=1M status=none; done', "-", *files]
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


@dataclasses.dataclass
class Run:
    seconds: float
    cpu_s: float  # user + sys of the child (and its waited-for children)
    peak_rss_mib: float
    out: str  # the last stdout line (dscache's summary)
    server_cpu_s: float = 0.0  # user + sys the S3 server spent meanwhile (small_profile)
    proxy_cpu_s: float = 0.0  # user + sys the wan profile's latency proxy spent meanwhile
    connections: int = 0  # connections the tool opened through that proxy
    err: str = ""  # the tail of stderr (dscache's control-plane CPU line)
    stdout: str = ""  # all of stdout, when run_child was asked to keep it
    read_mib: float = 0.0  # read from disk (ru_inblock): after a page-cache drop, its binaries and modules


GNU_TIME = shutil.which("time") and "/usr/bin/time"


def run_child(cmd: list[str], env: dict[str, str], keep_stdout: bool = False) -> Run:
    """Run ``cmd``; wall seconds, and CPU and peak RSS from its own rusage.

    CPU is the child's user + sys from os.wait4. Peak RSS is taken by GNU time
    around the command: a child forked from this (large) Python process
    inherits its RSS high-water mark until exec, so wait4's ru_maxrss would
    report at least the bench's own size for every tool.
    """
    fd, report = tempfile.mkstemp(prefix="bench-rusage-")
    os.close(fd)
    wrapped = [GNU_TIME, "-f", "%M", "-o", report, *cmd] if GNU_TIME else cmd
    try:
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            t = time.perf_counter()
            proc = subprocess.Popen(wrapped, env=env, stdout=out, stderr=err)
            _, status, ru = os.wait4(proc.pid, 0)
            dt = time.perf_counter() - t
            proc.returncode = os.waitstatus_to_exitcode(status)
            out.seek(0)
            err.seek(0)
            stdout, stderr = out.read().decode(errors="replace"), err.read().decode(errors="replace")
        if proc.returncode != 0:
            raise RuntimeError(f"{cmd[0]} failed ({proc.returncode}): {stderr[-2000:]}")
        with open(report) as f:
            maxrss_kib = int(f.read().split()[-1]) if GNU_TIME else ru.ru_maxrss
    finally:
        os.unlink(report)
    lines = stdout.strip().splitlines()
    return Run(
        dt,
        ru.ru_utime + ru.ru_stime,
        maxrss_kib / 1024,
        lines[-1] if lines else "",
        err=stderr[-2000:],
        stdout=stdout if keep_stdout else "",
        read_mib=ru.ru_inblock * 512 / (1 << 20),
    )


def control_cpu_s(run: Run) -> float | None:
    """The CPU dscache's event-loop thread used after start-up ("control plane: N s CPU ..."), if it said."""
    for line in reversed(run.err.splitlines()):
        if "control plane: " in line:
            return float(line.split("control plane: ", 1)[1].split()[0])
    return None


def timed(cmd: list[str], env: dict[str, str]) -> tuple[float, str]:
    """Seconds, and the last stdout line (dscache's summary)."""
    r = run_child(cmd, env)
    return r.seconds, r.out


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def fresh(dest: Path, drop: bool = True) -> None:
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    os.sync()  # flush earlier runs' dirty pages outside the timed region
    if drop:
        drop_page_cache()


def drop_page_cache() -> None:
    """Start every timed run from the same memory state: an empty page cache.

    Without it, a run's CPU depends on what ran before it. Measured with s5cmd
    alone, 5,000 x 64 KiB, three runs each: 474-892 ms per 1,000 objects when
    earlier outputs were kept, 1,239-1,333 right after deleting them (the kernel
    bills the freeing to the next writer), 501-565 with the cache dropped; in a
    rotation the tool that ran first paid up to twice what the second did. The
    server then reads the source from disk, alike for every tool. Needs root;
    without it the bench runs as before and says so once.
    """
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1")
    except OSError as e:
        if not _cache_warned:
            log(f"cannot drop the page cache ({e.strerror}): CPU figures depend on run order")
            _cache_warned.append(True)


_cache_warned: list[bool] = []  # said once per bench run


def tree_bytes(dest: Path) -> tuple[int, int]:
    n = b = 0
    for root, _dirs, files in os.walk(dest):
        for f in files:
            n += 1
            b += os.lstat(os.path.join(root, f)).st_size
    return n, b


def med(runs: list[Run], attr: str = "seconds") -> float:
    return statistics.median(getattr(r, attr) for r in runs)


def small_profile(
    tools: Tools,
    env: dict[str, str],
    work: Path,
    prefix: str,
    count: int,
    size: int,
    peers: list[str],
    runs: int,
    revision: str,
    digests: dict[str, str],
    endpoint: str = "",
    with_warm: bool = True,
    server_pid: int | None = None,
    proxy: ToxiProxy | None = None,
) -> tuple[dict[str, list[Run]], list[Run]]:
    """Every tool copies ``prefix`` ``runs`` times, rotating the order; dscache is verified, then re-run warm.
    With ``server_pid``, each run also records the CPU the S3 server spent serving it; with ``proxy``,
    the CPU of the proxy's process and the connections the tool opened through it."""
    small: dict[str, list[Run]] = {t: [] for t in [*dscache_tools(), *peers]}
    warm: list[Run] = []
    for r in range(runs):
        order = list(small)[r % len(small) :] + list(small)[: r % len(small)]
        for tool in order:
            dest = work / "dest" / tool
            fresh(dest)
            cmd = tools.command(tool, prefix, dest, revision=revision, pod=f"cold-{r}", endpoint=endpoint)
            before = cpu_seconds(server_pid) if server_pid else 0.0
            proxy_before = cpu_seconds(proxy.pid) if proxy else 0.0
            conns_before = proxy.connections() if proxy else 0
            run = run_child(cmd, tool_env(tool, env))
            if server_pid:
                run = dataclasses.replace(run, server_cpu_s=cpu_seconds(server_pid) - before)
            if proxy:
                run = dataclasses.replace(
                    run,
                    proxy_cpu_s=cpu_seconds(proxy.pid) - proxy_before,
                    connections=proxy.connections() - conns_before,
                )
            n, b = tree_bytes(dest / "revs" / revision / "data" if tool in STAGED else dest)
            if (n, b) != (count, count * size):
                raise RuntimeError(f"{tool} copied {n} files / {b} B, expected {count} / {count * size}")
            small[tool].append(run)
            log(
                f"{prefix} run {r + 1} {tool}: {run.seconds:.2f}s ({count / run.seconds:.0f} obj/s), "
                f"cpu {run.cpu_s:.2f}s ({run.cpu_s / count * 1e6:.0f} ms/1k), rss {run.peak_rss_mib:.0f} MiB"
            )
            if tool in STAGED:
                verify_dscache(dest, revision, prefix, digests, json.loads(run.out), warm=False)
            if tool == "dscache" and with_warm:
                # A second pod of the same revision on the same node.
                w = run_child(
                    tools.command("warm", prefix, dest, revision=revision, pod=f"warm-{r}"), tool_env("warm", env)
                )
                verify_dscache(dest, revision, prefix, digests, json.loads(w.out), warm=True)
                warm.append(w)
                log(f"{prefix} run {r + 1} dscache warm: {w.seconds:.3f}s (verified: no listing, same bytes)")
        shutil.rmtree(work / "dest")
    return small, warm


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="smaller data set (well under 10 minutes)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--small-count", type=int)
    ap.add_argument("--small-size", type=int, default=64 << 10)
    ap.add_argument("--large-count", type=int, default=2)
    ap.add_argument("--large-size", type=int)
    ap.add_argument(
        "--large-variants",
        default="",
        help="comma list of dscache variants also timed on the large set (dscache_sync: without onepage.py)",
    )
    ap.add_argument("--peers", default="s5cmd,rclone,awscli", help="comma list of peer tools for the small set")
    ap.add_argument("--profiles", default="loopback,wan", help="comma list: loopback, wan (empty: none)")
    ap.add_argument("--wan-count", type=int, help="small objects in the wan profile (default 3000, quick 2000)")
    ap.add_argument("--wan-peers", default="s5cmd,rclone", help="peer tools in the wan profile")
    ap.add_argument("--rtt-ms", type=float, default=20.0, help="round trip the wan profile adds")
    ap.add_argument("--scale", action="store_true", help="also run the 1M-key scale profile (long)")
    ap.add_argument("--scale-count", type=int, default=1_000_000)
    ap.add_argument("--scale-size", type=int, default=1024)
    ap.add_argument("--scale-peers", default="s5cmd", help="peer tools at scale (empty: none)")
    ap.add_argument(
        "--workers", default="1,2,4", help="native threads to sweep on the small set (comma list; empty: no sweep)"
    )
    ap.add_argument(
        "--sets",
        default="small,large,fixed",
        help="loopback sets to measure (comma list: small, large, fixed); the fields of a set left out are absent",
    )
    ap.add_argument("--workdir", type=Path, help="default: a temp dir under build/ (use /var/tmp for --scale)")
    ap.add_argument(
        "--dev-stager",
        action="store_true",
        help="measure the venv's dscache-stage (an editable install) instead of the image's layout (bench/shipped.py)",
    )
    args = ap.parse_args()
    profiles = [p for p in args.profiles.split(",") if p]
    small_count = args.small_count or (5000 if args.quick else 20000)
    large_size = args.large_size or ((256 << 20) if args.quick else (1 << 30))
    wan_count = (args.wan_count or (2000 if args.quick else 3000)) if "wan" in profiles else 0
    if "loopback" not in profiles:
        small_count = args.large_count = 0

    (REPO / "build").mkdir(exist_ok=True)
    work = args.workdir or Path(tempfile.mkdtemp(prefix="bench-", dir=REPO / "build"))
    server = S3Server(root=work / "s3root").start()
    env = {**os.environ, **server.env}
    # The endpoint is plain http; rclone's AWS SDK refuses to start with a CA bundle set.
    env.pop("AWS_CA_BUNDLE", None)
    result: dict = {"native": native_installed()}
    if not result["native"]:
        log("dscache_native is not installed (make wheels): dscache runs its pure-Python plane only")
    digests: dict[str, str] = {}
    load: dict[str, list[float]] = {"start": loadavg()}
    if args.dev_stager:
        byte_compile()
        stage = None
    else:
        stage = str(shipped.build(work / "shipped"))
        log(f"dscache-stage as the image lays it out: {stage} (bench/shipped.py; --dev-stager: the venv's)")
    result["stager"] = "dev" if args.dev_stager else "shipped"
    try:
        tools = Tools(server, env, stage)
        server.make_bucket(BUCKET)
        peers = [p for p in args.peers.split(",") if p]
        wan_peers = [p for p in args.wan_peers.split(",") if p]
        if not tools.rclone:
            log("rclone not found (apt-get install rclone); leaving it out")
            peers = [p for p in peers if p != "rclone"]
            wan_peers = [p for p in wan_peers if p != "rclone"]
        if small_count or wan_count:
            log(
                f"generating {small_count} x {args.small_size} B, {wan_count} x {args.small_size} B (wan) "
                f"and {args.large_count} x {large_size} B"
            )
            src, digests = make_source(work, small_count, args.small_size, args.large_count, large_size, wan_count)
            t = time.perf_counter()
            subprocess.run(
                [tools.s5cmd, "--endpoint-url", server.endpoint, "cp", f"{src}/*", f"s3://{BUCKET}/"],
                env=env,
                check=True,
                stdout=subprocess.DEVNULL,
            )
            log(f"uploaded in {time.perf_counter() - t:.1f}s")
            shutil.rmtree(src)
        if "loopback" in profiles:
            result.update(loopback_profile(tools, env, work, args, small_count, large_size, peers, digests))
            load["loopback"] = loadavg()
        if "wan" in profiles:
            proxy = ToxiProxy((server.host, server.port), rtt_ms=args.rtt_ms).start()
            try:
                rev = tools.revision("wan")
                wan, _ = small_profile(
                    tools,
                    env,
                    work,
                    "wan",
                    wan_count,
                    args.small_size,
                    wan_peers,
                    args.runs,
                    rev,
                    digests,
                    endpoint=proxy.endpoint,
                    with_warm=False,
                    server_pid=server.proc.pid if server.proc else None,
                    proxy=proxy,
                )
                proxy_connections = proxy.connections()
            finally:
                proxy.stop()
            wmed = {k: round(med(v), 3) for k, v in wan.items()}
            per_1k = {
                what: {k: round(med(v, attr) / wan_count * 1e6, 1) for k, v in wan.items()}
                for what, attr in (("client", "cpu_s"), ("server", "server_cpu_s"), ("proxy", "proxy_cpu_s"))
            }
            result["wan"] = {
                "objects": wan_count,
                "small_s": wmed,
                "rtt_ms": args.rtt_ms,
                "cpu_ms_per_1k_small": per_1k["client"],
                "server_cpu_ms_per_1k_small": per_1k["server"],
                "proxy_cpu_ms_per_1k_small": per_1k["proxy"],
                "connections": {k: round(statistics.median(r.connections for r in v)) for k, v in wan.items()},
                "proxy_connections": proxy_connections,
                "proxy": proxy.version,
            }
            load["wan"] = loadavg()
            log(f"wan ({args.rtt_ms:.0f} ms): dscache is {wmed['s5cmd'] / wmed['dscache']:.2f}x s5cmd (target 1.5)")
            log_wan_bounds(result["wan"], per_1k, wan_count)
        if args.scale:
            result["scale"] = scale_profile(tools, env, work, args, server)
            load["scale"] = loadavg()
    finally:
        server.stop()
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    load["end"] = loadavg()
    result["loadavg"] = load
    log(f"load averages (1, 5, 15 min) after each profile: {load} (noise from other work on the machine)")
    print(json.dumps(result), flush=True)
    from bench.results import write  # the docs' figures are rendered from this file

    write("stager", result, quick=args.quick)
    return 0


def log_wan_bounds(wan: dict, per_1k: dict[str, dict[str, float]], count: int) -> None:
    """What bounds the wan figure: the round trips, or the CPU the client, the server and the proxy
    share on this machine's cores (on a real WAN only the client's share is on the node)."""
    cores = os.cpu_count() or 1
    for tool, seconds in wan["small_s"].items():
        cpu_ms = sum(per_1k[w][tool] for w in per_1k)
        log(
            f"wan {tool}: {seconds:.2f}s; CPU per 1k client {per_1k['client'][tool]:.0f} + server "
            f"{per_1k['server'][tool]:.0f} + proxy {per_1k['proxy'][tool]:.0f} ms = floor "
            f"{cpu_ms * count / 1e6 / cores:.2f}s on {cores} cores; {wan['connections'][tool]} connections"
        )


def dscache_tools() -> list[str]:
    """dscache's planes in this run: both when the native one is installed, else the Python one as "dscache"."""
    return list(DSCACHE_TOOLS) if native_installed() else ["dscache"]


def workers_sweep(tools, env, work, args, count: int, revision: str, digests) -> dict:
    """The native plane's small-object copy with 1, 2, 4... threads: objects/s, and objects per client
    CPU-second (what a core buys). On this machine the S3 server shares the cores, so speed stops
    growing early; the CPU per object is what carries over to a bigger node."""
    if not native_installed():
        log("workers sweep: dscache_native is not installed; skipped")
        return {}
    sweep: dict[str, dict] = {}
    for n in [int(w) for w in args.workers.split(",") if w]:
        runs = []
        for r in range(args.runs):
            dest = work / "dest" / f"workers-{n}"
            fresh(dest)
            cmd = tools.command("dscache", "small", dest, revision=revision, pod=f"workers-{n}-{r}")
            run = run_child(cmd, tool_env("dscache", env, workers=n))
            verify_dscache(dest, revision, "small", digests, json.loads(run.out), warm=False)
            runs.append(run)
        secs, cpu = med(runs), med(runs, "cpu_s")
        control = statistics.median(c for r in runs if (c := control_cpu_s(r)) is not None)
        sweep[str(n)] = {
            "control_cpu_ms_per_1k_small": round(control / count * 1e6, 1),
            "seconds": round(secs, 3),
            "objects_per_s": round(count / secs),
            "client_cpu_s": round(cpu, 3),
            "objects_per_client_cpu_s": round(count / cpu),
            "cpu_ms_per_1k_small": round(cpu / count * 1e6, 1),
        }
        log(f"workers {n}: {sweep[str(n)]}")
    shutil.rmtree(work / "dest", ignore_errors=True)
    # A 64-core node: once the server is remote (not on these cores), the
    # client's CPU per object is what a core pays, so 64 cores copy at most
    # 64 x objects per client CPU-second, taken at the widest sweep point (it
    # includes the threads' contention at that width). But the control plane
    # (listing, hash, journal) runs on one thread whatever the cores: it caps
    # the rate at 1 / its CPU per object. The lower of the two is the bound;
    # the NIC, S3's request rate per prefix and the disk may bind first.
    widest = sweep[max(sweep, key=int)]
    cores_bound = 64 * widest["objects_per_client_cpu_s"]
    control_bound = round(1e6 / widest["control_cpu_ms_per_1k_small"])
    implied = {
        "cores": 64,
        "objects_per_s": min(cores_bound, control_bound),
        "client_cpu_bound_objects_per_s": cores_bound,
        "control_plane_bound_objects_per_s": control_bound,
    }
    log(
        f"workers sweep implies for a 64-core node: {implied['objects_per_s']} objects/s "
        f"(client CPU over 64 cores: {cores_bound}; one control-plane thread: {control_bound})"
    )
    return {"runs": sweep, "implied_64_cores": implied}


def loopback_profile(tools, env, work, args, small_count, large_size, peers, digests) -> dict:
    sets = {s for s in args.sets.split(",") if s}
    revs = {p: tools.revision(p) for p in ("small", "large", "tiny")}
    log(f"revisions (as the operator pins them): {revs}")
    result: dict = {}
    if "small" in sets:
        result.update(small_set(tools, env, work, args, small_count, peers, digests, revs))
    if "large" in sets:
        result.update(large_set(tools, env, work, args, large_size, digests, revs))
    if "fixed" in sets:
        result.update(fixed_set(tools, env, work, args, digests, revs))
    if "small" in sets and "large" in sets and "dscache_python" in result["small_s"]:
        # The native plane against the pure-Python one, same run, same data.
        smed, lmed, cpu = result["small_s"], result["large_s"], result["cpu_ms_per_1k_small"]
        result["native_vs_python"] = {
            "small_speedup": round(smed["dscache_python"] / smed["dscache"], 2),
            "small_cpu_ratio": round(cpu["dscache"] / cpu["dscache_python"], 2),
            "large_speedup": round(lmed["dscache_python"] / lmed["dscache"], 2),
        }
        log(f"native vs python plane: {result['native_vs_python']}")
    if "small" in sets and args.workers:
        result["workers_sweep"] = workers_sweep(tools, env, work, args, small_count, revs["small"], digests)
    return result


def small_set(tools, env, work, args, small_count, peers, digests, revs) -> dict:
    small, warm = small_profile(
        tools,
        env,
        work,
        "small",
        small_count,
        args.small_size,
        peers,
        args.runs,
        revs["small"],
        digests,
        server_pid=tools.server.proc.pid if tools.server.proc else None,
    )
    smed = {k: round(med(v), 3) for k, v in small.items()}
    result = {
        "small_objects": small_count,
        "small_bytes": small_count * args.small_size,
        "small_s": smed,
        "warm_s": round(med(warm), 3),
        "cold_s": smed["dscache"],
        "warm_runs_s": [round(w.seconds, 3) for w in warm],
        "cpu_ms_per_1k_small": {k: round(med(v, "cpu_s") / small_count * 1e6, 1) for k, v in small.items()},
        "peak_rss_mib": {k: round(max(r.peak_rss_mib for r in v), 1) for k, v in small.items()},
        # What bounds loopback speed: client and server share the machine's cores,
        # so a copy takes at least (client + server CPU per object) / cores.
        "server_cpu_ms_per_1k_small": {
            k: round(med(v, "server_cpu_s") / small_count * 1e6, 1) for k, v in small.items()
        },
    }
    result["warm_speedup"] = round(smed["dscache"] / result["warm_s"], 1)
    both = {k: round(result["cpu_ms_per_1k_small"][k] + result["server_cpu_ms_per_1k_small"][k]) for k in small}
    log(f"small, client + server CPU per 1k objects (2 shared cores bound the speed): {both} ms")
    log(
        f"small: dscache is {smed['s5cmd'] / smed['dscache']:.2f}x s5cmd (target 1.5)"
        + (f", {smed['awscli'] / smed['dscache']:.1f}x aws-cli (target 5)" if "awscli" in smed else "")
    )
    log(f"cpu per 1k small: {result['cpu_ms_per_1k_small']} ms (target: dscache <= s5cmd)")
    log(
        f"warm: {result['warm_speedup']}x faster than cold at {small_count} objects "
        f"({result['warm_s']}s vs {smed['dscache']}s; target 50)"
    )
    return result


def large_set(tools, env, work, args, large_size, digests, revs) -> dict:
    # "get" (the server's ceiling: the stager's ranged GETs read into /dev/null) and
    # "source-read" (the server's backing files read cold) bound what any client can do here.
    variants = [v for v in args.large_variants.split(",") if v]
    if unknown := set(variants) - set(DSCACHE_VARIANTS):
        raise SystemExit(f"--large-variants: unknown {sorted(unknown)} (known: {DSCACHE_VARIANTS})")
    large: dict[str, list[Run]] = {
        t: [] for t in [*dscache_tools(), *variants, "s5cmd", "dd", "dd-fdatasync", "get", "source-read"]
    }
    tools.presign_large(args.large_count, large_size)
    server_pid = tools.server.proc.pid if tools.server.proc else None
    for r in range(args.runs):
        for tool in list(large)[r % len(large) :] + list(large)[: r % len(large)]:
            dest = work / "dest" / f"large-{tool}"
            fresh(dest)
            before = cpu_seconds(server_pid) if server_pid else 0.0
            run = run_child(
                tools.command(tool, "large", dest, large_size, args.large_count, revision=revs["large"]),
                tool_env(tool, env),
                keep_stdout=tool == "get",
            )
            if server_pid:
                run = dataclasses.replace(run, server_cpu_s=cpu_seconds(server_pid) - before)
            if tool in STAGED:
                verify_dscache(dest, revs["large"], "large", digests, json.loads(run.out), warm=False)
            if tool == "get":
                got = [int(n) for n in run.stdout.split()]
                want = [e - s for _, s, e in tools.large_parts]
                if sorted(got) != sorted(want):
                    raise RuntimeError(f"the raw GETs read {sum(got)} B in {len(got)} parts, expected {sum(want)}")
            large[tool].append(run)
            log(
                f"large run {r + 1} {tool}: {run.seconds:.2f}s "
                f"({args.large_count * large_size / run.seconds / 1e6:.0f} MB/s), cpu {run.cpu_s:.2f}s, "
                f"server cpu {run.server_cpu_s:.2f}s"
            )
        shutil.rmtree(work / "dest")

    lmed = {k: round(med(v), 3) for k, v in large.items()}
    gib = args.large_count * large_size / (1 << 30)
    # What bounds large files here (issue 18: dd writes zeros into the page cache; every
    # S3 client must first be served the bytes, by a server on the same cores reading
    # its files cold): the raw GETs' time is the ceiling, and each tool's fraction of it.
    result = {
        "large_bytes": args.large_count * large_size,
        "large_s": {k: lmed[k] for k in (*dscache_tools(), "s5cmd")},
        "dd_s": lmed["dd"],
        "cpu_s_per_gib": {k: round(med(large[k], "cpu_s") / gib, 2) for k in (*dscache_tools(), "s5cmd")},
        "dd_fdatasync_s": lmed["dd-fdatasync"],
        "large_server_ceiling_s": lmed["get"],
        "large_source_read_s": lmed["source-read"],
        "large_vs_ceiling": {k: round(lmed["get"] / lmed[k], 2) for k in (*dscache_tools(), "s5cmd")},
        "large_cpu_s": {k: round(med(large[k], "cpu_s"), 3) for k in large},
        "large_server_cpu_s": {k: round(med(large[k], "server_cpu_s"), 3) for k in large},
        "large_parts": {"part_bytes": PART_SIZE, "in_flight": SPLICE_THREADS, "count": len(tools.large_parts)},
    }
    if variants:
        result["large_variants_s"] = {v: lmed[v] for v in variants}
        result["large_variants_vs_ceiling"] = {v: round(lmed["get"] / lmed[v], 2) for v in variants}
    log(f"large: cpu per GiB: {result['cpu_s_per_gib']} s")
    log(
        f"large: {lmed['s5cmd'] / lmed['dscache']:.2f}x s5cmd (target 1.2), "
        f"{lmed['dd'] / lmed['dscache']:.2f}x dd; "
        f"{lmed['dd-fdatasync'] / lmed['dscache']:.2f}x dd with fdatasync ({lmed['dd-fdatasync']}s, the disk itself)"
    )
    log(
        f"large, the server's ceiling: raw ranged GETs into /dev/null {lmed['get']}s (server cpu "
        f"{result['large_server_cpu_s']['get']}s), its files read cold {lmed['source-read']}s; dscache "
        f"{lmed['dscache']}s is {result['large_vs_ceiling']['dscache']:.2f}x that ceiling (target 0.8; "
        f"s5cmd {result['large_vs_ceiling']['s5cmd']:.2f}x), dd into the page cache {lmed['dd']}s"
    )
    return result


def fixed_set(tools, env, work, args, digests, revs) -> dict:
    # The fixed cost of one copy (one 1 KiB object): a share of every large-file time
    # that dd, which only writes, does not pay. Each run starts with the page cache
    # dropped, as every timed run here; the tool then reads its own binaries and
    # modules from disk too (fixed_read_mib). The same runs with the page cache kept
    # (fixed_cached_s, interleaved) tell that reading apart from the process's own work.
    tools_here = [*dscache_tools(), "s5cmd"]
    fixed: dict[str, list[Run]] = {t: [] for t in tools_here}
    cached: dict[str, list[Run]] = {t: [] for t in tools_here}
    for r in range(args.runs):
        for tool in tools_here[r % len(tools_here) :] + tools_here[: r % len(tools_here)]:
            for drop, runs in ((True, fixed), (False, cached)):
                dest = work / "dest" / f"tiny-{tool}"
                fresh(dest, drop=drop)
                run = run_child(tools.command(tool, "tiny", dest, revision=revs["tiny"]), tool_env(tool, env))
                if tool in DSCACHE_TOOLS:
                    verify_dscache(dest, revs["tiny"], "tiny", digests, json.loads(run.out), warm=False)
                elif tree_bytes(dest) != (1, 1024):
                    raise RuntimeError(f"{tool} did not copy the one tiny object: {tree_bytes(dest)}")
                runs[tool].append(run)
        shutil.rmtree(work / "dest")
    fmed = {k: round(med(v), 3) for k, v in fixed.items()}
    cmed = {k: round(med(v), 3) for k, v in cached.items()}
    read = {k: round(med(v, "read_mib"), 1) for k, v in fixed.items()}
    log(
        f"a copy's fixed cost (one 1 KiB object): dscache {fmed['dscache']}s (target 0.1), s5cmd {fmed['s5cmd']}s; "
        f"with the page cache kept dscache {cmed['dscache']}s, s5cmd {cmed['s5cmd']}s; read from disk after "
        f"the drop: dscache {read['dscache']} MiB, s5cmd {read['s5cmd']} MiB"
    )
    return {
        "fixed_s": fmed,
        "fixed_cpu_s": {k: round(med(v, "cpu_s"), 3) for k, v in fixed.items()},
        "fixed_cached_s": cmed,
        "fixed_cached_cpu_s": {k: round(med(v, "cpu_s"), 3) for k, v in cached.items()},
        "fixed_read_mib": read,
    }


# --- scale: a million keys -----------------------------------------------------------------

SCALE_PER_DIR = 1000


def scale_key(i: int) -> str:
    return f"scale/d{i // SCALE_PER_DIR:04d}/f{i:07d}.bin"


def scale_body(i: int, block: bytes) -> bytes:
    return i.to_bytes(8, "little") + block[8:]


def make_scale_source(bucket_dir: Path, count: int, size: int) -> bytes:
    """Write ``count`` objects straight into versitygw's posix backend.

    versitygw (posix) serves any file under the bucket dir as an object; its
    ETag is the ``user.etag`` xattr (quoted MD5, as PutObject stores it), and
    without one the object lists with an empty ETag. Content type and
    checksums are optional. The bench checks one object's ETag over the API.
    """
    block = os.urandom(size)
    for i in range(count):
        path = bucket_dir / scale_key(i)
        if i % SCALE_PER_DIR == 0:
            path.parent.mkdir(parents=True, exist_ok=True)
        body = scale_body(i, block)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, body)
            os.setxattr(fd, "user.etag", f'"{hashlib.md5(body).hexdigest()}"'.encode())
        finally:
            os.close(fd)
    return block


def remove_dest(dest: Path) -> None:
    # A staged revision is sealed read-only (0555 dirs); rm -rf is much faster than rmtree at 1M files.
    subprocess.run(["chmod", "-R", "u+w", str(dest)], check=False)
    subprocess.run(["rm", "-rf", str(dest)], check=True)


def sourcecheck_child(server: S3Server, env: dict[str, str]) -> Run:
    """The operator's real source check (sourcecheck._list_sync) on the scale prefix, in a child process."""
    code = (
        "import json, sys\n"
        f"sys.path[:0] = [{str(REPO / 'operator')!r}, {str(REPO / 'contract')!r}]\n"
        "from dscache_operator.api.models import Source\n"
        "from dscache_operator.control import sourcecheck\n"
        f"src = Source(uri='s3://{BUCKET}/scale/', endpoint={server.endpoint!r}, region='us-east-1', "
        "addressingStyle='path')\n"
        f"creds = {{'AWS_ACCESS_KEY_ID': {env['AWS_ACCESS_KEY_ID']!r}, "
        f"'AWS_SECRET_ACCESS_KEY': {env['AWS_SECRET_ACCESS_KEY']!r}}}\n"
        "r = sourcecheck._list_sync(src, creds, 60.0)\n"
        "rev = r.revision.id if r.revision else None\n"
        "print(json.dumps({'ok': r.ok, 'reason': r.reason, 'objects': r.objects, 'revision': rev}))\n"
    )
    return run_child([sys.executable, "-c", code], env)


def scale_profile(tools: Tools, env: dict[str, str], work: Path, args, server: S3Server) -> dict:
    count, size = args.scale_count, args.scale_size
    t = time.perf_counter()
    block = make_scale_source(server.root / BUCKET, count, size)
    log(f"scale: wrote {count} x {size} B onto the server's disk in {time.perf_counter() - t:.0f}s")
    probe = server.client().head_object(Bucket=BUCKET, Key=scale_key(count - 1))
    if probe["ETag"].strip('"') != hashlib.md5(scale_body(count - 1, block)).hexdigest():
        raise RuntimeError(f"versitygw does not serve the xattr ETag: {probe['ETag']}")
    t = time.perf_counter()
    info = tools.revision_info("scale")
    revision_s = time.perf_counter() - t
    if info["objects"] != count:
        raise RuntimeError(f"scale listing has {info['objects']} objects, expected {count}")
    rev = info["revision"]
    log(f"scale: revision {rev} listed in {revision_s:.1f}s")
    out: dict = {"objects": count, "object_bytes": size, "revision_s": round(revision_s, 1)}

    dest = work / "dest" / "scale-dscache"
    fresh(dest)
    cold = run_child(tools.command("dscache", "scale", dest, revision=rev, pod="scale-cold"), tool_env("dscache", env))
    summary = json.loads(cold.out)
    if (summary.get("objects"), summary.get("revision"), summary.get("warm")) != (count, rev, False):
        raise RuntimeError(f"dscache at scale: unexpected summary {summary}")
    data = dest / "revs" / rev / "data"
    n, b = tree_bytes(data)
    if (n, b) != (count, count * size):
        raise RuntimeError(f"dscache at scale placed {n} files / {b} B, expected {count} / {count * size}")
    for i in range(0, count, max(1, count // 1000)):  # a thousand spot checks of the bytes
        if (data / scale_key(i)[len("scale/") :]).read_bytes() != scale_body(i, block):
            raise RuntimeError(f"dscache at scale: {scale_key(i)} differs from the source")
    with open(dest / "revs" / rev / "meta" / "manifest.jsonl") as f:
        lines = sum(1 for _ in f)
    if lines != count:
        raise RuntimeError(f"dscache at scale: the manifest has {lines} lines, expected {count}")
    log(f"scale: dscache cold {cold.seconds:.1f}s, cpu {cold.cpu_s:.1f}s, peak rss {cold.peak_rss_mib:.0f} MiB")
    warm = run_child(tools.command("warm", "scale", dest, revision=rev, pod="scale-warm"), tool_env("warm", env))
    if not json.loads(warm.out).get("warm"):
        raise RuntimeError(f"dscache at scale: the re-run was not warm: {warm.out}")
    log(f"scale: dscache warm {warm.seconds:.2f}s, peak rss {warm.peak_rss_mib:.0f} MiB")
    remove_dest(dest)
    out.update(
        dscache_s=round(cold.seconds, 1),
        dscache_cpu_s=round(cold.cpu_s, 1),
        dscache_peak_rss_mib=round(cold.peak_rss_mib, 1),
        warm_s=round(warm.seconds, 3),
        warm_peak_rss_mib=round(warm.peak_rss_mib, 1),
    )
    for peer in [p for p in args.scale_peers.split(",") if p]:
        dest = work / "dest" / f"scale-{peer}"
        fresh(dest)
        run = run_child(tools.command(peer, "scale", dest), env)
        n, b = tree_bytes(dest)
        if (n, b) != (count, count * size):
            raise RuntimeError(f"{peer} at scale copied {n} files / {b} B, expected {count} / {count * size}")
        log(f"scale: {peer} {run.seconds:.1f}s, cpu {run.cpu_s:.1f}s, peak rss {run.peak_rss_mib:.0f} MiB")
        out[f"{peer}_s"] = round(run.seconds, 1)
        out[f"{peer}_cpu_s"] = round(run.cpu_s, 1)
        out[f"{peer}_peak_rss_mib"] = round(run.peak_rss_mib, 1)
        remove_dest(dest)
    check = sourcecheck_child(server, env)
    got = json.loads(check.out)
    if (got["ok"], got["objects"], got["revision"]) != (True, count, rev):
        raise RuntimeError(f"the source check disagrees with the stager's listing: {got} vs {rev}")
    log(f"scale: source check {check.seconds:.1f}s, cpu {check.cpu_s:.1f}s, peak rss {check.peak_rss_mib:.0f} MiB")
    out.update(
        sourcecheck_s=round(check.seconds, 1),
        sourcecheck_cpu_s=round(check.cpu_s, 1),
        sourcecheck_peak_rss_mib=round(check.peak_rss_mib, 1),
    )
    return out


if __name__ == "__main__":
    raise SystemExit(main())
