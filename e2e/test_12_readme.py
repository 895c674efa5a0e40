"""12. The README's own path, run as written: install, opt in, the sample DatasetCache, the sample Job.

The commands are read from README.md, between the markers
``<!-- readme-path:begin -->`` and ``<!-- readme-path:end -->``, and run one by
one with bash, kubectl and helm from the working tree (cwd = the repo). Only
what this test environment must differ in is substituted, each listed in
SUBSTITUTIONS below:
  - the image repositories (no registry here: the images are imported into
    the kind nodes), plus their tag and pull policy, appended to `helm install`;
  - cacheRoot (each node's own disk);
  - in e2e/samples/datasetcache.yaml: the S3 endpoint and the two REPLACE_ME keys
    (as the README tells the reader to edit them), through a copy of the file;
  - in e2e/samples/job.yaml: the training image.
Everything else (namespaces, chart values, the DatasetCache, the Job, the
waits) is the README's. It replaces the session's release with the README's
own (same name, dscache in dscache-system), so it runs last; the release stays
installed with the README's values.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import tempfile
import time
from pathlib import Path

from conftest import RELEASE, RELEASE_NS, REPO, _split_image
from support.kube import node_sh, wait_for

README = REPO / "README.md"
SAMPLE_ENDPOINT = "http://10.251.0.1:9000"
README_CACHE_ROOT = "/mnt/nvme/dscache"
README_OPERATOR_REPO = "registry.example.com/dscache-operator"
README_STAGER_REPO = "registry.example.com/dscache-stager"


def readme_commands() -> list[str]:
    """The shell commands of the README's marked block (continuations joined, comments dropped)."""
    text = README.read_text()
    m = re.search(r"<!-- readme-path:begin -->\s*```bash\n(.*?)```\s*<!-- readme-path:end -->", text, re.S)
    assert m, "README.md has no ```bash block between <!-- readme-path:begin --> and <!-- readme-path:end -->"
    commands, current = [], ""
    for line in m.group(1).splitlines():
        stripped = line.strip()
        if not current and (not stripped or stripped.startswith("#")):
            continue
        if stripped.endswith("\\"):
            current += stripped[:-1] + " "
            continue
        commands.append((current + stripped).strip())
        current = ""
    assert not current, f"unterminated continuation: {current}"
    return commands


def _substitute(cmd: str, cfg, workdir: Path) -> str:
    """SUBSTITUTIONS: what this environment must change in a README command (see the docstring)."""
    op_repo, op_tag = _split_image(cfg.operator_image)
    st_repo, st_tag = _split_image(cfg.stager_image)
    out = cmd.replace(README_CACHE_ROOT, cfg.cache_root)
    if out.startswith("helm install"):
        assert README_OPERATOR_REPO in out and README_STAGER_REPO in out, out
        out = out.replace(README_OPERATOR_REPO, op_repo).replace(README_STAGER_REPO, st_repo)
        out += (
            f" --set image.tag={op_tag} --set image.pullPolicy={cfg.pull_policy}"
            f" --set stager.image.tag={st_tag} --set stager.image.pullPolicy={cfg.pull_policy}"
        )
    if "e2e/samples/datasetcache.yaml" in out:
        text = (REPO / "e2e/samples/datasetcache.yaml").read_text()
        assert text.count("REPLACE_ME") == 2 and SAMPLE_ENDPOINT in text
        text = text.replace(SAMPLE_ENDPOINT, cfg.endpoint_pod)
        text = text.replace("AWS_ACCESS_KEY_ID: REPLACE_ME", f'AWS_ACCESS_KEY_ID: "{cfg.s3["AWS_ACCESS_KEY_ID"]}"')
        text = text.replace(
            "AWS_SECRET_ACCESS_KEY: REPLACE_ME", f'AWS_SECRET_ACCESS_KEY: "{cfg.s3["AWS_SECRET_ACCESS_KEY"]}"'
        )
        (workdir / "datasetcache.yaml").write_text(text)
        out = out.replace("e2e/samples/datasetcache.yaml", str(workdir / "datasetcache.yaml"))
    if "e2e/samples/job.yaml" in out:
        text = (REPO / "e2e/samples/job.yaml").read_text().replace("localhost/dscache-stager:e2e", cfg.stager_image)
        (workdir / "job.yaml").write_text(text)
        out = out.replace("e2e/samples/job.yaml", str(workdir / "job.yaml"))
    return out


def _fresh(kube, cache_root: str) -> None:
    """A cluster as the README reader has it: no release, no namespace ml, no dscache-system."""
    # --no-hooks: this only clears the way for the README's install; the chart's pre-delete
    # hook (which waits for every cache to be wiped) is tested by e2e/test_99_uninstall.py.
    kube.helm("uninstall", RELEASE, "-n", RELEASE_NS, "--wait", "--timeout", "180s", "--no-hooks", check=False)
    if kube.get("namespace", "ml") is not None:
        for dsc in kube.items("datasetcaches.dscache.io", namespace="ml"):
            kube.kubectl(
                "patch",
                "datasetcache",
                dsc["metadata"]["name"],
                "-n",
                "ml",
                "--type=merge",
                "-p",
                '{"metadata":{"finalizers":null}}',
                check=False,
            )
        kube.kubectl("delete", "namespace", "ml", "--wait=true", timeout=180)
    kube.kubectl("delete", "namespace", RELEASE_NS, "--ignore-not-found", "--wait=true", timeout=180)
    # A fresh cluster holds no copy of ml/* on its nodes. Earlier runs (make demo, other
    # branches with another on-disk layout) may have left one that no running operator
    # knows about; a stager would then sync over it.
    for node in kube.items("nodes"):
        node_sh(f"rm -rf {shlex.quote(cache_root)}/ml", check=True, node=node["metadata"]["name"])


def test_readme_path_verbatim(cfg, kube, s3, dataset, release):
    # The sample's bucket, filled with the session's dataset (a reader brings their own).
    try:
        s3.create_bucket(Bucket="demo-datasets")
    except s3.exceptions.BucketAlreadyOwnedByYou:
        pass
    # Exactly the session's dataset under the prefix (make demo leaves other objects there).
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket="demo-datasets", Prefix="imagenet-mini/"):
        for item in page.get("Contents", []):
            s3.delete_object(Bucket="demo-datasets", Key=item["Key"])
    for key, data in dataset.files.items():
        s3.put_object(Bucket="demo-datasets", Key=f"imagenet-mini/{key}", Body=data)
    commands = readme_commands()
    joined = "\n".join(commands)
    for must in (
        "helm install dscache charts/dscache",
        "kubectl apply -f e2e/samples/datasetcache.yaml",
        "kubectl apply -f e2e/samples/job.yaml",
        "dscache.io/injection=enabled",
    ):
        assert must in joined, f"the README path lost {must!r}:\n{joined}"
    assert "secretNamespaces" not in joined and "readSecrets" not in joined, (
        "the README path must work with the chart's defaults for Secret reading"
    )

    _fresh(kube, cfg.cache_root)
    bindir = Path(tempfile.mkdtemp(prefix="dscache-readme-bin-"))
    (bindir / "kubectl").symlink_to(kube.kubectl_bin)
    (bindir / "helm").symlink_to(kube.helm_bin)
    env = {**os.environ, "KUBECONFIG": kube.kubeconfig, "PATH": f"{bindir}:{os.environ['PATH']}"}
    transcript = []
    for cmd in commands:
        run = _substitute(cmd, cfg, bindir)
        t0 = time.monotonic()
        p = subprocess.run(["bash", "-c", run], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
        transcript.append(f"$ {run}\n{p.stdout}{p.stderr}(exit {p.returncode}, {time.monotonic() - t0:.1f} s)")
        if p.returncode != 0:
            diag = kube.kubectl("describe", "dsc", "-n", "ml", check=False).stdout[-3000:]
            pods = kube.kubectl("describe", "pods", "-n", "ml", check=False).stdout[-3000:]
            raise AssertionError(
                "a README command failed:\n"
                + "\n".join(transcript)
                + f"\n--- kubectl describe dsc -n ml\n{diag}\n--- pods\n{pods}"
            )
    print("\n".join(transcript))

    # What the README promises the reader sees: the cache Ready, the Job complete, its log.
    dsc = kube.get("datasetcache", "imagenet-mini", "ml")
    assert dsc["status"]["phase"] == "Ready", dsc["status"]
    cond = next(c for c in dsc["status"]["conditions"] if c["type"] == "SourceReady")
    assert cond["status"] == "True", cond  # the controller read the Secret with the chart's defaults
    job = kube.get("job", "train-resnet", "ml")
    assert any(c["type"] == "Complete" and c["status"] == "True" for c in job["status"]["conditions"]), job
    log = kube.kubectl("logs", "job/train-resnet", "-n", "ml", "-c", "train").stdout
    assert re.search(rf"read {dataset.objects} files, .* as uid 1000; 0 mismatches", log), log
    # Clean up the sample while the README's controller still runs (it wipes and
    # releases its finalizer).
    kube.kubectl("delete", "namespace", "ml", "--wait=false", check=False)
    wait_for("namespace ml gone", lambda: kube.get("namespace", "ml") is None, timeout=120)
