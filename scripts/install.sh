#!/usr/bin/env bash
# Install hpcdl into a project virtual environment, from nothing.
#
# TensorFlow and Horovod are pinned as a pair: a Horovod wheel links against the exact TensorFlow
# it was built with (HorovodVersionMismatchError otherwise), and Horovod 0.28.1, its last release,
# builds unmodified against tensorflow-cpu 2.16. The built Horovod wheel is cached, keyed on every
# input that changes its binary, so a second install takes seconds instead of ~3 minutes.
#
# HPCDL_MPI=1 (`make install MPI=1`) builds Horovod with MPI beside Gloo, against the MPI that
# `mpicc` finds (a site's MPI module, loaded first), for `run.controller = "mpi"`; the one wheel
# serves both controllers. Where no mpicc is found and this runs as root with apt-get, Debian's
# Open MPI (built with PMIx and SLURM support) is installed first, as tests/slurm/cluster.sh
# installs SLURM; elsewhere the install stops and says what to load.
set -euo pipefail

VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
TF_VERSION=${TF_VERSION:-2.16.2}
HOROVOD_VERSION=${HOROVOD_VERSION:-0.28.1}
WHEEL_CACHE=${HPCDL_WHEEL_CACHE:-$HOME/.cache/hpcdl/wheels}
MPI=${HPCDL_MPI:-0}
MPI_PACKAGES=(openmpi-bin libopenmpi-dev)

step() { printf '\n==> %s\n' "$*"; }
fail() { printf '\nhpcdl install FAILED: %s\n' "$*" >&2; exit 1; }
trap 'fail "step exited with status $? (line $LINENO); see the output above"' ERR
case "$MPI" in 0|1) ;; *) fail "HPCDL_MPI (make install MPI=...) must be 0 or 1, got '$MPI'" ;; esac

install_debian_mpi() {
  if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    fail "HPCDL_MPI=1 needs an MPI compiler wrapper (mpicc) on PATH: load your site's MPI module, or apt-get install ${MPI_PACKAGES[*]}"
  fi
  step "Debian's Open MPI: apt-get install ${MPI_PACKAGES[*]}"
  local log="${TMPDIR:-/tmp}/hpcdl-mpi-apt.log"
  ( export DEBIAN_FRONTEND=noninteractive
    apt-get -o DPkg::Lock::Timeout=600 update -qq &&
      apt-get -o DPkg::Lock::Timeout=600 install -y -qq --no-install-recommends "${MPI_PACKAGES[@]}"
  ) >"$log" 2>&1 || { tail -n 30 "$log" >&2; fail "apt-get install ${MPI_PACKAGES[*]} failed (log: $log)"; }
}

# The MPI a wheel was compiled against is part of its cache key (the wheel links that MPI's
# library): e.g. "open-mpi-4.1.4-1a2b3c4d", the version line and a hash of the wrapper's flags.
mpi_identity() {
  local name flags
  name=$(mpirun --version 2>/dev/null | head -n 1 | tr 'A-Z' 'a-z' | tr -cs 'a-z0-9.' '-' | sed 's/^mpirun-//; s/-$//')
  flags=$(mpicc -show 2>/dev/null || mpicc -showme 2>/dev/null || echo unknown)
  printf '%s-%s' "${name:-unknown-mpi}" "$(printf '%s' "$flags" | sha256sum | cut -c1-8)"
}

if [ "$MPI" = 1 ]; then
  command -v mpicc >/dev/null || install_debian_mpi
  command -v mpicc >/dev/null && command -v mpirun >/dev/null ||
    fail "HPCDL_MPI=1: mpicc and mpirun must both be on PATH (load your site's MPI module)"
fi

step "virtual environment $VENV ($($PYTHON --version))"
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV" || fail "cannot create a venv with $PYTHON (install python3-venv)"
PY="$VENV/bin/python"
# TensorBoard 2.16 imports pkg_resources, which setuptools 81 and newer no longer ship.
"$PY" -m pip install --quiet --upgrade pip "setuptools>=77,<81" wheel packaging "cmake<5"

step "tensorflow-cpu==$TF_VERSION"
"$PY" -m pip install --quiet "tensorflow-cpu==$TF_VERSION"

abi=$("$PY" -c 'import sys; print(f"cp{sys.version_info.major}{sys.version_info.minor}")')
if [ "$MPI" = 1 ]; then
  key="horovod-$HOROVOD_VERSION-tf$TF_VERSION-$abi-gloo-mpi-$(mpi_identity)-$(uname -m)"
  with_mpi=HOROVOD_WITH_MPI=1
else
  key="horovod-$HOROVOD_VERSION-tf$TF_VERSION-$abi-gloo-nompi-$(uname -m)"
  with_mpi=HOROVOD_WITHOUT_MPI=1
fi
cached="$WHEEL_CACHE/$key"
if ! ls "$cached"/horovod-*.whl >/dev/null 2>&1; then
  step "building Horovod $HOROVOD_VERSION against TensorFlow $TF_VERSION, $with_mpi (3-5 minutes, once)"
  command -v g++ >/dev/null || fail "g++ is needed to build Horovod (apt-get install g++)"
  build=$(mktemp -d)
  # Gloo's CMakeLists predates CMake 4's minimum policy; -j2 keeps the build within memory
  # (each compiler process peaks near 1.5 GB; Horovod's default is -j8). --no-cache-dir: pip's
  # own wheel cache keys on the sdist alone and would hand back a build without MPI (or with).
  env CMAKE_POLICY_VERSION_MINIMUM=3.5 MAKEFLAGS=-j2 \
  HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_GLOO=1 "$with_mpi" \
  HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_WITHOUT_MXNET=1 \
    "$PY" -m pip wheel --no-cache-dir --no-build-isolation --no-deps --no-binary horovod \
      -w "$build" "horovod==$HOROVOD_VERSION" || fail "Horovod build failed (needs g++, cmake, python3-dev)"
  mkdir -p "$cached"
  mv "$build"/horovod-*.whl "$cached"/
  rm -rf "$build"
else
  step "Horovod wheel from cache: $cached"
fi
"$PY" -m pip install --quiet --force-reinstall --no-deps "$cached"/horovod-*.whl
# Horovod's own runtime dependencies (it was installed without them so pip cannot replace TF).
"$PY" -m pip install --quiet cloudpickle psutil pyyaml

step "hpcdl and its dependencies"
"$PY" -m pip install --quiet -e ".[test]"

step "checking the installation"
HPCDL_MPI=$MPI "$PY" - <<'EOF' || fail "Horovod does not load with TensorFlow and Gloo (and MPI, with HPCDL_MPI=1)"
import os
import horovod.tensorflow as hvd
assert hvd.gloo_built(), "Horovod was built without Gloo"
mpi = os.environ["HPCDL_MPI"] == "1"
assert hvd.mpi_built() or not mpi, "Horovod was built without MPI"
print("horovod", __import__("horovod").__version__, "with TensorFlow and Gloo" + (" and MPI" if mpi else "") + ": ok")
EOF
# Marks for make: .installed (any build), .installed-mpi (a build that has MPI as well).
touch "$VENV/.installed"
if [ "$MPI" = 1 ]; then touch "$VENV/.installed-mpi"; else rm -f "$VENV/.installed-mpi"; fi
step "installed: $VENV/bin/hpcdl"
