#!/usr/bin/env bash
# Builds rlfleet's base image from Debian packages alone, when it is not there yet: no image
# registry is needed (none is reachable from every machine rlfleet is built on).
#
#   deploy/docker/build-base.sh            # makes $RLFLEET_BASE_IMAGE (default rlfleet-base:bookworm-<hash>)
#   deploy/docker/build-base.sh --name     # prints that name only
#
# `debootstrap --variant=minbase bookworm` into a temporary folder, then `docker import`. The base
# carries what every rlfleet container runs beside the venv: Python 3.11 (bookworm's python3),
# bubblewrap and tini (sandboxes), redis-server (the stack's Redis runs from the same image),
# libibverbs1 (Mooncake's TransferEngine links it, even over tcp) and
# CA certificates (pip inside `docker build`). Quick when the image exists: it only checks.
set -euo pipefail

MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
PACKAGES=python3,python3-venv,ca-certificates,bubblewrap,tini,redis-server,procps,libibverbs1
# The tag names what is in it, so a change of PACKAGES makes a new base rather than reuse the old.
IMAGE=${RLFLEET_BASE_IMAGE:-rlfleet-base:bookworm-$(echo "$PACKAGES" | sha256sum | cut -c1-8)}
if [ "${1:-}" = "--name" ]; then echo "$IMAGE"; exit 0; fi

if docker image inspect "$IMAGE" >/dev/null 2>&1; then
  echo "build-base: $IMAGE is present"
  exit 0
fi
command -v debootstrap >/dev/null 2>&1 || { echo "build-base: debootstrap is missing (apt-get install debootstrap)" >&2; exit 1; }

root=$(mktemp -d /tmp/rlfleet-base.XXXXXX)
trap 'rm -rf "$root"' EXIT
echo "build-base: debootstrap --variant=minbase bookworm ($PACKAGES)"
start=$(date +%s)
debootstrap --variant=minbase --include="$PACKAGES" bookworm "$root" "$MIRROR" >"$root.log" 2>&1 \
  || { tail -20 "$root.log" >&2; rm -f "$root.log"; exit 1; }
rm -f "$root.log"
# What an image needs no copy of: apt's package lists and downloaded .debs, docs and man pages.
rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/archives/*.deb "$root"/usr/share/doc/* \
  "$root"/usr/share/man/* "$root"/usr/share/locale/*
# The package mirror inside the image, so `apt-get install` works in a derived image (host network).
echo "deb $MIRROR bookworm main" > "$root/etc/apt/sources.list"
tar --numeric-owner -C "$root" -c . | docker import \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8' \
  --change 'CMD ["/bin/bash"]' \
  --message "rlfleet base: debootstrap --variant=minbase bookworm + $PACKAGES" - "$IMAGE" >/dev/null
echo "build-base: $IMAGE built in $(( $(date +%s) - start )) s ($(docker image inspect -f '{{.Size}}' "$IMAGE" | awk '{printf "%.0f MB", $1/1e6}'))"
