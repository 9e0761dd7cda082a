#!/usr/bin/env bash
# Installs everything rlfleet needs on a fresh Debian machine, as root. Idempotent: when nothing it
# depends on changed since the last run, it only checks and returns.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
STAMP="$VENV/.install-stamp"

# System packages: Redis for hot state, bubblewrap for sandboxes.
missing=()
command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
command -v bwrap >/dev/null 2>&1 || missing+=(bubblewrap)
if [ ${#missing[@]} -gt 0 ]; then
  echo "install: apt-get install ${missing[*]}"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# The real interpreter, not a pyenv shim: sandboxes and child processes exec it directly.
python=$(command -v python3.11 || command -v python3)
real_python=$("$python" -c 'import os, sys; print(os.path.realpath(sys.executable))')
"$real_python" -c 'import sys; assert sys.version_info[:2] == (3, 11), f"rlfleet needs Python 3.11, found {sys.version}"'

packages=(libs/common libs/weights libs/envkit libs/cli services/*/)
want=$(cat requirements/lock.txt scripts/install.sh "${packages[@]/%//pyproject.toml}" | sha256sum | cut -c1-16)
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ] && [ -x "$VENV/bin/python" ]; then
  exit 0
fi

echo "install: creating $VENV with $real_python"
[ -x "$VENV/bin/python" ] || "$real_python" -m venv "$VENV"
pip=("$VENV/bin/python" -m pip install --quiet --disable-pip-version-check)
# torch first and pinned: anything that lets pip choose would pull a multi-GB CUDA build.
"${pip[@]}" "torch==2.13.0"
"${pip[@]}" -r requirements/lock.txt
editable=()
for pkg in "${packages[@]}"; do editable+=(-e "${pkg%/}"); done
# Editable, so the checkout is what runs; setuptools' warnings about this mode go to a log.
"${pip[@]}" --no-deps --no-build-isolation --config-settings editable_mode=compat "${editable[@]}" \
  >"$VENV/install-editable.log" 2>&1 || { cat "$VENV/install-editable.log"; exit 1; }
"$VENV/bin/python" -m pip check --disable-pip-version-check
echo "$want" > "$STAMP"
echo "install: done"
