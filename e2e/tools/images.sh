#!/usr/bin/env bash
# Build container images from real Dockerfiles without Docker or a registry,
# into OCI archives that e2e/kind/up.sh loads into the kind nodes.
#
#   e2e/tools/images.sh base                             only the debian:bookworm-slim base
#   e2e/tools/images.sh build REF DOCKERFILE [CONTEXT]   build one image; prints its OCI archive
#   e2e/tools/images.sh key DOCKERFILE [CONTEXT]         print the input key a build would use
#   e2e/tools/images.sh run REF CMD...                   run CMD in a built image (make release-check)
#
# How: `debootstrap --variant=minbase bookworm` makes the base rootfs (cached
# as a tarball outside the repo, keyed by suite and month), buildah commits
# it under the exact name the Dockerfiles' FROM line uses, `buildah bud
# --pull=never --network host` builds, `buildah push` writes an OCI archive.
# A FROM docker.io/library/rust:X.Y.Z-slim-bookworm (the stager's native
# stage) is made the way that official image is, on this base: Debian's
# ca-certificates, gcc and libc6-dev, and rustup's minimal profile of
# toolchain X.Y.Z (rustc, cargo, rust-std), taken from the host's rustup (see
# rust_base). Cargo's cache mounts (RUN --mount=type=cache) live under
# $IMAGES_CACHE/tmp, so a rebuild compiles only what changed in native/.
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
# buildah keeps RUN --mount=type=cache directories (cargo's registry and
# target dir) under $TMPDIR/buildah-cache-$UID: ours, beside its storage.
export TMPDIR=$IMAGES_CACHE/tmp
mkdir -p "$TMPDIR"

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
  # cargo reads no pip.conf: a Dockerfile that fetches crates takes the bundle as this ARG.
  printf '%s\n' --build-arg BUILD_CA_FILE=/run/host-ca.crt
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

# quiet CMD...: CMD, its stderr without runc's warnings that it cannot
# raise ambient capabilities this sandbox's bounding set lacks.
quiet() { "$@" 2> >(grep -v 'ambient capability' >&2 || true); }  # grep finds nothing: no error

# The official rust:X.Y.Z-slim-bookworm, made here: its Dockerfile installs
# ca-certificates, gcc and libc6-dev on debian:bookworm-slim, then runs
# `rustup-init --profile minimal --default-toolchain X.Y.Z` into
# RUSTUP_HOME=/usr/local/rustup, CARGO_HOME=/usr/local/cargo. We take the same
# release's files from the host's rustup (`make install` builds the venv's
# wheel with it; rustup installs the version if the host lacks it): exactly the
# files rustup's own manifests list for rustc, cargo and rust-std, plus the
# rustup binary and its proxies. Committed under REF, stamped with the base
# tarball and the version.
RUST_HOST=$(uname -m)-unknown-linux-gnu
RUST_COMPONENTS=(rustc cargo rust-std)

# host_toolchain VERSION: the host's rustup toolchain dir whose rustc is VERSION.
host_toolchain() {
  local ver=$1 home=${RUSTUP_HOME:-$HOME/.rustup} tc
  for tc in "$home/toolchains/$ver-$RUST_HOST" "$home"/toolchains/*-"$RUST_HOST"; do
    [ -x "$tc/bin/rustc" ] && [[ $("$tc/bin/rustc" -V) == "rustc $ver "* ]] && { readlink -f "$tc"; return; }
  done
  command -v rustup >/dev/null || die "no rustc $ver in $home/toolchains and no rustup to install it"
  log "rustup toolchain install $ver --profile minimal (the host has no rustc $ver)"
  rustup toolchain install "$ver" --profile minimal >&2
  readlink -f "$home/toolchains/$ver-$RUST_HOST"
}

rust_base() {
  local ref=$1 ver
  ver=${ref#docker.io/library/rust:}; ver=${ver%-slim-$SUITE}
  [[ $ver =~ ^[0-9]+\.[0-9]+\.[0-9]+$ ]] || die "$ref: only docker.io/library/rust:X.Y.Z-slim-$SUITE can be made here"
  local stamp; stamp="$(basename "$BASE_TAR") rust-$ver"
  if [ "$("${BUILDAH[@]}" inspect --type image --format '{{index .ImageAnnotations "dscache.base"}}' "$ref" 2>/dev/null)" = "$stamp" ]; then
    log "rust image: $ref present"; return
  fi
  local tc; tc=$(host_toolchain "$ver")
  local runc; runc=$(tool_bin runc)/runc
  local c; c=$("${BUILDAH[@]}" from --pull=never "$BASE_REF")
  quiet "${BUILDAH[@]}" run --runtime "$runc" --network host "$c" -- sh -c 'apt-get update -qq &&
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends ca-certificates gcc libc6-dev >/dev/null &&
    rm -rf /var/lib/apt/lists/*' >&2
  local mnt; mnt=$("${BUILDAH[@]}" mount "$c")
  local dest=$mnt/usr/local/rustup/toolchains/$ver-$RUST_HOST comp
  mkdir -p "$dest/lib/rustlib" "$mnt/usr/local/cargo/bin"
  {
    echo 'config_version = "1"'
    for comp in "${RUST_COMPONENTS[@]}"; do
      sed -n 's/^file://p' "$tc/lib/rustlib/manifest-$comp-$RUST_HOST" | (cd "$tc" && xargs cp -a --parents -t "$dest")
      cp "$tc/lib/rustlib/manifest-$comp-$RUST_HOST" "$dest/lib/rustlib/"
      echo "$comp-$RUST_HOST" >>"$dest/lib/rustlib/components"
      printf '\n[[components]]\npkg = "%s"\ntarget = "%s"\nis_extension = false\n' "$comp" "$RUST_HOST"
    done
  } >"$dest/lib/rustlib/multirust-config.toml"
  cp "$tc/lib/rustlib/multirust-channel-manifest.toml" "$tc/lib/rustlib/rust-installer-version" "$dest/lib/rustlib/"
  cp "$(readlink -f "$(command -v rustup || echo "$HOME/.cargo/bin/rustup")")" "$mnt/usr/local/cargo/bin/rustup"
  for comp in cargo rustc rustdoc rust-gdb rust-gdbgui rust-lldb; do ln -s rustup "$mnt/usr/local/cargo/bin/$comp"; done
  printf 'version = "12"\ndefault_toolchain = "%s"\nprofile = "minimal"\n' "$ver-$RUST_HOST" >"$mnt/usr/local/rustup/settings.toml"
  chmod -R a+w "$mnt/usr/local/rustup" "$mnt/usr/local/cargo"
  "${BUILDAH[@]}" umount "$c" >/dev/null
  "${BUILDAH[@]}" config --env RUSTUP_HOME=/usr/local/rustup --env CARGO_HOME=/usr/local/cargo \
    --env PATH=/usr/local/cargo/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    --env RUST_VERSION="$ver" --annotation "dscache.base=$stamp" "$c"
  quiet "${BUILDAH[@]}" run --runtime "$runc" "$c" -- sh -c 'rustup --version 2>/dev/null && cargo --version && rustc --version' >&2
  "${BUILDAH[@]}" commit -q --rm "$c" "$ref" >/dev/null
  log "rust image: committed $ref (rustc $ver from $tc)"
}

# from_images DOCKERFILE: the images its FROM lines name that are not its own stages.
from_images() {
  awk 'toupper($1) == "FROM" {
         for (i = 2; i <= NF; i++) if ($i !~ /^--/) { ref = $i; break }
         if (!(ref in stage)) print ref
         if (toupper($(NF - 1)) == "AS") stage[$NF] = 1
       }' "$1" | sort -u
}

# bases DOCKERFILE: every image the Dockerfile builds FROM, made and committed here.
bases() {
  local ref
  base
  for ref in $(from_images "$1"); do
    case $ref in
      "$BASE_REF") ;;
      docker.io/library/rust:*-slim-"$SUITE") timed "rust image $ref" rust_base "$ref" ;;
      *) die "$1: FROM $ref: no way to make it here (no registry)" ;;
    esac
  done
}

# bud_logged LOG ARGS...: buildah bud into LOG, each line stamped with the
# seconds since the build began (which step costs what), runc's warnings dropped.
bud_logged() {
  local blog=$1; shift
  "${BUILDAH[@]}" bud "$@" 2>&1 | awk -v t0="$(date +%s)" '!/ambient capability/ { printf "[%4ds] %s\n", systime() - t0, $0; fflush() }' >"$blog" ||
    { tail -n 25 "$blog" >&2; die "buildah bud failed (log: $blog)"; }
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
  bases "$dockerfile"
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

# run REF CMD...: CMD in a throwaway container of the built image REF, as its user.
run_in() {
  local ref=$1 c rc=0; shift
  local runc; runc=$(tool_bin runc)/runc
  c=$("${BUILDAH[@]}" from --pull=never "$ref")
  quiet "${BUILDAH[@]}" run --runtime "$runc" "$c" -- "$@" || rc=$?
  "${BUILDAH[@]}" rm "$c" >/dev/null
  return $rc
}

USAGE="usage: images.sh base | build REF DOCKERFILE [CONTEXT] | key DOCKERFILE [CONTEXT] | run REF CMD..."
main() {
  case ${1:-} in
    base) base ;;
    build) shift; [ $# -ge 2 ] || die "$USAGE"; build "$@" ;;
    key) shift; [ $# -ge 1 ] || die "$USAGE"; input_key "$1" "${2:-$(dirname "$1")}"; return ;;
    run) shift; [ $# -ge 2 ] || die "$USAGE"; need; run_in "$@" ;;
    *) die "$USAGE" ;;
  esac
  log "images.sh done in $(since "$T0")s"
}

main "$@"
