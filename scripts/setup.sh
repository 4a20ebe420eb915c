#!/usr/bin/env bash
# Create .venv (if missing) and install shardpoint with its demo and store extras and the test group.
# torch is pinned by constraints.txt to the CPU build; the library itself asks torch>=2.6.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
stamp=.venv/.shardpoint-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ constraints.txt -nt "$stamp" ]; then
  # the machine's pip config lists local wheel folders that may be absent: hide only those warnings
  # pip >= 25.1 reads the test tools from pyproject's [dependency-groups] (--group)
  .venv/bin/python -m pip install --quiet "pip>=25.1" 2>&1 | { grep -v "^WARNING: Location" || true; }
  .venv/bin/python -m pip install --quiet -c constraints.txt -e ".[demo,s3,gcs,azure]" --group test 2>&1 \
    | { grep -v "^WARNING: Location" || true; }
  # torchtitan's own requirements (datasets, wandb, tensorboard) pin fsspec below what s3fs needs;
  # the checkpoint manager it tests needs none of them, so take torchtitan alone plus what it imports.
  .venv/bin/python -m pip install --quiet -c constraints.txt --no-deps torchtitan einops tyro spmd_types \
    docstring-parser typeguard 2>&1 | { grep -v "^WARNING: Location" || true; }
  .venv/bin/python -c "import torch, shardpoint, torchtitan.components.checkpointer" && touch "$stamp"
fi
# Azurite, the Azure Storage emulator the cloud-store tests start, comes from the npm registry;
# the tests skip Azure with a message naming this step when it is absent.
if [ ! -x .tools/azurite/node_modules/.bin/azurite-blob ] && command -v npm >/dev/null 2>&1; then
  mkdir -p .tools/azurite
  npm install --prefix .tools/azurite --silent --no-audit --no-fund azurite@3 >/dev/null 2>&1 \
    || echo "setup: could not install Azurite with npm; the Azure tests will be skipped" >&2
fi
