"""bench/stager.py end to end at a tiny size: every profile (loopback, wan, --scale)
against the real S3 server, with s5cmd as the peer. CI runs no benchmark, so without
this a change elsewhere can break a profile unseen (the --scale source check once
failed at its last step, after 20 minutes, on a type the operator had changed).
The bench verifies every copy itself and exits non-zero on a mismatch; this test
checks that it ran to the end and wrote every documented field. No timing is judged."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.support.tools import REPO

pytestmark = pytest.mark.integration


def test_every_bench_profile_runs_and_reports_its_fields(tmp_path):
    argv = [
        sys.executable,
        str(REPO / "bench" / "stager.py"),
        "--runs=1",
        "--small-count=30",
        "--large-count=1",
        f"--large-size={4 << 20}",
        "--large-variants=dscache_sync",
        "--peers=s5cmd",
        "--wan-count=30",
        "--wan-peers=s5cmd",
        "--scale",
        "--scale-count=200",
        "--scale-peers=s5cmd",
        "--workers=1,2",
        f"--workdir={tmp_path}",
    ]
    # Its result file goes to tmp_path, not over bench/results/ (which the docs quote).
    env = {**os.environ, "DSCACHE_BENCH_RESULTS": str(tmp_path / "results")}
    out = subprocess.run(argv, capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert json.loads((tmp_path / "results" / "stager.json").read_text())["result"] == result
    assert result["stager"] == "shipped"  # the image's layout (bench/shipped.py), not the venv's editable install
    # Both of dscache's data planes when the native one is installed (issue 18).
    tools = {"dscache", "dscache_python", "s5cmd"} if result["native"] else {"dscache", "s5cmd"}
    for key in ("small_s", "large_s", "cpu_ms_per_1k_small", "server_cpu_ms_per_1k_small", "peak_rss_mib"):
        assert set(result[key]) == tools, key
    assert result["small_objects"] == 30 and result["dd_s"] > 0 and result["warm_s"] > 0
    # The large set's bounds: the server's ceiling (raw GETs into /dev/null) and its disk.
    assert result["large_server_ceiling_s"] > 0 and result["large_source_read_s"] > 0 and result["dd_fdatasync_s"] > 0
    assert set(result["large_vs_ceiling"]) == tools
    # The large set through sync.py too (DSCACHE_ONEPAGE=0), verified and timed beside the others.
    assert set(result["large_variants_s"]) == set(result["large_variants_vs_ceiling"]) == {"dscache_sync"}
    assert result["large_variants_s"]["dscache_sync"] > 0
    large_runs = tools | {"dscache_sync", "dd", "dd-fdatasync", "get", "source-read"}
    assert set(result["large_cpu_s"]) == set(result["large_server_cpu_s"]) == large_runs
    assert result["large_parts"]["count"] == 1 and result["large_parts"]["in_flight"] > 0
    assert set(result["fixed_s"]) == set(result["fixed_cpu_s"]) == tools and min(result["fixed_s"].values()) > 0
    # The same runs with the page cache kept, and what each read from disk after the drop (0 without root).
    assert set(result["fixed_cached_s"]) == set(result["fixed_cached_cpu_s"]) == set(result["fixed_read_mib"]) == tools
    assert min(result["fixed_cached_s"].values()) > 0 and min(result["fixed_read_mib"].values()) >= 0
    wan = result["wan"]
    assert set(wan["small_s"]) == tools and wan["objects"] == 30
    for key in ("cpu_ms_per_1k_small", "server_cpu_ms_per_1k_small", "proxy_cpu_ms_per_1k_small", "connections"):
        assert set(wan[key]) == tools, key
    if result["native"]:
        assert set(result["native_vs_python"]) == {"small_speedup", "small_cpu_ratio", "large_speedup"}
        sweep = result["workers_sweep"]
        assert set(sweep["runs"]) == {"1", "2"} and sweep["implied_64_cores"]["objects_per_s"] > 0
        assert all(r["objects_per_client_cpu_s"] > 0 for r in sweep["runs"].values())
    scale = result["scale"]
    assert scale["objects"] == 200
    for key in ("dscache_s", "s5cmd_s", "dscache_peak_rss_mib", "warm_s", "sourcecheck_s", "sourcecheck_peak_rss_mib"):
        assert scale[key] > 0, key
    assert set(result["loadavg"]) >= {"start", "loopback", "wan", "scale", "end"}


def test_fanout_bench_runs_every_phase_and_reports_its_fields(tmp_path):
    """bench/fanout.py at a few MiB, its link wide open (1 gbit): 3 node agents, the S3
    server in its own netns, every phase (the lone node's too), every copy verified by
    the bench itself."""
    argv = [
        sys.executable,
        str(REPO / "bench" / "fanout.py"),
        "--large-count=3",
        f"--large-size={1 << 20}",
        "--small-count=40",
        f"--small-size={16 << 10}",
        "--bucket-mbit=1000",
        f"--workdir={tmp_path}",
    ]
    # Its result file goes to tmp_path, not over bench/results/ (which the docs quote).
    env = {**os.environ, "DSCACHE_BENCH_RESULTS": str(tmp_path / "results")}
    out = subprocess.run(argv, capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    fanout = json.loads(out.stdout.strip().splitlines()[-1])["fanout"]
    assert json.loads((tmp_path / "results" / "fanout.json").read_text())["result"] == {"fanout": fanout}
    assert fanout["nodes"] == 3 and fanout["dataset_bytes"] == 3 * (1 << 20) + 40 * (16 << 10)
    assert fanout["bucket_mbit"] == 1000 and fanout["tbf_burst_bytes"] > 0 and fanout["tbf_latency_ms"] > 0
    for key in ("bucket_bytes", "all_ready_s", "independent_all_ready_s", "independent_bucket_bytes", "speedup"):
        assert fanout[key] > 0, key
    assert fanout["bucket_ratio"] == round(fanout["bucket_bytes"] / fanout["dataset_bytes"], 3)
    # The counter saw three whole copies when nobody shared (the bench fails otherwise).
    assert fanout["independent_bucket_bytes"] >= 3 * fanout["dataset_bytes"]
    assert fanout["peer_bytes"] >= 0 and fanout["stager_bucket_bytes"] > 0
    assert set(fanout["per_node_s"]) == {"fanout-node-0", "fanout-node-1", "fanout-node-2"}
    assert [(r["phase"], r["round"]) for r in fanout["runs"]] == [
        ("independent", 0),
        ("fanout", 0),
        ("lone", 0),
        ("lone-peers", 0),
        ("lone-open", 0),
        ("lone-peers-open", 0),
    ]
    # The lone node: one stager, with and without peers, through the link and with it opened.
    for key in ("lone", "lone_peers", "lone_open", "lone_open_peers"):
        assert fanout[f"{key}_s"] > 0 and fanout[f"{key}_cpu_s"] > 0, key
    assert fanout["lone_ratio"] == round(fanout["lone_peers_s"] / fanout["lone_s"], 3)
    assert fanout["lone_open_ratio"] == round(fanout["lone_open_peers_s"] / fanout["lone_open_s"], 3)
    assert fanout["lone_agent_cpu_s"] >= 0 and fanout["lone_peers_agent_cpu_s"] >= 0
    assert fanout["lone_open_mbit"] == 0
    lone = [r for r in fanout["runs"] if r["phase"].startswith("lone")]
    assert all(set(r["cpu_s"]) == set(r["per_node_s"]) == {"fanout-node-0"} for r in lone)
    assert set(fanout["loadavg"]) >= {"start", "end"}


def test_fanout_bench_nodes_runs_in_namespaces_and_reports_by_nodes(tmp_path):
    """bench/fanout.py --nodes 2,3 at a few objects, small-file profile of 60: every node in its own
    network namespace with a real agent and stager; every copy verified by the bench itself;
    nothing of its namespaces, veths or bridge left behind."""
    argv = [
        sys.executable,
        str(REPO / "bench" / "fanout.py"),
        "--phases=",
        "--nodes=2,3",
        "--scale-large-count=1",
        "--scale-small-count=20",
        f"--scale-small-size={8 << 10}",
        "--node-mbit=100",
        "--scale-bucket-mbit=100",
        "--skew-max-s=0.5",
        "--small-files=60",
        "--small-files-nodes=2",
        f"--workdir={tmp_path}",
    ]
    env = {**os.environ, "DSCACHE_BENCH_RESULTS": str(tmp_path / "results")}
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) as bench:
        stdout, stderr = bench.communicate(timeout=600)
    assert bench.returncode == 0, stderr[-3000:]
    fanout = json.loads(stdout.strip().splitlines()[-1])["fanout"]
    assert fanout["scale_dataset_objects"] == 21 and fanout["one_alone_s"] > 0
    assert fanout["link_check"]["from_bucket_ns_mbit"] > 0 and fanout["link_check"]["from_peer_ns_mbit"] > 0
    assert set(fanout["by_nodes"]) == {"2", "3"}
    for n, entry in fanout["by_nodes"].items():
        # The server's counter saw at least one copy; every node's own time is in the run.
        assert entry["bucket_ratio"] >= 1.0, n
        # Both seconds are rounded to the millisecond: the ratio of the rounded ones is that far off at most.
        ratio, one = entry["all_ready_s"] / fanout["one_alone_s"], fanout["one_alone_s"]
        slack = ratio * (0.0005 / entry["all_ready_s"] + 0.0005 / one) + 0.0005
        assert entry["all_ready_over_one"] == pytest.approx(ratio, abs=slack)
        assert entry["p99_object_s"] >= 0 and entry["agent_cpu_s"] >= 0
        assert len(entry["run"]["own_s"]) == int(n) and len(entry["run"]["skew_s"]) == int(n)
        assert all(0 <= s <= 0.5 for s in entry["run"]["skew_s"].values())
        assert entry["run"]["bucket_reads"]["keys_read"] == 21  # the server's log saw every key read
    small = fanout["small_files"]
    assert small["objects"] == 60 and small["nodes"] == 2
    assert small["peers_all_ready_s"] > 0 and small["bucket_alone_s"] > 0
    assert small["bucket_alone_bucket_ratio"] >= 2.0  # both nodes read every object from the bucket
    # Nothing of this run's namespaces is left (bench/netsim.py tags them with the bench's pid;
    # another fan-out bench running on the machine meanwhile has its own).
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not [line for line in netns.splitlines() if line.startswith(f"dsn-{bench.pid}-")]
