"""The scale bench's pure parts (bench/fanout_stats.py, bench/netsim.py): no namespace, no process."""

from __future__ import annotations

import importlib.util
import os
import sys
import time
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[2]


def load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"bench_{name}", REPO / "bench" / f"{name}.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


stats = load("fanout_stats")
netsim = load("netsim")
tail = load("fanout_tail")


def test_percentile_nearest_rank() -> None:
    xs = [float(i) for i in range(1, 101)]
    assert stats.percentile(xs, 0.99) == 99.0
    assert stats.percentile(xs, 0.5) == 50.0
    assert stats.percentile(xs, 1.0) == 100.0
    assert stats.percentile([3.0], 0.99) == 3.0
    assert stats.percentile([], 0.99) == 0.0


def test_propagation_counts_from_the_later_of_start_and_first_arrival() -> None:
    starts = {"a": 0.0, "b": 5.0}
    arrivals = {"a": {"x": 1.0, "y": 8.0}, "b": {"x": 7.0, "y": 6.0}}
    # x: first at a (1.0); b started at 5 -> 7 - 5 = 2; a itself 0.
    # y: first at b (6.0) -> b 0; a: 8 - max(0, 6) = 2.
    assert sorted(stats.propagation(arrivals, starts)) == [0.0, 0.0, 2.0, 2.0]


def test_propagation_of_an_object_first_read_before_a_node_started() -> None:
    starts = {"a": 0.0, "b": 10.0}
    arrivals = {"a": {"x": 1.0}, "b": {"x": 10.5}}
    assert sorted(stats.propagation(arrivals, starts)) == [0.0, 0.5]


def test_predict_is_linear_in_log2_n_through_the_two_largest() -> None:
    by = {4: {"k": 9.0}, 16: {"k": 1.0}, 32: {"k": 1.5}}
    assert stats.predict(by, "k", 256) == pytest.approx(1.5 + 0.5 * 3)
    assert stats.predict({32: {"k": 1.0}}, "k", 256) is None


def test_ratio() -> None:
    assert stats.ratio(3, 2) == 1.5
    assert stats.ratio(1, 0) == 0.0


def test_birth_and_mtime_of_a_new_file(tmp_path: Path) -> None:
    p = tmp_path / "f"
    before = time.time()
    p.write_bytes(b"x")
    os.utime(p, (before + 100, before + 100))
    born, mtime = stats.birth_and_mtime(str(p))
    assert mtime == pytest.approx(before + 100, abs=1e-3)
    assert born == 0.0 or before - 1 <= born <= time.time() + 1
    with pytest.raises(OSError):
        stats.birth_and_mtime(str(tmp_path / "missing"))


def test_skews_are_seeded_and_bounded() -> None:
    a = netsim.skews(32, 5.0, 30)
    assert a == netsim.skews(32, 5.0, 30)
    assert a != netsim.skews(32, 5.0, 31)
    assert len(a) == 32 and all(0.0 <= s <= 5.0 for s in a)
    assert max(a) - min(a) > 2.5  # spread over the range, not all alike
    assert netsim.skews(4, 0.0, 30) == [0.0] * 4


def test_tbf_args() -> None:
    assert netsim.tbf_args(16, 262144, 50) == ["tbf", "rate", "16mbit", "burst", "262144", "latency", "50ms"]


def test_stale_tags_only_of_our_dead_runs() -> None:
    names = ["dsn-111-n0", "dsn-111-s", "dsn-222-n0", "dsfanout-111", "other-111-n0", "dsn-x-n0"]
    assert netsim.stale_tags(names, alive={222}) == {"111"}
    assert netsim.stale_tags(names, alive={111, 222}) == set()


def test_names_fit_an_interface_name() -> None:
    net = netsim.Net(nodes=200, mbit=1, bucket_mbit=1, tag="4194304")
    assert len(net.bridge) <= 15
    assert len(f"{netsim.PREFIX}{net.tag}n199") <= 15
    assert net.subnet.startswith("10.232.")


GET = (
    "dscache-test bkt [26/November/2026:20:55:20 +0000] 10.232.23.11 dscache-test DDO0RV5TALDSM809 "
    "s3_GetObject ds/small/d01/f000001.bin /bkt/ds/small/d01/f000001.bin 200 - 0 0 0 0 - Boto3/1.44.5 - x SigV4"
)


def test_access_get_reads_ip_and_key_of_gets_only() -> None:
    assert stats.access_get(GET) == ("10.232.23.11", "ds/small/d01/f000001.bin")
    assert stats.access_get(GET.replace("s3_GetObject", "s3_ListObjectsV2")) is None
    assert stats.access_get("AuthHeader s3.us-east-1.amazonaws.com - arn:aws:s3:::/bkt Yes") is None
    assert stats.access_get("") is None


def test_bucket_reads_finds_keys_read_twice() -> None:
    gets = [("ip-a", "k1"), ("ip-b", "k1"), ("ip-a", "k2"), ("ip-a", "k2"), ("ip-c", "k3")]
    out = stats.bucket_reads(gets, {"ip-a": "a", "ip-b": "b"}, {"k1": 10, "k2": 20, "k3": 5})
    assert out["per_node"] == {
        "a": {"objects": 2, "bytes": 30},
        "b": {"objects": 1, "bytes": 10},
        "ip-c": {"objects": 1, "bytes": 5},
    }
    assert out["keys_read_twice_or_more"] == 1  # k2 twice by the same node is one reader (a ranged GET, a retry)
    assert out["extra_bytes"] == 10
    assert out["extra_reads_by_pair"] == {"a+b": 1}


def test_the_link_tail_is_what_the_nodes_lacked_when_the_bucket_was_done() -> None:
    # 0.5 s apart: the bucket sends 1 MB/s for 2 s from t0 + 1; node a receives it all as it is
    # sent, node b half of it meanwhile and the rest from a over the next second.
    t0 = 1000.0
    t = [t0 + 0.5 * i for i in range(9)]
    bucket_up = [0, 0, 0, 500_000, 1_000_000, 1_500_000, 2_000_000, 2_000_000, 2_000_000]
    a_down = [0, 0, 0, 500_000, 1_000_000, 1_500_000, 2_000_000, 2_000_000, 2_000_000]
    b_down = [0, 0, 0, 250_000, 500_000, 750_000, 1_000_000, 1_500_000, 2_000_000]
    links = {
        "interval_s": 0.5,
        "t": t,
        "up": {"bucket": bucket_up, "a": [0] * 9, "b": [0] * 9},
        "down": {"bucket": [0] * 9, "a": a_down, "b": b_down},
    }
    got = tail.link_tail(links, t0)
    assert got["bucket_from_s"] == 1.5  # the first sample past 1% of its bytes
    assert got["bucket_to_s"] == 3.0
    assert got["bucket_mbit"] == round(0.98 * 2_000_000 * 8 / 1.5 / 1e6, 1)
    assert got["had_at_bucket_end"] == {"a": 1.0, "b": 0.5}
    assert got["end_s"] == 4.0
    assert tail.per_second(links, t0) == ["0:0/0", "1:8/6", "2:8/6", "3:0/4", "4:0/0"]
    quiet = {**links, "up": {"bucket": [0] * 9, "a": [0] * 9, "b": [0] * 9}}
    assert tail.link_tail(quiet, t0) == {}
