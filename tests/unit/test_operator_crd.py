"""The CRD in crds/ is generated from the pydantic models and never drifts."""

from __future__ import annotations

from pathlib import Path

import pydantic
import pytest
import yaml

from dscache_contract import human_bytes
from dscache_operator.api import crdgen, models

REPO = Path(__file__).resolve().parents[2]
CRD_FILE = REPO / "crds" / "datasetcache.yaml"


def test_crd_file_matches_models():
    assert CRD_FILE.read_text() == crdgen.render(), (
        "crds/datasetcache.yaml drifted from the models; regenerate with "
        "`.venv/bin/python -m dscache_operator.api.crdgen > crds/datasetcache.yaml`"
    )


def _walk(schema, path="spec"):
    yield path, schema
    for name, sub in (schema.get("properties") or {}).items():
        yield from _walk(sub, f"{path}.{name}")
    if isinstance(schema.get("items"), dict):
        yield from _walk(schema["items"], f"{path}[]")
    if isinstance(schema.get("additionalProperties"), dict):
        yield from _walk(schema["additionalProperties"], f"{path}{{}}")


def _version(crd):
    (version,) = crd["spec"]["versions"]
    return version


def test_crd_names_and_shape():
    crd = yaml.safe_load(CRD_FILE.read_text())
    spec = crd["spec"]
    assert crd["metadata"]["name"] == "datasetcaches.dscache.io"
    assert spec["scope"] == "Namespaced"
    assert spec["names"]["kind"] == "DatasetCache"
    assert spec["names"]["shortNames"] == ["dsc"]
    version = _version(crd)
    assert version["name"] == "v1alpha1"
    assert version["subresources"] == {"status": {}}
    assert [c["name"] for c in version["additionalPrinterColumns"]] == [
        "Phase",
        "Objects",
        "Size",
        "Revision",
        "Ready nodes",
        "Age",
        "Source",
        "Warm",
        "Prestaged",
        "Reason",
    ]


def test_every_spec_and_status_field_is_described_and_structural():
    root = _version(yaml.safe_load(CRD_FILE.read_text()))["schema"]["openAPIV3Schema"]
    for top in ("spec", "status"):
        for path, node in _walk(root["properties"][top], top):
            assert "$ref" not in node, path
            if "anyOf" in node:
                assert node.get("x-kubernetes-int-or-string"), f"{path}: union in a structural schema"
            if not path.endswith("{}") and not path.endswith("[]"):
                assert node.get("description"), f"{path} has no description (kubectl explain)"
            if "anyOf" not in node:
                assert node.get("type"), f"{path} has no type"


def test_cel_rules_present():
    text = CRD_FILE.read_text()
    assert "x-kubernetes-validations" in text
    assert "RetainWhileUsed" in text


def _cache(**spec):
    base = {"source": {"uri": "s3://bucket/prefix/"}, "mountPath": "/data"}
    base.update(spec)
    return models.DatasetCacheSpec.model_validate(base)


def test_model_defaults_and_helpers():
    spec = _cache()
    assert spec.retention.policy == "WipeOnJobCompletion"
    assert spec.source.bucket == "bucket" and spec.source.prefix == "prefix/"
    assert spec.source.secret_name is None
    spec = _cache(source={"uri": "s3://b-1/x", "credentials": {"secretRef": {"name": "s3"}}})
    assert spec.source.secret_name == "s3"


@pytest.mark.parametrize(
    "bad",
    [
        {"source": {"uri": "http://bucket/x"}},
        {"source": {"uri": "s3://bucket/", "addressingStyle": "weird"}},
        {"source": {"uri": "s3://bucket/", "unknownField": 1}},
        {"mountPath": "relative/path"},
        {"retention": {"policy": "Forever"}},
        {"retention": {"policy": "RetainWhileUsed", "ttlAfterLastUse": "ten minutes"}},
    ],
)
def test_model_rejects_bad_specs(bad):
    with pytest.raises(pydantic.ValidationError):
        _cache(**bad)


def test_durations_and_sizes():
    assert models.parse_duration("1h30m") == 5400
    assert models.parse_duration("2d") == 172800
    with pytest.raises(ValueError):
        models.parse_duration("1x")
    assert human_bytes(0) == "0 B"
    assert human_bytes(1536) == "1.5 KiB"
    assert human_bytes(3 * 1024**3) == "3.0 GiB"
    assert human_bytes(5 * 1024**4) == "5.0 TiB"


def test_crd_is_not_in_the_all_category():
    """`kubectl delete all --all` must not delete DatasetCaches (a deletion wipes every node's copy)."""
    import yaml

    names = yaml.safe_load(crdgen.render())["spec"]["names"]
    assert "all" not in names["categories"] and "dscache" in names["categories"]
