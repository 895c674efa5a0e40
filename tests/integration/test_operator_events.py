"""Aggregated Events against the real kube-apiserver, as the controller's ServiceAccount with the
RBAC of operator/deploy/rbac.yaml: a repeat is counted on one Event (PATCH), and a new poster
(a restarted controller) counts on from the server's count (409, GET, PATCH)."""

from __future__ import annotations

import asyncio
import os

import pytest

pytestmark = pytest.mark.integration


def test_repeats_are_counted_on_one_event(kube_api, dscache_operator, opted_ns):
    from dscache_operator.kube.client import Kube, connection_info
    from dscache_operator.kube.events import Event, Poster, event_name

    cache = kube_api.create(
        f"/apis/dscache.io/v1alpha1/namespaces/{opted_ns}/datasetcaches",
        {
            "apiVersion": "dscache.io/v1alpha1",
            "kind": "DatasetCache",
            "metadata": {"name": "ev"},
            "spec": {
                "mountPath": "/data",
                "source": {"uri": "s3://events-test/data/", "endpoint": "http://127.0.0.1:9"},
            },
        },
    )
    involved = {
        "apiVersion": "dscache.io/v1alpha1",
        "kind": "DatasetCache",
        "namespace": opted_ns,
        "name": "ev",
        "uid": cache["metadata"]["uid"],
    }
    e = Event(involved, "Warning", "WipeFailed", "node-x did not answer; retrying")
    other = Event(involved, "Warning", "WipeFailed", "node-y did not answer; retrying")

    async def scenario() -> None:
        old = os.environ.get("KUBECONFIG")
        os.environ["KUBECONFIG"] = str(dscache_operator.workdir / "kubeconfig-controller")
        try:
            info = connection_info()
        finally:
            if old is None:
                os.environ.pop("KUBECONFIG")
            else:
                os.environ["KUBECONFIG"] = old
        for _ in range(2):  # the second poster: a restarted controller, which remembers nothing
            kube = Kube(info)
            try:
                poster = Poster(kube)
                for _ in range(3):
                    await poster.send(e)
                await poster.send(other)
            finally:
                await kube.close()

    asyncio.run(scenario())
    events = f"/api/v1/namespaces/{opted_ns}/events"
    got = kube_api.get(f"{events}/{event_name(e)}")
    assert got["count"] == 6 and got["message"] == e.message, got
    assert got["involvedObject"]["uid"] == involved["uid"]
    assert kube_api.get(f"{events}/{event_name(other)}")["count"] == 2
    mine = [x for x in kube_api.get(events)["items"] if x["reason"] == "WipeFailed"]
    assert len(mine) == 2, [(x["metadata"]["name"], x["message"], x.get("count")) for x in mine]
