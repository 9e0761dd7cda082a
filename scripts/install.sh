#!/usr/bin/env bash
# Installs everything rlfleet needs on a fresh Debian machine, as root. Idempotent: when nothing it
# depends on changed since the last run, it only checks and returns.
#
#   scripts/install.sh                 system packages, dockerd, then the venv (what `make test` runs)
#   scripts/install.sh --no-system     the venv only (inside an image: deploy/docker/Dockerfile)
#   scripts/install.sh --deps-only     third-party packages only, not the repository's (an image's
#                                      cached layer); implies nothing about the stamp
set -euo pipefail
cd "$(dirname "$0")/.."

system=1
deps_only=0
for arg in "$@"; do
  case "$arg" in
    --no-system) system=0 ;;
    --deps-only) deps_only=1 ;;
    *) echo "install: unknown option $arg" >&2; exit 2 ;;
  esac
done

VENV=${VENV:-.venv}
STAMP="$VENV/.install-stamp"

# System packages: Redis for hot state, bubblewrap for sandboxes, tini as a sandbox's pid 1; the
# validators the deploy tests run: docker-compose and promtool (from Debian's prometheus); and what
# the compose test builds and runs the image with: Docker's engine and debootstrap (the base image).
install_system() {
missing=()
command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
command -v bwrap >/dev/null 2>&1 || missing+=(bubblewrap)
command -v tini >/dev/null 2>&1 || missing+=(tini)
command -v docker-compose >/dev/null 2>&1 || missing+=(docker-compose)
command -v promtool >/dev/null 2>&1 || missing+=(prometheus)
# Mooncake's TransferEngine (peer-to-peer weight transfer) links libibverbs even when it speaks tcp.
# Not `grep -q`: it exits at the first match, ldconfig dies of SIGPIPE, and pipefail reads that as
# "missing" (an apt-get on every make call).
ldconfig -p 2>/dev/null | grep 'libibverbs\.so\.1 ' >/dev/null || missing+=(libibverbs1)
command -v dockerd >/dev/null 2>&1 || missing+=(docker.io)
command -v debootstrap >/dev/null 2>&1 || missing+=(debootstrap)
if [ ${#missing[@]} -gt 0 ]; then
  echo "install: apt-get install ${missing[*]}"
  # Packages with a daemon (prometheus, redis-server) start it from their postinst unless
  # policy-rc.d forbids it; we only want the binaries, so forbid it for this install.
  policy=/usr/sbin/policy-rc.d
  if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' > "$policy" && chmod +x "$policy"
    trap 'rm -f "$policy"' EXIT
  fi
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  if [ ! -e /run/systemd/system ] && pgrep -x prometheus >/dev/null 2>&1; then
    echo "install: warning: a prometheus server is running (not started by rlfleet); rlfleet needs only promtool" >&2
  fi
fi
start_dockerd
}

# A Docker engine for the compose test, when none answers and there is no systemd to start one.
# Not fatal: the test says why it skips when the engine cannot start here (e.g. no root).
start_dockerd() {
  command -v dockerd >/dev/null 2>&1 || return 0
  docker info >/dev/null 2>&1 && return 0
  if [ -e /run/systemd/system ]; then
    systemctl start docker >/dev/null 2>&1 || true
  elif [ "$(id -u)" = 0 ] && ! pgrep -x dockerd >/dev/null 2>&1; then
    echo "install: starting dockerd (log: /var/log/rlfleet-dockerd.log)"
    setsid dockerd >/var/log/rlfleet-dockerd.log 2>&1 < /dev/null &
  fi
  for _ in $(seq 1 40); do docker info >/dev/null 2>&1 && return 0; sleep 0.5; done
  echo "install: warning: no Docker engine answers (see /var/log/rlfleet-dockerd.log); the compose test will skip" >&2
}

[ "$system" = 1 ] && install_system

# The real interpreter, not a pyenv shim: sandboxes and child processes exec it directly.
python=$(command -v python3.11 || command -v python3)
real_python=$("$python" -c 'import os, sys; print(os.path.realpath(sys.executable))')
"$real_python" -c 'import sys; assert sys.version_info[:2] == (3, 11), f"rlfleet needs Python 3.11, found {sys.version}"'

# The Node environment client's packages (examples/node_env: @grpc/grpc-js, @grpc/proto-loader, from
# its committed lockfile), when node is on the machine; again whenever the lockfile changes.
node_env=examples/node_env
if command -v npm >/dev/null 2>&1 && ! cmp -s "$node_env/package-lock.json" "$node_env/node_modules/.rlfleet-lock"; then
  echo "install: npm ci in $node_env"
  (cd "$node_env" && npm ci --no-audit --no-fund --silent) && cp "$node_env/package-lock.json" "$node_env/node_modules/.rlfleet-lock"
fi

packages=(libs/common libs/weights libs/envkit libs/cli services/*/)
if [ "$deps_only" = 1 ]; then
  want=none
else
want=$(cat requirements/lock.txt scripts/install.sh scripts/megatron_bridge_wheel.py "${packages[@]/%//pyproject.toml}" \
  | sha256sum | cut -c1-16)
fi
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ] && [ -x "$VENV/bin/python" ]; then
  exit 0
fi

echo "install: creating $VENV with $real_python"
[ -x "$VENV/bin/python" ] || "$real_python" -m venv "$VENV"
pip=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)
# torch first and pinned: anything that lets pip choose would pull a multi-GB CUDA build.
"${pip[@]}" "torch==2.13.0"
"${pip[@]}" -r requirements/lock.txt
# megatron-bridge (HF <-> Megatron conversion for the trainer's Megatron backend) declares its whole
# training stack (transformers < 5, transformer-engine, wandb, ...), which the conversion never uses:
# its upstream wheel is installed with its dependency list cut to what the trainer imports
# (scripts/megatron_bridge_wheel.py says why and how), so that `pip check` stays meaningful.
bridge_dir=$(mktemp -d)
"$VENV/bin/python" -m pip download --quiet --disable-pip-version-check --no-deps -d "$bridge_dir" \
  "megatron-bridge==0.3.1"
bridge_wheel=$("$VENV/bin/python" scripts/megatron_bridge_wheel.py "$bridge_dir"/megatron_bridge-0.3.1-*.whl \
  "$bridge_dir/out")
"${pip[@]}" --no-deps "$bridge_wheel"
rm -rf "$bridge_dir"
if [ "$deps_only" = 1 ]; then
  "$VENV/bin/python" -m pip check --disable-pip-version-check
  echo "install: third-party packages done"
  exit 0
fi
editable=()
for pkg in "${packages[@]}"; do editable+=(-e "${pkg%/}"); done
# Editable, so the checkout is what runs; setuptools' warnings about this mode go to a log.
"${pip[@]}" --no-deps --no-build-isolation --config-settings editable_mode=compat "${editable[@]}" \
  >"$VENV/install-editable.log" 2>&1 || { cat "$VENV/install-editable.log"; exit 1; }
"$VENV/bin/python" -m pip check --disable-pip-version-check
echo "$want" > "$STAMP"
echo "install: done"
