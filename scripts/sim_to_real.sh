#!/usr/bin/env bash
# From simulation to the arm, end to end on CPU: PushCube demos → diffusion BC → DPPO fine-tuning (a state
# policy) → DAgger distillation into a camera + proprioception student (robotft distill) → `deploy --check`
# against the hardware rig real_robot/franka_d435.yaml → deployment on the simulated rig through its
# simulated camera. Prints each stage's success rate. Outputs go to runs/sim_to_real/ (or $1).
# Budgets (environment variables): DEMOS, BC_STEPS, ITERATIONS, ROUNDS, ROUND_EPISODES, ROUND_STEPS,
# EVAL_EPISODES, DEPLOY_EPISODES; REALTIME=1 deploys on the rig in real time. The defaults take under an hour on 2 cores.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${ROBOTFT_VENV:-$repo/.venv}"
[[ -x "$venv/bin/robotft" ]] || bash "$repo/scripts/setup.sh" maniskill,vision,mujoco,dev
cd "$repo"
run="${1:-runs/sim_to_real}"
eval_episodes="${EVAL_EPISODES:-50}"
robotft() { "$venv/bin/robotft" "$@"; }
success() { "$venv/bin/python" -c 'import json, sys; r = json.loads(sys.stdin.read().strip().splitlines()[-1]); print("%.0f%% (%s episodes)" % (100 * r["success_rate"], r.get("episodes", r.get("scored"))))'; }
start=$(date +%s)
mkdir -p "$run"

robotft data generate --env maniskill/push_cube --episodes "${DEMOS:-20}" --out "$run/demos.zarr" --overwrite
robotft pretrain --env maniskill/push_cube --policy diffusion_mlp --data "$run/demos.zarr" \
  --steps "${BC_STEPS:-2000}" --out "$run/bc" --train.eval_episodes 0
bc=$(robotft eval "$run/bc" --episodes "$eval_episodes" --json | success)
robotft finetune --from "$run/bc" --algo dppo --iterations "${ITERATIONS:-30}" --out "$run/dppo" \
  --env.num_envs 2 --eval_every 1000 --eval_episodes 0
ft=$(robotft eval "$run/dppo" --episodes "$eval_episodes" --json | success)

# The simulated rig with its camera at the student's resolution, feeding the student's `rgb/base_camera`
# (ManiSkill names the camera `base_camera`, the rig `base`).
"$venv/bin/python" - "$run/sim_franka_camera.yaml" <<'PY'
import sys, yaml
from robotft.config import find_preset
rig = yaml.safe_load(open(find_preset("real_robot", "sim_franka")))
camera = rig["cameras"][0]
camera["config"].update(width=64, height=64, fps=20, fovy_deg=45.0)
rig["name"] += "_camera"
rig["observations"].append({"key": "rgb/base_camera", "unit": "rgb8",
                            "sources": [{"source": "camera", "camera": camera["name"]}]})
yaml.safe_dump(rig, open(sys.argv[1], "w"), sort_keys=False)
PY
robotft distill --teacher "$run/dppo" --policy diffusion_mlp_rgb --env maniskill/push_cube_distill \
  --out "$run/distill" --rig "$run/sim_franka_camera.yaml" --rounds "${ROUNDS:-3}" \
  --episodes_per_round "${ROUND_EPISODES:-15}" --steps_per_round "${ROUND_STEPS:-400}" --batch_size 32 \
  --eval_episodes 0
student=$(robotft eval "$run/distill" --episodes "$eval_episodes" --json | success)

check="skipped (this robotft has no deploy --check)"
deploy_help=$(robotft deploy --help)
if [[ "$deploy_help" == *"--check"* ]]; then
  if robotft deploy "$run/distill" --rig real_robot/franka_d435.yaml --check; then check="accepted"
  else check="refused (see above)"; fi
fi
deploy_episodes="${DEPLOY_EPISODES:-10}"
# Lock-step (the rig's physics, mapping and renderer without the wall clock) unless REALTIME=1: on a loaded
# machine real time adds stale camera frames and physics lag to what is measured.
timing=(--lockstep); [[ "${REALTIME:-0}" == 1 ]] && timing=()
rig_state=$(robotft deploy "$run/dppo" --rig real_robot/sim_franka.yaml --episodes "$deploy_episodes" \
  --no-operator "${timing[@]}" --out "$run/deploy_state" | success)
rig_student=$(robotft deploy "$run/distill" --rig "$run/sim_franka_camera.yaml" --episodes "$deploy_episodes" \
  --no-operator "${timing[@]}" --out "$run/deploy_student" | success)

cat <<TXT

PushCube, ManiSkill ($eval_episodes episodes each):
  BC (state):                      $bc
  DPPO fine-tuned (state teacher): $ft
  distilled camera student:        $student
deploy --check on franka_d435:     $check
simulated rig (sim_franka, ${timing[*]:-real time}, $deploy_episodes episodes each):
  state policy:                    $rig_state
  camera student:                  $rig_student
checkpoints: $run/bc, $run/dppo, $run/distill; took $(( ($(date +%s) - start) / 60 )) min
TXT
