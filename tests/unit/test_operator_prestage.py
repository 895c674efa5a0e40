"""Pre-staging and the Ready condition: which nodes, the pods, the condition (pure functions)."""

from __future__ import annotations

import datetime

import dscache_contract as contract
from dscache_contract import RevisionRef, StageArgs
from dscache_operator.api.models import DatasetCacheSpec, NodeRevision, NodeState, NodeStatus, Retention, Toleration
from dscache_operator.cluster.nodes import NodeInfo, node_info, schedulable_for
from dscache_operator.control import prestage
from dscache_operator.control.nodeplan import plan_nodes
from dscache_operator.control.status import ready_condition
from dscache_operator.settings import Settings

REV = "r-0123456789abcdef0123"
S = Settings(cache_root="/mnt/nvme/dscache", stager_image="stager:t")
NOW = datetime.datetime(2026, 11, 25, 12, 0, tzinfo=datetime.UTC)


def spec(**prestage) -> DatasetCacheSpec:
    return DatasetCacheSpec.model_validate(
        {"source": {"uri": "s3://bkt/ds/"}, "mountPath": "/data", "prestage": prestage}
    )


def node(name, labels=None, taints=(), warm=(), agent=True, ready=True) -> NodeInfo:
    return NodeInfo(name, "10.0.0.1", labels or {}, tuple(taints), frozenset(warm), agent, ready)


def test_node_info_reads_labels_taints_address_and_the_agent_port():
    body = {
        "metadata": {
            "name": "g1",
            "labels": {"gpu": "h100", contract.AGENT_LABEL: "9477", contract.warm_label("ml", "c", REV): "true"},
        },
        "spec": {"taints": [{"key": "nvidia.com/gpu", "effect": "NoSchedule"}]},
        "status": {
            "addresses": [{"type": "InternalIP", "address": "10.1.2.3"}],
            "conditions": [{"type": "Ready", "status": "True"}],
        },
    }
    n = node_info(body)
    assert (n.address, n.agent, n.agent_port, n.ready) == ("10.1.2.3", True, 9477, True)
    assert n.warm == {contract.warm_label("ml", "c", REV)} and n.labels == {"gpu": "h100", contract.AGENT_LABEL: "9477"}


def test_tainted_nodes_need_a_toleration():
    gpu = node("g1", {"gpu": "h100"}, taints=[("nvidia.com/gpu", "", "NoSchedule")])
    assert not schedulable_for(gpu, {"gpu": "h100"}, [])
    assert schedulable_for(gpu, {"gpu": "h100"}, [Toleration(key="nvidia.com/gpu", operator="Exists")])
    assert not schedulable_for(gpu, {"gpu": "a100"}, [Toleration(operator="Exists")])


def test_choose_prefers_warm_nodes_then_names_and_skips_nodes_without_an_agent():
    key = contract.warm_label("ml", "c", REV)
    nodes = [node("a"), node("b", warm=[key]), node("c"), node("d", agent=False), node("e", ready=False)]
    chosen = prestage.choose(spec(nodes=2).prestage, nodes, "ml", "c", REV)
    assert [n.name for n in chosen] == ["b", "a"]
    assert [n.name for n in prestage.choose(spec().prestage, nodes, "ml", "c", REV)] == ["b", "a", "c"]


def test_the_prestage_pod_stages_like_a_job_but_takes_no_lease():
    s = spec(tolerations=[{"operator": "Exists"}])
    pod = prestage.build_pod("ml", "c", "uid-1", "g1", s, S, RevisionRef(REV), 12345)
    assert pod["metadata"]["name"] == prestage.pod_name("ml", "c", "g1", REV)
    assert pod["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    assert pod["spec"]["nodeName"] == "g1" and pod["spec"]["tolerations"] == [{"operator": "Exists"}]
    init = pod["spec"]["initContainers"][0]
    args = StageArgs.from_argv(init["args"])
    assert args.pod_uid is None and args.revision == REV and args.bytes == 12345 and args.cache == "ml/c"
    assert args.prestage, "the agent must know a pre-stage copy: it evicts no other pre-staged copy for it"
    assert args.cohort, "the controller creates every chosen node's pre-stage pod at once: they list the bucket once"
    assert pod["metadata"]["labels"][prestage.PRESTAGE_LABEL] == "true"


def test_the_prestage_pod_carries_the_charts_pull_secrets():
    """Issue 29: with a private registry, a pre-stage pod without them never pulls the stager."""
    s = spec()
    assert "imagePullSecrets" not in prestage.build_pod("ml", "c", "u", "g1", s, S, RevisionRef(REV), 1)["spec"]
    named = Settings.from_env({"DSCACHE_IMAGE_PULL_SECRETS": " regcred, mirror ,"})
    assert named.image_pull_secrets == ("regcred", "mirror")
    pod = prestage.build_pod("ml", "c", "u", "g1", s, named, RevisionRef(REV), 1)
    assert pod["spec"]["imagePullSecrets"] == [{"name": "regcred"}, {"name": "mirror"}]


def test_the_prestage_pod_carries_the_caches_pull_secrets_after_the_charts():
    """The cache may name its own (its namespace's Secrets); one the chart names too comes once."""
    s = spec(imagePullSecrets=[{"name": "team-registry"}, {"name": "mirror"}])
    pod = prestage.build_pod("ml", "c", "u", "g1", s, S, RevisionRef(REV), 1)
    assert pod["spec"]["imagePullSecrets"] == [{"name": "team-registry"}, {"name": "mirror"}]
    named = Settings.from_env({"DSCACHE_IMAGE_PULL_SECRETS": "regcred,mirror"})
    pod = prestage.build_pod("ml", "c", "u", "g1", s, named, RevisionRef(REV), 1)
    assert pod["spec"]["imagePullSecrets"] == [{"name": "regcred"}, {"name": "mirror"}, {"name": "team-registry"}]


def test_a_prestaged_revision_is_not_wiped_when_its_pod_finished():
    prior = [
        NodeStatus(node="g1", state=NodeState.READY, revisions=[NodeRevision(id=REV, lastUsed="2026-11-25T11:00:00Z")])
    ]
    plans = plan_nodes(prior, [], lambda uid: None, Retention(), NOW, keep={"g1": frozenset({REV})})
    assert not plans["g1"].wipes
    plans = plan_nodes(prior, [], lambda uid: None, Retention(), NOW)
    assert [w.revision for w in plans["g1"].wipes] == [REV]


def test_ready_condition():
    ok = {"type": "SourceReady", "status": "True", "reason": "Listed"}
    rev = RevisionRef(REV)
    assert ready_condition(ok, rev, None, False)["status"] == "True"
    assert (
        ready_condition({**ok, "status": "False", "reason": "AccessDenied"}, rev, None, False)["reason"]
        == "SourceNotReady"
    )
    assert ready_condition(ok, None, None, False)["reason"] == "NoRevision"
    waiting = ready_condition(ok, rev, {"wanted": 3, "ready": 1}, False)
    assert waiting["status"] == "False" and waiting["reason"] == "Prestaging" and "1 of 3" in waiting["message"]
    assert ready_condition(ok, rev, {"wanted": 3, "ready": 3}, False)["reason"] == "Prestaged"
    assert ready_condition(ok, rev, {"wanted": 0, "ready": 0}, False)["reason"] == "NoPrestageNodes"
    assert ready_condition(ok, rev, None, True)["reason"] == "Deleting"
