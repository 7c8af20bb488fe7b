#!/usr/bin/env bash
# The test suite, set-up included: installs what is missing (scripts/setup.sh), then runs pytest.
# Extra arguments go to pytest, e.g. `scripts/test.sh -k dppo -x`.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$repo/scripts/setup.sh" "${ROBOTFT_TEST_EXTRAS:-maniskill,robosuite,mujoco,realsense,franka,lerobot,ray,vision,wandb,dev}"
venv="${ROBOTFT_VENV:-$repo/.venv}"
cd "$repo"
# One torch/OpenMP thread per process: the suite runs simulator workers beside the learner on 2 cores.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# Tests are spread over one pytest-xdist process per core, at most 4 (many tests start simulator worker
# processes of their own); tests marked with an `xdist_group` share one process. ROBOTFT_TEST_WORKERS=0
# runs the suite in this process.
cores="$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)"  # nproc counts OpenMP's thread limit otherwise
workers="${ROBOTFT_TEST_WORKERS:-$(( cores < 4 ? cores : 4 ))}"
# Fine-tuning updates take every core by default; with one pytest worker per core, each worker's updates get
# their share instead (OpenMP threads competing for cores made the RL tests 3-6x slower).
if (( workers > 1 )); then
  export ROBOTFT_UPDATE_THREADS="${ROBOTFT_UPDATE_THREADS:-$(( cores > workers ? cores / workers : 1 ))}"
fi
exec "$venv/bin/python" -m pytest -q --timeout 900 -n "$workers" --dist loadgroup "$@"
