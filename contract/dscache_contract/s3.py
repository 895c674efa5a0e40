"""S3 defaults both sides use, so the source check lists what the stager copies.

Region: the spec's region, else us-east-1. The environment (AWS_REGION) is
deliberately not consulted: a bucket's region is a property of the source, not
of whichever pod or operator happens to read it (EKS injects the cluster's
region into pods, which need not be the bucket's). us-east-1 is what S3's
global endpoint and most S3-compatible stores (MinIO, Ceph RGW, versitygw)
accept when no region is configured.

Addressing style: the spec's, else path-style with a custom endpoint and
virtual-hosted on AWS. In-cluster stores (MinIO, Ceph RGW) rarely have the
wildcard DNS that virtual-hosted style needs, while AWS deprecated path style.
Huawei OBS and Alibaba OSS refuse path style: set addressingStyle: virtual.
"""

from __future__ import annotations

from typing import Literal

AddressingStyle = Literal["path", "virtual"]
DEFAULT_REGION = "us-east-1"


def resolve_region(region: str | None) -> str:
    return region or DEFAULT_REGION


def resolve_addressing_style(endpoint_url: str | None, style: str | None) -> AddressingStyle:
    if style not in (None, "", "path", "virtual"):
        raise ValueError(f"addressing style must be 'path' or 'virtual', got {style!r}")
    if style:
        return style  # type: ignore[return-value]
    return "path" if endpoint_url else "virtual"
