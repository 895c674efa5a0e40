#!/usr/bin/env bash
# The end-to-end suite on a 3-node kind cluster, with the real JobSet and Kubeflow
# training-operator controllers (see README.md in this directory).
#   bash e2e/kind/run.sh              cluster + images + S3 + controllers, then e2e/run.sh against it
#   DSCACHE_KIND_KEEP=1 ...           leave the cluster (and our dockerd) up afterwards (development)
# Without DSCACHE_KIND_KEEP=1 everything is torn down at the end (e2e/kind/down.sh),
# whatever the outcome: no cluster, no S3 container, no dockerd of ours, no rules.
set -Eeuo pipefail
REPO=$(cd "$(dirname "$0")/../.." && pwd)
cd "$REPO"
T0=$SECONDS
if [ "${DSCACHE_KIND_KEEP:-0}" != 1 ]; then trap 'bash e2e/kind/down.sh || true' EXIT; fi
# shellcheck source=up.sh
source e2e/kind/up.sh
t=$SECONDS; bash e2e/kind/controllers.sh; echo "[kind] controllers: $((SECONDS - t)) s"
echo "[kind] cluster, images, S3 and controllers ready after $((SECONDS - T0)) s"
rc=0
DSCACHE_E2E_SKIP_UP=1 DSCACHE_E2E_SKIP_IMAGES=1 DSCACHE_E2E_MULTINODE=1 \
DSCACHE_E2E_KUBECTL=$KUBECTL DSCACHE_E2E_HELM=$HELM \
DSCACHE_E2E_STAGER_IMAGE=$STAGER_IMAGE DSCACHE_E2E_OPERATOR_IMAGE=$OPERATOR_IMAGE \
DSCACHE_E2E_PULL_POLICY=Never DSCACHE_E2E_CACHE_ROOT=$CACHE_ROOT \
DSCACHE_E2E_S3_ENV=/dev/null DSCACHE_E2E_S3_ENDPOINT_POD=$S3_ENDPOINT_POD \
DSCACHE_E2E_NODE_EXEC="$NODE_EXEC" DSCACHE_E2E_REJOIN_CMD="$KIND_REJOIN_CMD" \
  bash e2e/run.sh || rc=$?
echo "[kind] e2e/kind/run.sh: $((SECONDS - T0)) s in all"
exit $rc
