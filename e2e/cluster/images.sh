#!/usr/bin/env bash
# Build container images from real Dockerfiles without Docker or a registry,
# and import them into the local cluster's containerd.
#
#   e2e/cluster/images.sh                      base + the project's images (those whose Dockerfile exists)
#   e2e/cluster/images.sh base                 only the debian:bookworm-slim base
#   e2e/cluster/images.sh build REF DOCKERFILE [CONTEXT]   build one image and import it
#   e2e/cluster/images.sh import ARCHIVE       import an OCI/docker archive into containerd
#
# How: `debootstrap --variant=minbase bookworm` makes the base rootfs (cached
# as a tarball outside the repo, keyed by suite and month), buildah commits
# it under the exact name the Dockerfiles' FROM line uses, `buildah bud
# --pull=never --network host` builds, `buildah push` writes an OCI archive,
# and `ctr -n k8s.io images import` loads it into the cluster's containerd.
# Every step logs its duration.
set -Eeuo pipefail
source "$(dirname "$0")/lib.sh"

BASE_REF=docker.io/library/debian:bookworm-slim
SUITE=bookworm
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
# Refresh the base once a month (security updates) unless pinned.
BASE_STAMP=${DSCACHE_BASE_STAMP:-$(date -u +%Y-%m)}
IMAGES_CACHE=${DSCACHE_IMAGES_CACHE:-$HOME/.cache/dscache/images}
BASE_TAR=$IMAGES_CACHE/debian-$SUITE-minbase-$BASE_STAMP.tar
ARCHIVES=$IMAGES_CACHE/archives
# buildah's own storage, kept apart from any other user of buildah here. vfs:
# no overlay-on-overlay or fuse needed.
BUILDAH=(buildah --storage-driver vfs --root "$IMAGES_CACHE/buildah/root" --runroot "$IMAGES_CACHE/buildah/runroot")

# The project's images: REF DOCKERFILE CONTEXT. Others own the Dockerfiles;
# a missing one is skipped with a note. The default refs are the ones the
# e2e suite and `make demo` use (e2e/conftest.py, e2e/run.sh); a plain
# `helm install` needs --set image.repository=localhost/dscache-operator
# --set image.tag=e2e (and the same under stager.image).
PROJECT_IMAGES=(
  "${DSCACHE_STAGER_IMAGE:-localhost/dscache-stager:e2e} init-container/Dockerfile ."
  "${DSCACHE_OPERATOR_IMAGE:-localhost/dscache-operator:e2e} operator/Dockerfile ."
)

# Build-time trust for a TLS-intercepting proxy. Where the host trusts an
# extra CA (this sandbox sets PIP_CERT / SSL_CERT_FILE to a bundle holding
# one), RUN steps get that bundle mounted at /run/host-ca.crt and an
# /etc/pip.conf that points pip at it, so `pip install` works during the build.
# Both are bind mounts, never image content; buildah leaves an empty stub file
# at each mount point. Elsewhere (no such variable) nothing is mounted.
# DSCACHE_BUILD_CA=none turns it off; DSCACHE_BUILD_CA=/path picks the bundle.
build_ca_mounts() {
  local ca=${DSCACHE_BUILD_CA:-${PIP_CERT:-${SSL_CERT_FILE:-}}}
  [ -n "$ca" ] && [ "$ca" != none ] && [ -f "$ca" ] || return 0
  mkdir -p "$IMAGES_CACHE"
  printf '[global]\ncert = /run/host-ca.crt\n' >"$IMAGES_CACHE/build-pip.conf"
  printf '%s\n' --volume "$ca:/run/host-ca.crt:ro" --volume "$IMAGES_CACHE/build-pip.conf:/etc/pip.conf:ro"
}

need() {
  local missing=()
  command -v buildah >/dev/null || missing+=(buildah)
  command -v debootstrap >/dev/null || missing+=(debootstrap)
  [ ${#missing[@]} = 0 ] && return
  log "installing ${missing[*]} from Debian"
  DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${missing[@]}" >/dev/null
}

debootstrap_into() {
  debootstrap --variant=minbase "$SUITE" "$1" "$MIRROR" >"$1.log" 2>&1 ||
    { tail -n 20 "$1.log" >&2; die "debootstrap failed"; }
}

# A minbase rootfs tarball, made once per $BASE_STAMP.
make_base_tar() {
  [ -f "$BASE_TAR" ] && { log "base rootfs: cached $BASE_TAR"; return; }
  mkdir -p "$IMAGES_CACHE"
  local root; root=$(mktemp -d "$IMAGES_CACHE/rootfs.XXXX")
  timed "debootstrap --variant=minbase $SUITE" debootstrap_into "$root"
  # What debian:bookworm-slim has: deb822 sources with updates and security,
  # and no package caches.
  rm -f "$root/etc/apt/sources.list"
  cat >"$root/etc/apt/sources.list.d/debian.sources" <<EOF
Types: deb
URIs: $MIRROR
Suites: $SUITE $SUITE-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: ${MIRROR%/debian}/debian-security
Suites: $SUITE-security
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
  rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/* "$root"/var/log/*.log "$root.log"
  timed "tar base rootfs" tar --numeric-owner -C "$root" -cf "$BASE_TAR.tmp" .
  mv "$BASE_TAR.tmp" "$BASE_TAR"
  rm -rf "$root"
  log "base rootfs: $(du -h "$BASE_TAR" | cut -f1) $BASE_TAR"
}

# Commit the rootfs as $BASE_REF in buildah's storage (skipped if present and
# made from the same tarball).
commit_base() {
  local stamp
  stamp=$("${BUILDAH[@]}" inspect --type image --format '{{index .ImageAnnotations "dscache.base"}}' "$BASE_REF" 2>/dev/null || true)
  if [ "$stamp" = "$(basename "$BASE_TAR")" ]; then log "base image: $BASE_REF present"; return; fi
  local c; c=$("${BUILDAH[@]}" from scratch)
  local mnt; mnt=$("${BUILDAH[@]}" mount "$c")
  tar --numeric-owner -C "$mnt" -xf "$BASE_TAR"
  "${BUILDAH[@]}" umount "$c" >/dev/null
  "${BUILDAH[@]}" config --cmd /bin/bash --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    --annotation "dscache.base=$(basename "$BASE_TAR")" "$c"
  "${BUILDAH[@]}" commit -q --rm "$c" "$BASE_REF" >/dev/null
  log "base image: committed $BASE_REF"
}

BASE_READY=false
base() {
  $BASE_READY && return
  need
  timed "base rootfs" make_base_tar
  timed "commit $BASE_REF" commit_base
  BASE_READY=true
}

# import ARCHIVE: into the running cluster's containerd.
import() {
  local ctr; ctr=$(tool_bin containerd)/ctr
  [ -S "$CONTAINERD_SOCK" ] || die "containerd is not running ($CONTAINERD_SOCK); run e2e/cluster/up first"
  timed "ctr import $(basename "$1")" "$ctr" --address "$CONTAINERD_SOCK" -n k8s.io images import "$1" \
    >/dev/null 2> >(grep -v 'support for cgroup v1 is deprecated' >&2 || true)
}

bud_logged() {
  local blog=$1; shift
  "${BUILDAH[@]}" bud "$@" >"$blog" 2>&1 || { grep -v 'ambient capability' "$blog" | tail -n 25 >&2; die "buildah bud failed (log: $blog)"; }
}

# build REF DOCKERFILE [CONTEXT]: build with buildah, export, import.
build() {
  local ref=$1 dockerfile=$2 context=${3:-$(dirname "$2")}
  base
  # RUN steps execute with our own runc (Debian's buildah only recommends one).
  local runc; runc=$(tool_bin runc)/runc
  local ca_mounts; mapfile -t ca_mounts < <(build_ca_mounts)
  # Build output goes to a log: a failing step shows its tail.
  mkdir -p "$ARCHIVES"
  local blog; blog="$ARCHIVES/$(echo "$ref" | tr '/:' '__').build.log"
  timed "buildah bud $ref" bud_logged "$blog" --runtime "$runc" --pull=never --network host --layers=false \
    "${ca_mounts[@]}" -f "$dockerfile" -t "$ref" "$context"
  local archive; archive="$ARCHIVES/$(echo "$ref" | tr '/:' '__').oci.tar"
  rm -f "$archive"
  # oci-archive keeps the full name in the index, which ctr import reads.
  # Uncompressed: the archive is only read once, locally, by ctr import.
  timed "buildah push $ref" "${BUILDAH[@]}" push -q --disable-compression "$ref" "oci-archive:$archive:$ref"
  log "$ref: $(du -h "$archive" | cut -f1) archive"
  # vfs stores full copies: drop the untagged image a rebuild leaves behind.
  "${BUILDAH[@]}" rmi --prune >/dev/null 2>&1 || true
  if [ -S "$CONTAINERD_SOCK" ]; then import "$archive"; else log "cluster not up: not imported ($archive)"; fi
}

main() {
  case ${1:-all} in
    base) base ;;
    build) shift; [ $# -ge 2 ] || die "usage: images.sh build REF DOCKERFILE [CONTEXT]"; build "$@" ;;
    import) shift; import "$1" ;;
    all)
      base
      local spec ref df ctx
      for spec in "${PROJECT_IMAGES[@]}"; do
        read -r ref df ctx <<<"$spec"
        if [ -f "$REPO/$df" ]; then build "$ref" "$REPO/$df" "$REPO/$ctx"; else log "skip $ref: no $df yet"; fi
      done ;;
    *) die "unknown command $1 (base | build | import | no argument for all)" ;;
  esac
  log "images.sh done in $(since "$T0")s"
}

main "$@"
