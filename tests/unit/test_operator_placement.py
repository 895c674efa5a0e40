"""Warm-node placement and capacity warnings: the pure rules, and the webhook handler
end to end (a real kopf.Patch applied as a JSON patch, as the API server would)."""

from __future__ import annotations

import copy

import kopf
import pytest

from dscache_contract import Inventory, warm_label
from dscache_operator.admission import placement, webhook
from dscache_operator.api.models import PlacementMode
from dscache_operator.settings import Settings
from tests.unit.test_operator_injection import PIN, REV, REV2, SETTINGS, FakeIndex, job, run_mutate, spec

KEY = warm_label("ml", "imagenet", REV)
OTHER = warm_label("ml", "imagenet", REV2)
GIB = 2**30


def exists(key: str = KEY) -> dict:
    return {"key": key, "operator": "Exists"}


def caches(mode: str = "Preferred", revision_bytes: int | None = None, revision=PIN) -> FakeIndex:
    view = webhook.CacheView(
        spec(placement={"mode": mode}), "Ready", "Listed", "", False, None, revision, None, revision_bytes
    )
    return FakeIndex({("ml", "imagenet"): [view]})


def nodes(*warm: str, budgets: tuple[int, ...] = ()) -> FakeIndex:
    """The node index as kopf holds it: key -> the values every node gave for it."""
    index = FakeIndex({KEY: list(warm)} if warm else {})
    if budgets:
        index[placement.BUDGET_KEY] = list(budgets)
    return index


def pod(annotations: dict | None = None, **spec_fields) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": "train-abc",
            "namespace": "ml",
            "annotations": {"dscache.io/cache": "imagenet", **(annotations or {})},
        },
        "spec": {"containers": [{"name": "train", "image": "trainer:1"}], **spec_fields},
    }


def admit_pod(obj: dict, cache_index=None, node_index=None, mode="HostPath", settings=SETTINGS):
    warnings: list[str] = []
    ops, result = run_mutate(
        obj,
        cache_index or caches(),
        kind="pods",
        mode=mode,
        nodes=node_index,
        warnings=warnings,
        settings=settings,
    )
    return ops, result, warnings


def node_affinity(obj: dict) -> dict:
    return obj["spec"].get("affinity", {}).get("nodeAffinity", {})


# --- the node index ---------------------------------------------------------------------


def test_node_index_keeps_only_warm_keys_and_the_budget():
    inventory = Inventory(node="n1", budget=500 * GIB, held=0, free=900 * GIB).to_json()
    labels = {KEY: "", OTHER: "", "kubernetes.io/hostname": "n1", "dscache.io/agent": "true"}
    annotations = {"dscache.io/inventory": inventory, "node.alpha.kubernetes.io/ttl": "0"}
    # Called with the kwargs kopf gives an indexing handler.
    got = webhook.index_nodes(name="n1", labels=labels, annotations=annotations, namespace=None, body={})
    assert got == {KEY: "n1", OTHER: "n1", placement.BUDGET_KEY: 500 * GIB}
    assert webhook.index_nodes(name="n2", labels={}, annotations={}) == {}
    # The handler kopf registered over Nodes is this one, under the kwarg name mutate() reads.
    (handler,) = [h for h in webhook.make_registry()._indexing.get_all_handlers() if h.id == "dscache_nodes"]
    assert handler.selector is not None and handler.selector.any_name == "nodes"
    assert handler.fn(name="n1", labels=labels, annotations=annotations) == got


@pytest.mark.parametrize(
    "budget", ['"lots"', "true", "-1", "null", "1.5"], ids=["string", "bool", "negative", "null", "float"]
)
def test_a_budget_that_is_not_a_byte_count_is_ignored(budget):
    text = f'{{"node": "n1", "budget": {budget}, "held": 0, "free": 0}}'
    assert placement.node_entries("n1", {}, {"dscache.io/inventory": text}) == {}


@pytest.mark.parametrize("text", ["{", "[]", '{"node": "n1"}', '{"node": "n1", "budget": 1, "bogus": 2}', ""])
def test_unparsable_inventory_is_ignored(text):
    assert placement.node_entries("n1", {KEY: ""}, {"dscache.io/inventory": text}) == {KEY: "n1"}


def test_warm_nodes_and_largest_budget_read_the_index():
    index = nodes("n1", "n2", budgets=(100, 300, 200))
    assert placement.warm_nodes(index, KEY) == 2
    assert placement.warm_nodes(index, OTHER) == 0
    assert placement.warm_nodes(None, KEY) == 0
    assert placement.largest_budget(index) == 300
    assert placement.largest_budget(nodes("n1")) is None
    assert placement.largest_budget(None) is None


# --- Preferred ------------------------------------------------------------------------------


def test_preferred_is_added_only_when_a_node_is_warm():
    _ops, cold, warnings = admit_pod(pod(), node_index=nodes())
    assert "affinity" not in cold["spec"] and warnings == []
    # Another revision of the same cache being warm is not this pod's revision.
    other = FakeIndex({OTHER: ["n1"]})
    _ops, result, _w = admit_pod(pod(), node_index=other)
    assert "affinity" not in result["spec"]
    _ops, warm, warnings = admit_pod(pod(), node_index=nodes("n1"))
    assert node_affinity(warm) == {
        "preferredDuringSchedulingIgnoredDuringExecution": [
            {"weight": SETTINGS.placement_weight, "preference": {"matchExpressions": [exists()]}}
        ]
    }
    assert warnings == []


def test_preferred_weight_is_the_setting():
    settings = Settings(cache_root="/mnt/nvme/dscache", stager_image="stager:test", placement_weight=7)
    _ops, result, _w = admit_pod(pod(), node_index=nodes("n1"), settings=settings)
    (term,) = node_affinity(result)["preferredDuringSchedulingIgnoredDuringExecution"]
    assert term["weight"] == 7


def test_preferred_merges_with_the_pods_own_affinity():
    own_required = {"nodeSelectorTerms": [{"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["a100"]}]}]}
    own_preferred = [{"weight": 10, "preference": {"matchExpressions": [{"key": "zone", "operator": "Exists"}]}}]
    pod_affinity = {
        "requiredDuringSchedulingIgnoredDuringExecution": [
            {"labelSelector": {"matchLabels": {"app": "ps"}}, "topologyKey": "kubernetes.io/hostname"}
        ]
    }
    obj = pod(
        nodeSelector={"pool": "gpu"},
        affinity={
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": own_required,
                "preferredDuringSchedulingIgnoredDuringExecution": own_preferred,
            },
            "podAffinity": pod_affinity,
        },
    )
    _ops, result, _w = admit_pod(obj, node_index=nodes("n1"))
    assert result["spec"]["nodeSelector"] == {"pool": "gpu"}
    assert result["spec"]["affinity"]["podAffinity"] == pod_affinity
    na = node_affinity(result)
    assert na["requiredDuringSchedulingIgnoredDuringExecution"] == own_required  # Preferred never requires
    assert na["preferredDuringSchedulingIgnoredDuringExecution"] == [
        *own_preferred,
        {"weight": SETTINGS.placement_weight, "preference": {"matchExpressions": [exists()]}},
    ]


def test_null_affinity_fields_are_treated_as_absent():
    _ops, result, _w = admit_pod(pod(affinity=None), node_index=nodes("n1"))
    assert len(node_affinity(result)["preferredDuringSchedulingIgnoredDuringExecution"]) == 1


# --- Required --------------------------------------------------------------------------------


def test_required_adds_the_expression_to_every_existing_term():
    """nodeSelectorTerms are ORed: a term left without the expression would admit cold nodes."""
    terms = [
        {"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["a100"]}]},
        {"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["h100"]}], "matchFields": []},
        {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["n9"]}]},
    ]
    obj = pod(
        affinity={"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": terms}}}
    )
    _ops, result, _w = admit_pod(obj, cache_index=caches("Required"), node_index=nodes("n1"))
    got = node_affinity(result)["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert got == [
        {"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["a100"]}, exists()]},
        {"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["h100"]}, exists()], "matchFields": []},
        {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["n9"]}], "matchExpressions": [exists()]},
    ]
    assert "preferredDuringSchedulingIgnoredDuringExecution" not in node_affinity(result)


def test_required_without_warm_nodes_adds_the_term_and_a_warning():
    _ops, result, warnings = admit_pod(pod(), cache_index=caches("Required"), node_index=nodes())
    assert node_affinity(result) == {
        "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [{"matchExpressions": [exists()]}]}
    }
    (warning,) = warnings
    assert "Required" in warning and REV in warning and "Pending" in warning and "spec.prestage" in warning
    assert "spec.placement.mode" in warning  # how to relax it: on the cache, where it was set
    # With a warm node: the same term, and nothing to warn about.
    _ops, warm, warnings = admit_pod(pod(), cache_index=caches("Required"), node_index=nodes("n1"))
    assert node_affinity(warm) == node_affinity(result) and warnings == []


@pytest.mark.parametrize("value", ["required", "Required", " REQUIRED "])
def test_required_by_pod_annotation_any_case(value):
    _ops, result, warnings = admit_pod(pod({"dscache.io/placement": value}), node_index=nodes())
    terms = node_affinity(result)["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert terms == [{"matchExpressions": [exists()]}]
    (warning,) = warnings
    assert "annotation dscache.io/placement" in warning


def test_a_pod_cannot_relax_a_required_cache():
    _ops, result, _w = admit_pod(
        pod({"dscache.io/placement": "preferred"}), cache_index=caches("Required"), node_index=nodes("n1")
    )
    assert "requiredDuringSchedulingIgnoredDuringExecution" in node_affinity(result)
    assert placement.effective_mode(PlacementMode.PREFERRED, {}) == PlacementMode.PREFERRED


@pytest.mark.parametrize("value", ["always", "", "true"])
def test_invalid_placement_annotation_is_refused(value):
    with pytest.raises(kopf.AdmissionError) as e:
        admit_pod(pod({"dscache.io/placement": value}), node_index=nodes("n1"))
    msg = str(e.value)
    assert e.value.code == 400
    assert f"dscache.io/placement={value!r}" in msg and "'required'" in msg and "'preferred'" in msg
    assert "DatasetCache ml/imagenet" in msg
    # On a Job's pod template too: refused at the Job, not pod by pod afterwards.
    obj = job()
    obj["spec"]["template"]["metadata"]["annotations"] = {"dscache.io/placement": value}
    with pytest.raises(kopf.AdmissionError):
        run_mutate(obj, caches(), nodes=nodes("n1"), warnings=[])


# --- idempotence and what is left alone ------------------------------------------------------


@pytest.mark.parametrize("mode", ["Preferred", "Required"])
def test_reinvocation_adds_nothing_twice(mode):
    ops, once, _w = admit_pod(pod(), cache_index=caches(mode), node_index=nodes("n1"))
    assert ops
    ops, twice, _w = admit_pod(once, cache_index=caches(mode), node_index=nodes("n1"))
    assert ops == [] and twice == once


def test_a_pods_own_term_on_our_key_is_not_duplicated():
    own = [{"weight": 3, "preference": {"matchExpressions": [exists()]}}]
    obj = pod(affinity={"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": own}})
    _ops, result, _w = admit_pod(obj, node_index=nodes("n1"))
    assert node_affinity(result)["preferredDuringSchedulingIgnoredDuringExecution"] == own


def test_bound_pods_are_left_alone():
    """spec.nodeName skips the scheduler: an affinity could only make the kubelet reject the pod."""
    for mode in ("Preferred", "Required"):
        _ops, result, warnings = admit_pod(pod(nodeName="n2"), cache_index=caches(mode), node_index=nodes())
        assert "affinity" not in result["spec"] and warnings == []
        _ops, result, _w = admit_pod(pod(nodeName="n2"), cache_index=caches(mode), node_index=nodes("n1"))
        assert "affinity" not in result["spec"]


def test_emptydir_pods_are_left_alone():
    for mode in ("Preferred", "Required"):
        _ops, result, warnings = admit_pod(
            pod(),
            cache_index=caches(mode, revision_bytes=10 * GIB),
            node_index=nodes("n1", budgets=(GIB,)),
            mode="EmptyDir",
        )
        assert "affinity" not in result["spec"] and warnings == []


def test_job_templates_get_no_affinity():
    """Warm state matters when each pod is created; the Job's pods come through here too."""
    for mode in ("Preferred", "Required"):
        warnings: list[str] = []
        _ops, result = run_mutate(job(), caches(mode), nodes=nodes("n1"), warnings=warnings)
        assert "affinity" not in result["spec"]["template"]["spec"]
        assert warnings == []
    # A Required Job no node is warm for: told at apply time that its pods will wait.
    warnings = []
    _ops, result = run_mutate(job(), caches("Required"), nodes=nodes(), warnings=warnings)
    assert "affinity" not in result["spec"]["template"]["spec"]
    (warning,) = warnings
    assert "Pending" in warning


def test_job_pod_from_an_injected_template_gets_the_affinity():
    """A Job's pod: the template was injected at Job admission (with its placement
    annotation); the pod gets the affinity toward the revision the template pins."""
    obj = job()
    obj["spec"]["template"]["metadata"]["annotations"] = {"dscache.io/placement": "required"}
    _ops, injected = run_mutate(obj, caches(), nodes=nodes(), warnings=[])
    template = copy.deepcopy(injected["spec"]["template"])
    job_pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {**template["metadata"], "namespace": "ml"}}
    job_pod["spec"] = template["spec"]
    # A refresh since: the cache's current revision is REV2, the pod keeps the template's REV.
    _ops, result, _w = admit_pod(job_pod, cache_index=caches(revision=webhook.RevisionRef(REV2)), node_index=nodes())
    terms = node_affinity(result)["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert terms == [{"matchExpressions": [exists(KEY)]}]


# --- capacity ----------------------------------------------------------------------------------


def test_capacity_warning_names_both_numbers():
    big, budget = 600 * GIB, 500 * GIB
    index = nodes("n1", budgets=(100 * GIB, budget))
    _ops, _result, warnings = admit_pod(pod(), cache_index=caches(revision_bytes=big), node_index=index)
    job_warnings: list[str] = []
    run_mutate(job(), caches(revision_bytes=big), nodes=index, warnings=job_warnings)
    for got in (warnings, job_warnings):
        (warning,) = got
        assert str(big) in warning and str(budget) in warning
        assert "nodeAgent.budget" in warning and "include/exclude" in warning
        assert "ml/imagenet" in warning and REV in warning


def test_no_capacity_warning_when_it_fits_or_nothing_is_known():
    fits = nodes(budgets=(GIB,))
    for cache_index, node_index in (
        (caches(revision_bytes=GIB), fits),  # exactly the budget fits
        (caches(revision_bytes=10 * GIB), nodes("n1")),  # no node published a budget
        (caches(revision_bytes=None), fits),  # size unknown
    ):
        _ops, _result, warnings = admit_pod(pod(), cache_index=cache_index, node_index=node_index)
        assert warnings == []
    # A pod carrying an older revision: the cache's bytes are another revision's, so not judged.
    old = pod({"dscache.io/revision": REV2})
    _ops, _result, warnings = admit_pod(old, cache_index=caches(revision_bytes=10 * GIB), node_index=fits)
    assert warnings == []


def test_cache_view_reads_the_revision_bytes():
    body = {
        "spec": spec().model_dump(mode="json", exclude_none=True),
        "status": {"phase": "Ready", "revision": {"id": REV, "objects": 3, "bytes": 12345, "versioned": False}},
    }
    assert webhook.cache_view(body).revision_bytes == 12345
    body["status"]["revision"]["bytes"] = "12345"
    assert webhook.cache_view(body).revision_bytes is None
    del body["status"]["revision"]
    assert webhook.cache_view(body).revision_bytes is None


def test_a_jobs_own_placement_annotation_reaches_its_pods():
    """The cache annotation may sit on the Job itself; the placement one beside it must
    not be silently lost: it is copied onto the template, which the pods inherit."""
    obj = job()
    obj["metadata"]["annotations"]["dscache.io/placement"] = "Required"
    warnings: list[str] = []
    _ops, result = run_mutate(obj, caches(), nodes=nodes(), warnings=warnings)
    assert result["spec"]["template"]["metadata"]["annotations"]["dscache.io/placement"] == "Required"
    assert "affinity" not in result["spec"]["template"]["spec"]
    (warning,) = warnings
    assert "Pending" in warning
    # The template's own value wins; a bad Job-level value is refused at the Job.
    obj["spec"]["template"]["metadata"]["annotations"] = {"dscache.io/placement": "preferred"}
    _ops, result = run_mutate(obj, caches(), nodes=nodes(), warnings=[])
    assert result["spec"]["template"]["metadata"]["annotations"]["dscache.io/placement"] == "preferred"
    obj = job()
    obj["metadata"]["annotations"]["dscache.io/placement"] = "sometimes"
    with pytest.raises(kopf.AdmissionError) as e:
        run_mutate(obj, caches(), nodes=nodes(), warnings=[])
    assert "'sometimes'" in str(e.value)


def test_a_csi_volume_is_the_nodes_copy_and_gets_placed():
    """Warm placement applies to the node's copy whichever way it is mounted (the CSI volume, the
    default, as well as a hostPath), never to a pod's own emptyDir."""
    from dscache_operator.admission.placement import uses_node_copy

    csi_vol = {"name": "dscache-data", "csi": {"driver": "cache.dscache.io", "volumeAttributes": {}}}
    host = {"name": "dscache-data", "hostPath": {"path": "/x"}}
    assert uses_node_copy({"volumes": [csi_vol]}) and uses_node_copy({"volumes": [host]})
    assert not uses_node_copy({"volumes": [{"name": "dscache-data", "emptyDir": {}}]})
    assert not uses_node_copy({"volumes": [{"name": "dscache-data", "csi": {"driver": "other.example.com"}}]})
