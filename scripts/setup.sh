#!/usr/bin/env bash
# Installs what ringflex needs on a fresh Debian 12 machine. `--test` also installs the Python tools that only
# the test suite uses (PyTorch and transformers as oracles; the library and CLI never need Python).
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO=sudo
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends \
  g++ cmake make git python3 python3-pip \
  openmpi-bin libopenmpi-dev libopenblas-dev \
  libgtest-dev libgmock-dev libcli11-dev nlohmann-json3-dev libyaml-cpp-dev libsentencepiece-dev >/dev/null
if [ "${1:-}" = "--test" ]; then
  # Pinned: the model parity tests compare against this exact transformers (SPEC §8).
  python3 -m pip install -q --disable-pip-version-check -r "$(dirname "$0")/../tests/requirements.txt" 2>&1 \
    | grep -v "Running pip as the 'root' user" || true
fi
