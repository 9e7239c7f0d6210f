#!/usr/bin/env bash
# Run the whole test suite: start the local SLURM cluster the integration tests use, run pytest,
# stop the cluster. pytest's exit 5 ("no tests collected") is a failure here, not a pass.
set -uo pipefail
VENV=${VENV:-.venv}
cluster=tests/slurm/cluster.sh
export HPCDL_REQUIRE_SLURM=1

bash "$cluster" start || { echo "could not start the local SLURM cluster" >&2; exit 1; }
eval "$(bash "$cluster" env)"
"$VENV/bin/python" -m pytest -ra --durations=15 "$@"
status=$?
bash "$cluster" stop
if [ "$status" -eq 5 ]; then
  echo "pytest collected no tests: failing" >&2
  exit 1
fi
exit "$status"
