#!/usr/bin/env bash
# The GPU fine-tuning path in under 8 minutes, for a machine with CUDA: ManiSkill physx_cuda PushCube with
# 256 envs for a few DPPO iterations (env steps/s, update seconds per iteration, host syncs per rollout chunk,
# reset seconds), the same with the batched stand-in env on CUDA at 256 and 1024 envs (policy and update alone),
# then the GPU-semantics tests, then two ranks under torchrun when there are two GPUs.
# Prints one JSON line with all figures. Exits non-zero with a clear message (never hangs) without CUDA:
# every step runs under `timeout`.
#
#   bash scripts/gpu_check.sh                 # uses .venv/bin/python, else python3
#   PYTHON=/path/to/python NUM_ENVS=512 bash scripts/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}"
NUM_ENVS="${NUM_ENVS:-256}"
ITERATIONS="${ITERATIONS:-3}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"

if ! timeout 60 "$PY" -c "import torch" 2>/dev/null; then
  echo "{\"ok\": false, \"error\": \"$PY cannot import torch: set PYTHON to the project's environment\"}"
  exit 2
fi
if ! timeout 60 "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo '{"ok": false, "error": "no CUDA device (torch.cuda.is_available() is False): the GPU check needs one"}'
  echo "gpu_check: no CUDA device; nothing measured" >&2
  exit 2
fi
GPUS=$(timeout 60 "$PY" -c "import torch; print(torch.cuda.device_count())")

single=$(timeout 300 "$PY" scripts/gpu_check.py --num-envs "$NUM_ENVS" --iterations "$ITERATIONS" | tail -n 1)
rc_single=$?
[ -n "$single" ] || single='{"ok": false, "error": "single-GPU run produced no result (timeout or crash)"}'

# The policy, the update and the host syncs on CUDA with the batched stand-in env in place of ManiSkill's sim:
# measured even where ManiSkill's GPU sim cannot start, and at 4x the envs to show what grows with num_envs.
standin=""
for n in "$NUM_ENVS" $((NUM_ENVS * 4)); do
  one=$(timeout 150 "$PY" scripts/gpu_check.py --standin --num-envs "$n" --iterations "$ITERATIONS" | tail -n 1)
  [ -n "$one" ] || one="{\"ok\": false, \"error\": \"stand-in run at $n envs produced no result\"}"
  standin="${standin:+$standin, }$one"
done

# Only the files that hold gpu_semantics tests: collecting the whole suite would import every optional extra.
timeout 120 "$PY" -m pytest -q -p no:cacheprovider -m gpu_semantics $(grep -rl --include='test_*.py' gpu_semantics tests) \
  >/tmp/gpu_check_pytest.log 2>&1
rc_tests=$?
tests_summary=$(tail -n 1 /tmp/gpu_check_pytest.log | tr -d '"')

if [ "$GPUS" -ge 2 ]; then
  two=$(timeout 240 "$PY" -m torch.distributed.run --standalone --nproc_per_node 2 scripts/gpu_check.py \
        --num-envs $((NUM_ENVS / 2)) --iterations 2 2>/tmp/gpu_check_torchrun.log | tail -n 1)
  [ -n "$two" ] || two="{\"ok\": false, \"error\": \"torchrun run failed: $(tail -n 1 /tmp/gpu_check_torchrun.log | tr -d '"')\"}"
else
  two='{"ok": null, "skipped": "one GPU: the two-rank run needs two"}'
fi

echo "{\"gpus\": $GPUS, \"single\": $single, \"standin_on_cuda\": [$standin], \"gpu_semantics_tests\": {\"rc\": $rc_tests, \"summary\": \"$tests_summary\"}, \"torchrun_2_ranks\": $two}"
[ "$rc_single" -eq 0 ] && [ "$rc_tests" -eq 0 ]
