"""The checking STS of tests/support/sts.py, run in the cluster for test_11_identity.py.

A pod of the stager image (it has python3; the STS is stdlib only) in the main test
namespace, behind Service ``e2e-sts``: it reads the cluster's issuer and JWKS with its own
ServiceAccount token (system:serviceaccounts may: ClusterRole
system:service-account-issuer-discovery), and hands out the suite's S3 keys only to the
subject the role trusts. The release points the controller and the stagers at it
(podIdentity.stsEndpoint, set in conftest.py's release fixture).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

NAME = "e2e-sts"
PORT = 8080
SOURCE = Path(__file__).resolve().parents[2] / "tests" / "support" / "sts.py"
AUDIENCE = "sts.amazonaws.com"


def endpoint(namespace: str) -> str:
    return f"http://{NAME}.{namespace}.svc:{PORT}"


def manifests(namespace: str, image: str, pull_policy: str, roles: dict[str, dict[str, str]]) -> list[dict[str, Any]]:
    """ConfigMap (the STS's code and roles), ServiceAccount, Pod and Service.
    ``roles``: {role ARN: {subject, access_key, secret_key}}."""
    labels = {"app": NAME, "e2e": "dscache"}
    config = {"audience": AUDIENCE, "roles": roles}
    meta = {"name": NAME, "namespace": namespace, "labels": labels}
    return [
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": meta,
            "data": {"sts.py": SOURCE.read_text(), "config.json": json.dumps(config)},
        },
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta},
        {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": meta,
            "spec": {
                "serviceAccountName": NAME,
                "containers": [
                    {
                        "name": "sts",
                        "image": image,
                        "imagePullPolicy": pull_policy,
                        "command": ["python3", "/sts/sts.py", "--config", "/sts/config.json", "--port", str(PORT)],
                        "ports": [{"containerPort": PORT}],
                        "readinessProbe": {"httpGet": {"path": "/healthz", "port": PORT}, "periodSeconds": 1},
                        "volumeMounts": [{"name": "sts", "mountPath": "/sts", "readOnly": True}],
                        "securityContext": {
                            "runAsNonRoot": True,
                            "allowPrivilegeEscalation": False,
                            "capabilities": {"drop": ["ALL"]},
                            "seccompProfile": {"type": "RuntimeDefault"},
                        },
                    }
                ],
                "volumes": [{"name": "sts", "configMap": {"name": NAME}}],
            },
        },
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": meta,
            "spec": {"selector": {"app": NAME}, "ports": [{"port": PORT, "targetPort": PORT}]},
        },
    ]


def decisions(log: str) -> list[list[Any]]:
    """What the STS decided, from its log: [role ARN, subject, "ok" or the refusal] per request."""
    out = []
    for line in log.splitlines():
        if line.startswith("["):
            out.append(json.loads(line))
    return out
