#!/usr/bin/env bash
# The full fault-injection run: kill -9 at random moments of pretrain, finetune, data generate, data import
# and deploy --record, ROBOTFT_KILLS each (default 10: 50 kills), then the swap-failure injection.
# CI runs the same tests with 5 kills each. Usage: scripts/fault_injection.sh [KILLS] [SEED]
set -euo pipefail
cd "$(dirname "$0")/.."
export ROBOTFT_KILLS="${1:-10}" ROBOTFT_KILL_SEED="${2:-1}"
exec python -m pytest -q -s tests/test_fault_injection.py tests/real_robot/test_deploy_kill.py
