"""What checking a stager's token costs, per check (issue 30): TokenReview vs the agent's own check.

On a real kube-apiserver + etcd (the test tier's, tests/support/kubeapi.py), for ``--tokens``
pod-bound projected tokens (audience dscache-peer), each checked once, as one agent meets each
stager of a cohort once:
 - ``token_review``: one TokenReview per token (what the agents did until issue 30);
 - ``pod_get``: one GET of the token's pod (what they still do, the pod check);
 - ``pod_get_watch_cache``: the same GET with ``resourceVersion=0`` (served from the API server's
   watch cache, not etcd; may lag a moment behind it);
 - ``local``: the agent's own check (dscache_node.jwks: signature against the API server's keys,
   claims), the keys fetched once beforehand.
For each: the kube-apiserver's and etcd's CPU seconds (user+sys, /proc/<pid>/stat) and this
process's, over the run, per check in microseconds. Run on a quiet machine and compare ratios in one
run; ``uptime`` is printed with the figures. The last line is JSON.

    .venv/bin/python bench/token_checks.py --tokens 300
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.procstat import cpu_seconds
from dscache_contract.peers import PEER_AUDIENCE
from dscache_node.auth import REVIEW_PATH
from dscache_node.jwks import IssuerKeys, LocalVerifier
from dscache_node.kube import Kube
from tests.support.agentauth import consumer_pod, pod_token
from tests.support.kubeapi import KubeAPI


def self_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def measure(name: str, pids: dict[str, int], n: int, fn: Any) -> dict[str, float]:
    before = {k: cpu_seconds(p) for k, p in pids.items()}
    mine, wall = self_cpu(), time.monotonic()
    fn()
    wall, mine = time.monotonic() - wall, self_cpu() - mine
    out = {f"{k}_us": round((cpu_seconds(p) - before[k]) * 1e6 / n, 1) for k, p in pids.items()}
    out.update(caller_us=round(mine * 1e6 / n, 1), wall_ms=round(wall * 1e3 / n, 3))
    print(f"{name}: {out}", flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=300)
    args = ap.parse_args()
    k = KubeAPI(workdir=Path(tempfile.mkdtemp(prefix="token-checks-"))).start()
    try:
        ns = k.namespace("bench-tokens")
        pods = [consumer_pod(k, ns, "data", f"n{i % 8}", name=f"stager-{i}") for i in range(args.tokens)]
        tokens = [pod_token(k, p) for p in pods]
        certs = k.certs
        kube = Kube.from_env(
            {
                "DSCACHE_KUBE_SERVER": k.server,
                "DSCACHE_KUBE_CA": str(certs / "ca.crt"),
                "DSCACHE_KUBE_CERT": str(certs / "admin.crt"),
                "DSCACHE_KUBE_KEY": str(certs / "admin.key"),
            }
        )
        procs = {p.args[0].rsplit("/", 1)[-1]: p.pid for p in k.procs if isinstance(p, subprocess.Popen)}
        pids = {"apiserver": procs["kube-apiserver"], "etcd": procs["etcd"]}
        kube.get("/version")  # the connection made before any figure

        def reviews() -> None:
            for t in tokens:
                body = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview"}
                status = (kube.post(REVIEW_PATH, {**body, "spec": {"token": t, "audiences": [PEER_AUDIENCE]}}) or {})[
                    "status"
                ]
                assert status.get("authenticated"), status

        def gets(query: str = "") -> None:
            for p in pods:
                assert kube.get(f"/api/v1/namespaces/{ns}/pods/{p['metadata']['name']}{query}") is not None

        verifier = LocalVerifier(IssuerKeys(kube))
        assert isinstance(verifier.verify(tokens[0], PEER_AUDIENCE, offline=False), dict)  # the keys, fetched

        def local() -> None:
            for t in tokens:
                assert isinstance(verifier.verify(t, PEER_AUDIENCE, offline=True), dict)

        out = {
            "tokens": args.tokens,
            "token_review": measure("token_review", pids, len(tokens), reviews),
            "pod_get": measure("pod_get", pids, len(pods), gets),
            "pod_get_watch_cache": measure("pod_get_watch_cache", pids, len(pods), lambda: gets("?resourceVersion=0")),
            "local": measure("local", pids, len(tokens), local),
            "uptime": subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip(),
        }
        print(out["uptime"])
        print(json.dumps({"token_checks": out}))
    finally:
        k.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
