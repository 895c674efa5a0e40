"""CPUs the stager may use: the cgroup quota (v1 and v2), not the node's count."""

from __future__ import annotations

import os
from pathlib import Path

from dscache_stager.cpus import available_cpus, cgroup_quota


def write(root: Path, rel: str, text: str) -> None:
    p = root / rel
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(text)


def proc(tmp_path: Path, text: str) -> str:
    p = tmp_path / "proc-self-cgroup"
    p.write_text(text)
    return str(p)


def test_v2_quota_in_the_own_cgroup(tmp_path: Path):
    root = tmp_path / "cg"
    write(root, "cpu.max", "max 100000\n")
    write(root, "kubepods/pod1/ctr/cpu.max", "250000 100000\n")
    own = proc(tmp_path, "0::/kubepods/pod1/ctr\n")
    assert cgroup_quota(str(root), own) == 2.5
    affinity = len(os.sched_getaffinity(0))
    assert available_cpus(str(root), own) == min(affinity, 3)


def test_v2_tightest_ancestor_wins_and_max_means_none(tmp_path: Path):
    root = tmp_path / "cg"
    write(root, "pod/cpu.max", "100000 100000\n")
    write(root, "pod/ctr/cpu.max", "max 100000\n")
    assert cgroup_quota(str(root), proc(tmp_path, "0::/pod/ctr\n")) == 1.0
    root2 = tmp_path / "cg2"
    write(root2, "cpu.max", "max 100000\n")
    assert cgroup_quota(str(root2), proc(tmp_path, "0::/\n")) is None


def test_v1_cfs_quota_and_period(tmp_path: Path):
    root = tmp_path / "cg"
    write(root, "cpu,cpuacct/docker/abc/cpu.cfs_quota_us", "150000\n")
    write(root, "cpu,cpuacct/docker/abc/cpu.cfs_period_us", "100000\n")
    write(root, "cpu,cpuacct/cpu.cfs_quota_us", "-1\n")
    write(root, "cpu,cpuacct/cpu.cfs_period_us", "100000\n")
    own = proc(tmp_path, "12:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n")
    assert cgroup_quota(str(root), own) == 1.5
    assert available_cpus(str(root), own) == min(len(os.sched_getaffinity(0)), 2)


def test_no_cgroup_files_means_the_affinity_mask(tmp_path: Path):
    own = proc(tmp_path, "0::/\n")
    assert cgroup_quota(str(tmp_path / "none"), own) is None
    assert available_cpus(str(tmp_path / "none"), own) == len(os.sched_getaffinity(0))


def test_a_tiny_quota_still_gives_one_cpu(tmp_path: Path):
    root = tmp_path / "cg"
    write(root, "cpu.max", "10000 100000\n")
    assert available_cpus(str(root), proc(tmp_path, "0::/\n")) == 1
