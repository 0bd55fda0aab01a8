#!/usr/bin/env bash
# The project's test command (README.md, .ci/run): set up, start the services the tests use
# (ES-compatible test server, one-node Slurm), run pytest without the GPU tier, stop the services.
#   bash scripts/test.sh [extra pytest args]
set -euo pipefail
cd "$(dirname "$0")/.."
# The reference-parity, ALFWorld and search-QA data tests read ../shared; without it they would skip and the
# suite would pass without them.
shared_dir="$(cd .. && pwd)/shared"
if [[ ! -d "$shared_dir" ]]; then
  echo "scripts/test.sh: the shared data folder $shared_dir (../shared beside the checkout) is missing;" \
    "the reference-parity, ALFWorld and search-QA tests need it" >&2
  exit 2
fi
export RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S=0
export MEGATRON_GIGPO_SERVICES_DIR=${MEGATRON_GIGPO_SERVICES_DIR:-$(mktemp -d /tmp/megatron-gigpo-services.XXXXXX)}

bash scripts/setup.sh
cleanup() {
  bash scripts/es_down.sh || true
  bash scripts/slurm_down.sh || true
}
trap cleanup EXIT
bash scripts/es_up.sh
bash scripts/slurm_up.sh

set +e
# Two pytest-xdist workers, one test file at a time each, files with slow tests first (tests/conftest.py): in
# one process the 2-core machine is idle a quarter of the time (process starts, sleeps, I/O).
# PYTEST_WORKERS=0 runs in this process. pytest-benchmark, where the machine has it, would only warn that it is
# off under xdist: no test here uses it (benchmarks/ are scripts).
python3 -m pytest -m "not gpu" -p no:cacheprovider -p no:benchmark -n "${PYTEST_WORKERS:-2}" --dist loadgroup \
  --no-loadscope-reorder --durations=25 "$@" tests
rc=$?
set -e
# pytest exits 5 when nothing was collected: that is a failure of the suite, not a pass.
exit $rc
