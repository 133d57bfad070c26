#!/usr/bin/env bash
# Installs what ringflex needs on a fresh Debian 12 machine. `--test` also installs the Python tools that only
# the test suite uses (PyTorch and transformers as oracles; the library and CLI never need Python) into a
# virtual environment inside the repo, `.venv/` (ignored by git), where CMake finds it (RINGFLEX_PYTHON).
# `--oracles-only` installs only those, where a plain `scripts/setup.sh` has installed the system packages
# (python3-venv among them): `.ci/run` runs it beside the sanitizer pass, which needs no Python, since the
# install is mostly a wait on the network.
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive
SUDO=""
[ "$(id -u)" -eq 0 ] || SUDO=sudo
if [ "${1:-}" != "--oracles-only" ]; then
  $SUDO apt-get update -qq
  # iproute2: `ip netns` and `tc` for the namespaced-hosts tests (tests/hosts/; `tc netem` also needs the kernel's
  # sch_netem module). ocl-icd-opencl-dev: Debian builds oneDNN with its OpenCL GPU runtime, and its CMake package config
  # (dnnl-config.cmake) requires OpenCL's headers and libOpenCL.so, which libdnnl-dev only recommends; with
  # --no-install-recommends, find_package(dnnl) fails without it. Nothing here runs OpenCL.
  $SUDO apt-get install -y -qq --no-install-recommends \
    g++ cmake make git python3 python3-pip python3-venv \
    openmpi-bin libopenmpi-dev iproute2 libopenblas-dev libdnnl-dev ocl-icd-opencl-dev \
    libgtest-dev libgmock-dev libcli11-dev nlohmann-json3-dev libyaml-cpp-dev libsentencepiece-dev \
    libpng-dev libjpeg-dev \
    clang-format >/dev/null
fi
if [ "${1:-}" = "--test" ] || [ "${1:-}" = "--oracles-only" ]; then
  # Test-only Python oracles, in a venv rather than the system interpreter: Debian 12's python3 refuses
  # `pip install` outside one (PEP 668), and the pins below must not fight the system's packages. Any failure
  # stops the script with pip's own error (no `|| true`): a missing oracle must never turn a test into a skip.
  repo="$(cd "$(dirname "$0")/.." && pwd)"
  venv="$repo/.venv"
  requirements="$repo/tests/requirements.txt"
  requirements_nodeps="$repo/tests/requirements-nodeps.txt"  # packages read for their data files only
  fail() { echo "scripts/setup.sh --test: $*" >&2; exit 1; }
  # --system-site-packages: a machine that already has the pinned versions system-wide (a CI image) reuses them
  # instead of installing torch's several GB again; anything missing or at another version goes into the venv,
  # and the read-back below checks the versions the venv actually sees.
  [ -x "$venv/bin/python3" ] || python3 -m venv --system-site-packages "$venv" \
    || fail "cannot create the virtual environment $venv"
  # Pinned: the model parity tests compare against this exact transformers (docs/spec.md §8).
  "$venv/bin/python3" -m pip install -q --disable-pip-version-check -r "$requirements" \
    || fail "pip could not install $requirements into $venv (see pip's message above)"
  "$venv/bin/python3" -m pip install -q --disable-pip-version-check --no-deps -r "$requirements_nodeps" \
    || fail "pip could not install $requirements_nodeps into $venv (see pip's message above)"
  # Read back what is installed: a pin that pip resolved differently is as wrong as a missing package.
  "$venv/bin/python3" - "$requirements" "$requirements_nodeps" <<'PY' \
    || fail "the installed test packages do not match $requirements and $requirements_nodeps"
import sys
from importlib.metadata import PackageNotFoundError, version

wrong = []
for line in (line for path in sys.argv[1:] for line in open(path)):
    line = line.split("#", 1)[0].strip()
    if not line:
        continue
    name, pinned = (part.strip() for part in line.split("=="))
    try:
        found = version(name).split("+", 1)[0]  # torch reports a local build tag, e.g. 2.15.0+cu132
    except PackageNotFoundError:
        found = "missing"
    if found != pinned:
        wrong.append(f"{name} {found} (pinned {pinned})")
for w in wrong:
    print("  " + w, file=sys.stderr)
sys.exit(1 if wrong else 0)
PY
  echo "scripts/setup.sh --test: test oracles installed in $venv"
fi
