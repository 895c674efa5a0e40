#!/usr/bin/env python3
"""Write a one-layer FROM-scratch OCI image archive holding a single static binary.

Used for the pod sandbox ("pause") image: there is no registry to pull
registry.k8s.io/pause from, and no Docker to build it, so we write the OCI
image layout (oci-layout, index.json, blobs/sha256/...) by hand and tar it.
`ctr -n k8s.io images import` reads the name from the index's
io.containerd.image.name annotation. Output is byte-for-byte reproducible.
"""

import argparse
import hashlib
import io
import json
import os
import tarfile


def tar_bytes(entries):
    """entries: list of (name, bytes, mode). Fixed mtimes/owners: reproducible."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data, mode in entries:
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), mode, 0
            info.uid = info.gid = 0
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def blob(data):
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    return digest, data


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--binary", required=True, help="static binary, becomes /<basename>")
    ap.add_argument("--ref", required=True, help="full image name, e.g. registry.k8s.io/pause:3.10.1")
    ap.add_argument("--user", default="", help="image config User, e.g. 65535:65535")
    ap.add_argument("--out", required=True, help="output .tar (OCI archive)")
    a = ap.parse_args()

    name = os.path.basename(a.binary)
    with open(a.binary, "rb") as f:
        layer = tar_bytes([(name, f.read(), 0o755)])
    layer_digest, _ = blob(layer)

    config = {
        "architecture": "amd64",
        "os": "linux",
        "config": {"Entrypoint": ["/" + name], "User": a.user} if a.user else {"Entrypoint": ["/" + name]},
        # Uncompressed layer: diff_id == layer digest.
        "rootfs": {"type": "layers", "diff_ids": [layer_digest]},
    }
    config_digest, config_data = blob(json.dumps(config, sort_keys=True).encode())

    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {
            "mediaType": "application/vnd.oci.image.config.v1+json",
            "digest": config_digest,
            "size": len(config_data),
        },
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": layer_digest, "size": len(layer)}],
    }
    manifest_digest, manifest_data = blob(json.dumps(manifest, sort_keys=True).encode())

    tag = a.ref.rsplit(":", 1)[1] if ":" in a.ref.rsplit("/", 1)[-1] else "latest"
    index = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [
            {
                "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "digest": manifest_digest,
                "size": len(manifest_data),
                "platform": {"architecture": "amd64", "os": "linux"},
                "annotations": {"io.containerd.image.name": a.ref, "org.opencontainers.image.ref.name": tag},
            }
        ],
    }

    entries = [
        ("oci-layout", b'{"imageLayoutVersion":"1.0.0"}', 0o644),
        ("index.json", json.dumps(index, sort_keys=True).encode(), 0o644),
    ]
    for digest, data in ((layer_digest, layer), (config_digest, config_data), (manifest_digest, manifest_data)):
        entries.append(("blobs/sha256/" + digest.split(":", 1)[1], data, 0o644))
    with open(a.out + ".tmp", "wb") as f:
        f.write(tar_bytes(entries))
    os.replace(a.out + ".tmp", a.out)
    print(f"{a.out}: {a.ref} manifest {manifest_digest}")


if __name__ == "__main__":
    main()
