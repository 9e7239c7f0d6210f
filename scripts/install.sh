#!/usr/bin/env bash
# Install hpcdl into a project virtual environment, from nothing.
#
# TensorFlow and Horovod are pinned as a pair: a Horovod wheel links against the exact TensorFlow
# it was built with (HorovodVersionMismatchError otherwise), and Horovod 0.28.1, its last release,
# builds unmodified against tensorflow-cpu 2.16. The built Horovod wheel is cached, keyed on every
# input that changes its binary, so a second install takes seconds instead of ~3 minutes.
set -euo pipefail

VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
TF_VERSION=${TF_VERSION:-2.16.2}
HOROVOD_VERSION=${HOROVOD_VERSION:-0.28.1}
WHEEL_CACHE=${HPCDL_WHEEL_CACHE:-$HOME/.cache/hpcdl/wheels}

step() { printf '\n==> %s\n' "$*"; }
fail() { printf '\nhpcdl install FAILED: %s\n' "$*" >&2; exit 1; }
trap 'fail "step exited with status $? (line $LINENO); see the output above"' ERR

step "virtual environment $VENV ($($PYTHON --version))"
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV" || fail "cannot create a venv with $PYTHON (install python3-venv)"
PY="$VENV/bin/python"
# TensorBoard 2.16 imports pkg_resources, which setuptools 81 and newer no longer ship.
"$PY" -m pip install --quiet --upgrade pip "setuptools>=77,<81" wheel packaging "cmake<5"

step "tensorflow-cpu==$TF_VERSION"
"$PY" -m pip install --quiet "tensorflow-cpu==$TF_VERSION"

abi=$("$PY" -c 'import sys; print(f"cp{sys.version_info.major}{sys.version_info.minor}")')
key="horovod-$HOROVOD_VERSION-tf$TF_VERSION-$abi-gloo-nompi-$(uname -m)"
cached="$WHEEL_CACHE/$key"
if ! ls "$cached"/horovod-*.whl >/dev/null 2>&1; then
  step "building Horovod $HOROVOD_VERSION against TensorFlow $TF_VERSION (about 3 minutes, once)"
  command -v g++ >/dev/null || fail "g++ is needed to build Horovod (apt-get install g++)"
  build=$(mktemp -d)
  # Gloo's CMakeLists predates CMake 4's minimum policy; -j2 keeps the build within memory
  # (each compiler process peaks near 1.5 GB; Horovod's default is -j8).
  CMAKE_POLICY_VERSION_MINIMUM=3.5 MAKEFLAGS=-j2 \
  HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 \
  HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_WITHOUT_MXNET=1 \
    "$PY" -m pip wheel --no-build-isolation --no-deps --no-binary horovod \
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
"$PY" - <<'EOF' || fail "Horovod does not load with TensorFlow and Gloo"
import horovod.tensorflow as hvd
assert hvd.gloo_built(), "Horovod was built without Gloo"
print("horovod", __import__("horovod").__version__, "with TensorFlow and Gloo: ok")
EOF
touch "$VENV/.installed"
step "installed: $VENV/bin/hpcdl"
