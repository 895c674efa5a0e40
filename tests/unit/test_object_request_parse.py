"""ObjectRequest.parse's hand-split of a plain target (issue 30: the agent's CPU per object) gives what
urllib's split gives (split_target), for the stagers' own targets and for random ones alike; and
ObjectRequest.target, which quotes by hand only what has something to quote (the stager's CPU per
object), builds what urllib's quote and urlencode build."""

from __future__ import annotations

import random
import urllib.parse

import pytest

from dscache_contract.peers import (
    _PLAIN,
    OBJECTS_PATH,
    PROBE_PARAM,
    RELAY_PARAM,
    ObjectRequest,
    _split_plain,
    split_target,
)

REV = "r-" + "a" * 20


def test_the_stagers_targets_are_plain_and_round_trip():
    for path in ("a", "d0/f1", "x y/ü+z", "a;b=c/@:!", "q?x", "a&b", "100%/x"):
        for wait, probe, relay in ((0.0, False, False), (1.5, True, False), (20.0, True, True)):
            req = ObjectRequest("ml", "c", REV, path, wait, probe, relay)
            target = req.target()
            assert ObjectRequest.parse(target) == req
            if path in ("a", "d0/f1"):
                assert _PLAIN.fullmatch(target), target  # the common case takes the short way


@pytest.mark.parametrize("seed", range(4))
def test_a_plain_target_splits_as_urllib_splits_it(seed):
    rnd = random.Random(seed)
    alphabet = "ab/?=&;%+#.:~-@ \t0"
    plain = 0
    for _ in range(5000):
        target = OBJECTS_PATH + "".join(rnd.choice(alphabet) for _ in range(rnd.randint(0, 24)))
        if _PLAIN.fullmatch(target):
            plain += 1
            assert _split_plain(target) == split_target(target, OBJECTS_PATH), target
    assert plain > 100  # the comparison ran on many


def test_repeated_blank_and_odd_query_items_split_alike():
    for query in ("wait=1&wait=2", "probe=&relay&=1&&probe=1", "", "wait=3?4", "x=1;y=2", "relay=1&probe=1"):
        target = f"{OBJECTS_PATH}a/b/{REV}/x?{query}"
        assert _PLAIN.fullmatch(target)
        assert _split_plain(target) == split_target(target, OBJECTS_PATH), target


def _urllib_target(req: ObjectRequest) -> str:
    """The target as urllib builds it (what ObjectRequest.target built before issue 30)."""
    parts = (req.namespace, req.cache, req.revision, *req.path.split("/"))
    query = {"wait": f"{req.wait:g}"} if req.wait > 0 else {}
    if req.probe:
        query[PROBE_PARAM] = "1"
        if req.relay:
            query[RELAY_PARAM] = "1"
    quoted = "/".join(urllib.parse.quote(p, safe="") for p in parts)
    return f"{OBJECTS_PATH}{quoted}" + (f"?{urllib.parse.urlencode(query)}" if query else "")


@pytest.mark.parametrize("seed", range(4))
def test_a_target_is_what_urllib_builds(seed):
    rnd = random.Random(seed)
    alphabet = "aZ09._~-/?=&;%+#:@ \tü\u2603"
    waits = (0.0, 0.25, 5.0, 20.0, 1e-7, 1e6, float("inf"))
    for _ in range(3000):
        name = "".join(rnd.choice(alphabet) for _ in range(rnd.randint(1, 24)))
        probe = rnd.random() < 0.5
        req = ObjectRequest(
            rnd.choice(("ml", "a b")), "c", REV, name, rnd.choice(waits), probe, probe and rnd.random() < 0.5
        )
        assert req.target() == _urllib_target(req), req
