"""Two controller replicas against the real kube-apiserver: Lease leader election
(kube/leader.py) and pre-stage pods' pull secrets (issue 29).

The session's controller is stopped for these tests (SIGTERM: it releases the Lease)
and started again afterwards; the tests run their own controller processes, each with
its own pod name (its identity in the Lease) and metrics port.
"""

from __future__ import annotations

import contextlib
import datetime
import http.client
import json
import signal
import subprocess
import sys
import threading
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

import dscache_contract as contract
from tests.integration.test_operator_api import grant_secret_read, make_cache, make_secret
from tests.support.kubeapi import OPERATOR_NS, REPO, KubeAPI, Operator
from tests.support.nodeagent import register_node
from tests.support.s3server import ACCESS_KEY, SECRET_KEY, free_port

pytestmark = pytest.mark.integration

LEASE = f"/apis/coordination.k8s.io/v1/namespaces/{OPERATOR_NS}/leases/dscache-controller"
DSC = "/apis/dscache.io/v1alpha1/namespaces/{ns}/datasetcaches/{name}"


@dataclass
class Controller:
    name: str
    proc: subprocess.Popen
    metrics_port: int
    log: Path

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5) as r:
            return r.read().decode()

    def sample(self, family: str) -> float:
        """The sum of a family's samples (0 when absent)."""
        return sum(
            float(line.rsplit(" ", 1)[1])
            for line in self.metrics().splitlines()
            if line.startswith((family + " ", family + "{"))
        )

    def leads(self) -> bool:
        return self.sample("dscache_controller_leader") == 1.0


@contextlib.contextmanager
def own_controllers(op: Operator) -> Iterator[callable]:
    """Stop the session's controller, let the test start its own, and restore it afterwards."""
    op.stop("controller")  # SIGTERM: it releases the Lease
    started: list[Controller] = []

    def start(name: str | None, slow_stop: float | None = None, **env: str) -> Controller:
        """A controller process; ``slow_stop``: kopf's shutdown takes that many seconds
        more before dscache's cleanup handler runs (tests/support/slowstop.py)."""
        port = free_port()
        log = op.workdir / f"controller-{name or 'default'}.log"
        extra = {"DSCACHE_METRICS_PORT": str(port), "DSCACHE_HEALTH_PORT": "0", **env}
        if name is not None:
            extra["DSCACHE_POD_NAME"] = name
        entry = ["dscache_operator"] if slow_stop is None else ["tests.support.slowstop", str(slow_stop)]
        proc = subprocess.Popen(
            [sys.executable, "-m", *entry, "controller"],
            env={**op.env("controller"), **extra},
            stdout=open(log, "ab"),  # noqa: SIM115 (the process keeps it open)
            stderr=subprocess.STDOUT,
            cwd=REPO,
        )
        c = Controller(name or "default", proc, port, log)
        started.append(c)
        op.kube.wait_for(lambda: _serving(c), 30, what=f"controller {c.name} serving metrics")
        return c

    try:
        yield start
    finally:
        for c in started:
            if c.proc.poll() is None:
                c.proc.terminate()
                try:
                    c.proc.wait(20)
                except subprocess.TimeoutExpired:
                    c.proc.kill()
                    c.proc.wait()
        op.start("controller")


def _serving(c: Controller) -> bool:
    assert c.proc.poll() is None, f"controller {c.name} exited: {c.log.read_text(errors='replace')[-3000:]}"
    try:
        c.metrics()
        return True
    except OSError:
        return False


def holder(k: KubeAPI) -> str | None:
    lease = k.get(LEASE)
    return None if lease is None else (lease.get("spec") or {}).get("holderIdentity")


def revision_of(k: KubeAPI, ns: str, name: str) -> str | None:
    cache = k.get(DSC.format(ns=ns, name=name)) or {}
    return ((cache.get("status") or {}).get("revision") or {}).get("id")


def test_two_controllers_one_leads_and_the_standby_takes_over(kube_api, dscache_operator, s3_server, bucket, opted_ns):
    k, ns = kube_api, opted_ns
    s3_server.put_tree(bucket, {"data/a.bin": b"a" * 10})
    make_secret(k, ns, "s3-keys", ACCESS_KEY, SECRET_KEY)
    grant_secret_read(k, ns)

    def cache(name: str) -> None:
        make_cache(k, ns, name, f"s3://{bucket}/data/", s3_server.endpoint, "s3-keys")

    with own_controllers(dscache_operator) as start:
        a = start("ctl-a")
        k.wait_for(lambda: holder(k) == "ctl-a", 20, what="ctl-a holds the Lease")
        b = start("ctl-b")
        k.wait_for(a.leads, 10, what="ctl-a's leader gauge")
        # b is up, its views listing: it must not act.
        cache("one")
        k.wait_for(lambda: revision_of(k, ns, "one"), 30, what="cache one's revision")
        time.sleep(3)  # b has had time to act, were it going to
        assert a.leads() and not b.leads()
        assert a.sample("dscache_source_checks_total") >= 1
        assert b.sample("dscache_source_checks_total") == 0, b.log.read_text(errors="replace")[-3000:]
        assert holder(k) == "ctl-a"

        # The leader dies without a word (no release): b takes over within ~20 s, and a cache
        # created meanwhile gets its revision from b.
        a.proc.kill()
        a.proc.wait()
        killed = time.monotonic()
        cache("two")
        k.wait_for(lambda: holder(k) == "ctl-b", 25, interval=0.2, what="ctl-b takes the Lease")
        took = time.monotonic() - killed
        k.wait_for(lambda: revision_of(k, ns, "two"), 20, what="cache two's revision (from ctl-b)")
        pinned = time.monotonic() - killed
        print(f"failover: ctl-b held the Lease {took:.1f} s after SIGKILL of ctl-a; cache two pinned at {pinned:.1f} s")
        # It may take the Lease only once it has seen it unchanged for the lease duration (15 s).
        assert 13.0 <= took <= 20.0, took
        assert b.leads() and b.sample("dscache_source_checks_total") >= 1
        lease = k.get(LEASE)
        assert lease["spec"]["leaseTransitions"] >= 1 and lease["spec"]["leaseDurationSeconds"] == 15

        # A clean stop releases the Lease: the next replica need not wait out 15 s.
        b.proc.terminate()
        b.proc.wait(20)
        assert holder(k) == "", k.get(LEASE)


class LeaseWatch(threading.Thread):
    """Every version of the Lease from now on, as the API server sends them (a watch, so no
    renewal is missed between two polls), each with when (monotonic) it arrived here."""

    def __init__(self, k: KubeAPI) -> None:
        super().__init__(daemon=True)
        self.k = k
        lease = k.get(LEASE)
        self.seen: list[tuple[float, dict]] = [(time.monotonic(), lease["spec"])]
        self._rv = lease["metadata"]["resourceVersion"]
        self._conn = http.client.HTTPSConnection("127.0.0.1", k.port, context=k._ssl(), timeout=90)

    def run(self) -> None:
        query = urllib.parse.urlencode(
            {
                "watch": "1",
                "fieldSelector": "metadata.name=dscache-controller",
                "resourceVersion": self._rv,
                "timeoutSeconds": "60",
            }
        )
        self._conn.request("GET", f"{LEASE.rsplit('/', 1)[0]}?{query}", headers={"Accept": "application/json"})
        resp = self._conn.getresponse()
        with contextlib.suppress(OSError, ValueError):  # closed by stop()
            for line in resp:
                event = json.loads(line)
                if event["type"] in ("ADDED", "MODIFIED"):
                    self.seen.append((time.monotonic(), event["object"]["spec"]))

    def stop(self) -> list[tuple[float, dict]]:
        time.sleep(0.5)  # the last event on its way
        with contextlib.suppress(OSError):
            self._conn.sock.shutdown(2)  # type: ignore[union-attr]
        self.join(5)
        return list(self.seen)


def _wall(micro_time: str) -> float:
    return datetime.datetime.strptime(micro_time, "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=datetime.UTC).timestamp()


def test_sigterm_releases_the_lease_before_a_slow_shutdown(kube_api, dscache_operator):
    """SIGTERM during a shutdown that takes seconds (kopf's cleanup held 8 s): the leader
    releases the Lease on the signal, not at the end of its shutdown, and never renews it
    after SIGTERM; the standby leads within about one retry period (2 s), while the old
    process is still shutting down."""
    k = kube_api
    with own_controllers(dscache_operator) as start:
        a = start("ctl-a", slow_stop=8)
        k.wait_for(lambda: holder(k) == "ctl-a", 20, what="ctl-a holds the Lease")
        b = start("ctl-b")
        k.wait_for(a.leads, 10, what="ctl-a's leader gauge")
        time.sleep(2.5)  # a has renewed at least once: leading, not just acquired
        watch = LeaseWatch(k)
        watch.start()
        time.sleep(0.5)

        t0_wall, t0 = time.time(), time.monotonic()
        a.proc.send_signal(signal.SIGTERM)
        k.wait_for(lambda: holder(k) == "ctl-b", 10, interval=0.1, what="ctl-b takes the Lease")
        led = time.monotonic() - t0
        still_stopping = a.proc.poll() is None
        a.proc.wait(30)
        exited = time.monotonic() - t0
        seen = watch.stop()

        after = [(t - t0, spec) for t, spec in seen if t >= t0]
        released = next((t for t, spec in after if not spec.get("holderIdentity")), None)
        b_at = next((t for t, spec in after if spec.get("holderIdentity") == "ctl-b"), None)
        print(
            f"failover timeline: SIGTERM to ctl-a at 0 s; lease released at "
            f"{'never' if released is None else f'{released:.2f} s'}; ctl-b leading at "
            f"{'?' if b_at is None else f'{b_at:.2f} s'} (seen by a poll at {led:.2f} s); "
            f"ctl-a exited at {exited:.2f} s"
        )
        # No renewal of a's after the signal: every version of the Lease a wrote carries a
        # renewTime from before it (a renewal already in flight at t0 is still from before).
        renewed_after = [
            spec for _, spec in after if spec.get("holderIdentity") == "ctl-a" and _wall(spec["renewTime"]) > t0_wall
        ]
        assert not renewed_after, (renewed_after, a.log.read_text(errors="replace")[-3000:])
        assert released is not None and released < 2.0, after
        assert b_at is not None and b_at < 4.0, after
        assert still_stopping, "ctl-a's shutdown was not slow: the test proves nothing"
        assert exited >= 8.0, exited
        assert b.leads()


def test_a_released_lease_goes_to_the_warm_standby(kube_api, dscache_operator):
    """A rolling update or `kubectl delete pod`: the leader gets SIGTERM and empties the Lease,
    and the Deployment starts its replacement at the same moment. The warm standby must take
    the Lease, not the replacement, which has not listed yet (e2e's test_controller_failover
    saw the replacement win this race). Twice: each standby in turn was once a replacement."""
    k = kube_api
    with own_controllers(dscache_operator) as start:
        leader = start("ctl-a")
        k.wait_for(lambda: holder(k) == "ctl-a", 20, what="ctl-a holds the Lease")
        standby = start("ctl-b")
        k.wait_for(leader.leads, 10, what="ctl-a's leader gauge")
        for replacement in ("ctl-c", "ctl-d"):
            time.sleep(2.5)  # the standby's views are listed (start() waited for its metrics)
            leader.proc.send_signal(signal.SIGTERM)
            fresh = start(replacement)  # the Deployment's new pod, started as the old one stops
            k.wait_for(lambda s=standby: holder(k) == s.name, 10, interval=0.1, what=f"{standby.name} takes the Lease")
            time.sleep(4)  # the replacement has listed and tried by now
            assert holder(k) == standby.name and standby.leads() and not fresh.leads(), k.get(LEASE)
            leader.proc.wait(20)
            leader, standby = standby, fresh


def test_prestage_pull_secrets(kube_api, dscache_operator, s3_server, bucket, opted_ns):
    """Issue 29: a pre-stage pod the controller creates carries the chart's pull secrets
    (DSCACHE_IMAGE_PULL_SECRETS), then the cache's own (spec.prestage.imagePullSecrets, a
    name both give once), so a private stager image can be pulled."""
    k, ns = kube_api, opted_ns
    s3_server.put_tree(bucket, {"data/a.bin": b"a" * 10})
    make_secret(k, ns, "s3-keys", ACCESS_KEY, SECRET_KEY)
    grant_secret_read(k, ns)
    node = f"prestage-{ns}"
    register_node(k, node, {contract.AGENT_LABEL: "9477", "dscache-test/prestage": ns})
    with own_controllers(dscache_operator) as start:
        start(None, DSCACHE_IMAGE_PULL_SECRETS="regcred, mirror")
        make_cache(
            k,
            ns,
            "pre",
            f"s3://{bucket}/data/",
            s3_server.endpoint,
            "s3-keys",
            # Tolerate all: the API server's TaintNodesByCondition taints a new Node not-ready,
            # and no node controller runs here to lift it.
            prestage={
                "nodeSelector": {"dscache-test/prestage": ns},
                "tolerations": [{"operator": "Exists"}],
                "imagePullSecrets": [{"name": "team-registry"}, {"name": "mirror"}],
            },
        )

        def prestage_pods() -> list[dict]:
            pods = k.get(f"/api/v1/namespaces/{ns}/pods?labelSelector=dscache.io/prestage%3Dtrue")["items"]
            return pods or None

        try:
            (pod,) = k.wait_for(prestage_pods, 40, what="the pre-stage pod")
        except AssertionError:
            raise AssertionError(f"no pre-stage pod; the cache: {k.get(DSC.format(ns=ns, name='pre'))}") from None
        assert pod["spec"]["nodeName"] == node
        assert pod["spec"]["imagePullSecrets"] == [{"name": "regcred"}, {"name": "mirror"}, {"name": "team-registry"}]
        assert pod["spec"]["initContainers"][0]["image"] == "dscache-stager:test"
