#!/usr/bin/env bash
# The main job, end to end on CPU: motion-planned PushCube demonstrations → diffusion BC → evaluation →
# DPPO fine-tuning → evaluation, printing the success rate before and after fine-tuning.
# Installs what is missing first (scripts/setup.sh). Outputs go to runs/push_cube/ (or $1).
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$repo/scripts/setup.sh" maniskill,dev
venv="${ROBOTFT_VENV:-$repo/.venv}"
cd "$repo"
run="${1:-runs/push_cube}"
robotft() { "$venv/bin/robotft" "$@"; }
start=$(date +%s)

robotft data generate --env maniskill/push_cube --episodes "${DEMOS:-20}" --out "$run/demos.zarr" --overwrite
robotft data info "$run/demos.zarr"
robotft pretrain --env maniskill/push_cube --policy diffusion_mlp --data "$run/demos.zarr" \
  --steps "${BC_STEPS:-2000}" --out "$run/bc" --train.eval_episodes 0
before=$(robotft eval "$run/bc" --episodes 50 --num-envs 4 --json | tail -n1)
robotft finetune --from "$run/bc" --algo dppo --iterations "${ITERATIONS:-40}" --out "$run/dppo" \
  --env.num_envs 4 --eval_every 10 --eval_episodes 50
after=$(robotft eval "$run/dppo" --episodes 50 --num-envs 4 --json | tail -n1)

"$venv/bin/python" - "$before" "$after" "$run" "$start" <<'PY'
import json, sys, time
before, after = json.loads(sys.argv[1]), json.loads(sys.argv[2])
run, start = sys.argv[3], int(sys.argv[4])
fmt = lambda r: f"{r['success_rate']:.0%} (95% CI {r['ci95'][0]:.0%}-{r['ci95'][1]:.0%}, {r['episodes']} episodes)"
print()
print(f"PushCube success after BC pretraining:  {fmt(before)}")
print(f"PushCube success after DPPO fine-tuning: {fmt(after)}")
print(f"checkpoints: {run}/bc/checkpoint, {run}/dppo/checkpoint")
print(f"learning curve: {run}/dppo/learning_curve.png   logs: tensorboard --logdir {run}")
print(f"took {(time.time() - start) / 60:.1f} min")
PY
