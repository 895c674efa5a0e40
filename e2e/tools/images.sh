#!/usr/bin/env bash
# Build container images from real Dockerfiles without Docker or a registry,
# into OCI archives that e2e/kind/up.sh loads into the kind nodes.
#
#   e2e/tools/images.sh base                             only the debian:bookworm-slim base
#   e2e/tools/images.sh build REF DOCKERFILE [CONTEXT]   build one image; prints its OCI archive
#
# How: `debootstrap --variant=minbase bookworm` makes the base rootfs (cached
# as a tarball outside the repo, keyed by suite and month), buildah commits
# it under the exact name the Dockerfiles' FROM line uses, `buildah bud
# --pull=never --network host` builds, `buildah push` writes an OCI archive.
# An archive is reused only if it was built from the same inputs: the
# Dockerfile, every file its COPY lines name (their content), and the base
# tarball (see input_key). A change in the clone's code always rebuilds.
# Every step logs its duration.
set -Eeuo pipefail
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
now() { date +%s.%N; }
since() { awk -v a="$(now)" -v b="$1" 'BEGIN { printf "%.1f", a - b }'; }
T0=$(now)
log() { printf '[%6ss] %s\n' "$(since "$T0")" "$*" >&2; }
die() { log "ERROR: $*"; exit 1; }
trap 'log "ERROR: exit $? at ${BASH_SOURCE[0]##*/}:$LINENO: $BASH_COMMAND"' ERR
# timed NAME CMD...: run CMD and log how long it took.
timed() {
  local name=$1 t; shift
  t=$(now)
  "$@"
  log "$name: done in $(since "$t")s"
}
tool_bin() { bash "$HERE/tools.sh" --path "$1" | tail -n1; }

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

bud_logged() {
  local blog=$1; shift
  "${BUILDAH[@]}" bud "$@" >"$blog" 2>&1 || { grep -v 'ambient capability' "$blog" | tail -n 25 >&2; die "buildah bud failed (log: $blog)"; }
}

# input_key DOCKERFILE CONTEXT: a hash of everything the build reads from the
# clone: the Dockerfile, the content of every path its COPY lines name (not
# COPY --from), and the base tarball's name. Same key = same image inputs.
input_key() {
  local dockerfile=$1 context=$2 src
  {
    sha256sum <"$dockerfile"
    basename "$BASE_TAR"
    # COPY [--chown=..] SRC... DEST: every word but the first and the last, flags skipped.
    awk 'toupper($1) == "COPY" && !/--from/ { for (i = 2; i < NF; i++) if ($i !~ /^--/) print $i }' "$dockerfile" |
      while read -r src; do
        (cd "$context" && find "$src" -type f ! -path '*/__pycache__/*' ! -name '*.pyc' -print0 | sort -z |
          xargs -0 sha256sum)
      done
  } | sha256sum | cut -c1-16
}

# build REF DOCKERFILE [CONTEXT]: build with buildah into an OCI archive (reused
# when its inputs are unchanged); prints the archive's path.
build() {
  local ref=$1 dockerfile=$2 context=${3:-$(dirname "$2")}
  mkdir -p "$ARCHIVES"
  local name; name=$(echo "$ref" | tr '/:' '__')
  local archive="$ARCHIVES/$name.oci.tar" keyfile="$ARCHIVES/$name.key" key
  base
  key=$(input_key "$dockerfile" "$context")
  if [ -f "$archive" ] && [ "$(cat "$keyfile" 2>/dev/null)" = "$key" ]; then
    log "$ref: inputs unchanged (key $key): reusing $archive"
    echo "$archive"; return
  fi
  # RUN steps execute with our own runc (Debian's buildah only recommends one).
  local runc; runc=$(tool_bin runc)/runc
  local ca_mounts; mapfile -t ca_mounts < <(build_ca_mounts)
  # Build output goes to a log: a failing step shows its tail.
  local blog="$ARCHIVES/$name.build.log"
  timed "buildah bud $ref" bud_logged "$blog" --runtime "$runc" --pull=never --network host --layers=false \
    "${ca_mounts[@]}" -f "$dockerfile" -t "$ref" "$context"
  rm -f "$archive" "$keyfile"
  # oci-archive keeps the full name in the index, which `kind load image-archive` reads.
  # Uncompressed: the archive is only read locally.
  timed "buildah push $ref" "${BUILDAH[@]}" push -q --disable-compression "$ref" "oci-archive:$archive:$ref"
  echo "$key" >"$keyfile"
  log "$ref: $(du -h "$archive" | cut -f1) archive (key $key)"
  # vfs stores full copies: drop the untagged image a rebuild leaves behind.
  "${BUILDAH[@]}" rmi --prune >/dev/null 2>&1 || true
  echo "$archive"
}

main() {
  case ${1:-} in
    base) base ;;
    build) shift; [ $# -ge 2 ] || die "usage: images.sh build REF DOCKERFILE [CONTEXT]"; build "$@" ;;
    *) die "usage: images.sh base | build REF DOCKERFILE [CONTEXT]" ;;
  esac
  log "images.sh done in $(since "$T0")s"
}

main "$@"
