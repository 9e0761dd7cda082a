#!/usr/bin/env bash
# Builds rlfleet's one image (deploy/docker/Dockerfile) with no image registry:
#
#   deploy/docker/build.sh [TAG]      # default rlfleet:dev ($RLFLEET_IMAGE)
#
# 1. the base image from Debian packages, when missing (build-base.sh);
# 2. torch's CPU wheel into .docker/wheels/ (build context): the one pip is configured to find on
#    this machine (find-links) when there is one, else downloaded from PyTorch's CPU index; so pip
#    inside the build never takes PyPI's multi-GB CUDA build;
# 3. `docker build --network host --target deps` tagged rlfleet-deps:<hash of what it installs>:
#    the third-party packages, kept as a cache (like the base) when an image built on it is removed;
# 4. the image itself on it: the repository's packages (pip and apt reach the registries through
#    the host network). A rebuild after a source edit redoes only these last, small layers.
set -euo pipefail
cd "$(dirname "$0")/../.."

TAG=${1:-${RLFLEET_IMAGE:-rlfleet:dev}}
BASE=$(bash deploy/docker/build-base.sh --name)
TORCH=torch==2.13.0
PY=${PYTHON:-python3}

bash deploy/docker/build-base.sh

wheels=.docker/wheels
mkdir -p "$wheels"
if ! ls "$wheels"/torch-2.13.0+cpu-*.whl >/dev/null 2>&1; then
  links=$({ "$PY" -m pip config get global.find-links 2>/dev/null || true; echo "${PIP_FIND_LINKS:-}"; } | tr ' ' '\n')
  found=""
  for dir in $links; do
    dir=${dir#file://}
    for whl in "$dir"/torch-2.13.0+cpu-cp311-*.whl; do [ -f "$whl" ] && found=$whl && break 2; done
  done
  if [ -n "$found" ]; then
    echo "build: torch wheel from $found"
    ln -f "$found" "$wheels/" 2>/dev/null || cp "$found" "$wheels/"
  else
    echo "build: downloading $TORCH (CPU) from download.pytorch.org"
    "$PY" -m pip download --quiet --no-deps --python-version 3.11 --platform manylinux_2_28_x86_64 \
      --only-binary=:all: --index-url https://download.pytorch.org/whl/cpu -d "$wheels" "$TORCH"
  fi
fi

# The CA certificates pip trusts here (pip's `cert`, else the system bundle): a machine behind a
# TLS-inspecting proxy has its own CA, which the base image's bundle lacks. Used by the build only.
cert=$("$PY" -m pip config get global.cert 2>/dev/null || true)
cert=${PIP_CERT:-${cert:-/etc/ssl/certs/ca-certificates.crt}}
if [ -f "$cert" ]; then cp "$cert" .docker/ca-certificates.crt; else : > .docker/ca-certificates.crt; fi

key=$(cat requirements/lock.txt scripts/install.sh scripts/megatron_bridge_wheel.py \
  <(docker image inspect -f '{{.Id}}' "$BASE") <(sed '/^FROM deps/,$d' deploy/docker/Dockerfile) | sha256sum | cut -c1-12)
DEPS=${RLFLEET_DEPS_IMAGE:-rlfleet-deps:$key}
start=$(date +%s)
docker build --network host --force-rm --build-arg BASE_IMAGE="$BASE" --target deps \
  -f deploy/docker/Dockerfile -t "$DEPS" .
docker build --network host --force-rm --build-arg BASE_IMAGE="$BASE" -f deploy/docker/Dockerfile -t "$TAG" .
size=$(docker image inspect -f '{{.Size}}' "$TAG" | awk '{printf "%.0f MB", $1/1e6}')
echo "build: $TAG in $(( $(date +%s) - start )) s, $size"
