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
exec "$venv/bin/python" -m pytest -q --timeout 900 "$@"
