"""Deployment timing on the simulated rig: `robotft deploy --no-operator` with each chunk executor.

    python scripts/bench_deploy.py [--checkpoint runs/push_cube/dppo] [--episodes 2] [--episode-time 5]

Without `--checkpoint`, a PushCube-shaped Gaussian policy with random weights is used (its actions are
meaningless; the timing is what is measured). Prints, per executor, the achieved control rate, loop
lateness (jitter), policy inference time, observation ages and the safety layer's counts, and writes each
run's latency report under `--out`.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

EXECUTORS = ("receding_horizon", "temporal_ensemble", "async")

PUSH_CUBE_NAMES = tuple(
    [f"agent/qpos/{i}" for i in range(9)]
    + [f"agent/qvel/{i}" for i in range(9)]
    + [f"extra/tcp_pose/{i}" for i in range(7)]
    + [f"extra/goal_pos/{i}" for i in range(3)]
    + [f"extra/obj_pose/{i}" for i in range(7)]
)


def random_checkpoint(path: Path) -> Path:
    """A PushCube-shaped (35-dim named state, pd_ee_delta_pose at 20 Hz) Gaussian MLP, random weights."""
    import numpy as np

    from robotft.checkpoint import write_checkpoint
    from robotft.config import EnvConfig, to_dict
    from robotft.datasets.normalizer import Normalizer
    from robotft.policies.base import build_policy
    from robotft.policies.gaussian import GaussianPolicyConfig
    from robotft.specs import ActionSpec, EnvSpec, FeatureSpec

    spec = EnvSpec(
        {"state": FeatureSpec("state", (35,), "float32", unit="mixed", frame="world", names=PUSH_CUBE_NAMES)},
        ActionSpec("pd_ee_delta_pose", 7, (-1.0,) * 7, (1.0,) * 7, 20.0, "robot_base"),
    )
    rng = np.random.default_rng(0)
    data = {"state": rng.normal(size=(64, 35)), "action": rng.uniform(-1, 1, (64, 7))}
    normalizer = Normalizer.fit(data, {"state": "minmax", "action": "minmax"})
    policy = build_policy(GaussianPolicyConfig(), spec, normalizer)
    env = EnvConfig(type="maniskill", task="PushCube-v1", max_episode_steps=100)
    return write_checkpoint(
        path,
        model_state=policy.export_state_dict(),
        config={"policy": to_dict(policy.config), "env": to_dict(env), "spec": spec.to_dict()},
        normalizer=normalizer,
        meta={"stage": "pretrain", "step": 0},
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", default=None)
    p.add_argument("--rig", default="sim_franka")
    p.add_argument("--episodes", type=int, default=2)
    p.add_argument("--episode-time", type=float, default=5.0)
    p.add_argument("--out", default="runs/bench_deploy")
    args = p.parse_args()

    from robotft.cli import set_cpu_threads
    from robotft.real_robot.deploy import DeployOptions, deploy

    set_cpu_threads()
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = args.checkpoint or str(random_checkpoint(Path(tmp) / "random_push_cube"))
        rows = []
        for executor in EXECUTORS:
            out = Path(args.out) / executor
            summary = deploy(
                DeployOptions(
                    checkpoint=ckpt,
                    rig=args.rig,
                    episodes=args.episodes,
                    no_operator=True,
                    executor=executor,
                    out=str(out),
                    episode_time_s=args.episode_time,
                    device="cpu",
                )
            )
            report = json.loads(Path(summary["latency_json"]).read_text())
            rows.append((executor, report))
    print(
        f"{'executor':<18} {'Hz':>6} {'jitter p50/p99/max ms':>22} {'infer p50/p99 ms':>17} "
        f"{'robot age p50/p99 ms':>21} {'camera age p50 ms':>18}  clipped / refused"
    )
    for executor, r in rows:
        j, i = r["loop_jitter_ms"], r["inference_ms"]
        robot = r["obs_age_ms"].get("robot", {})
        cams = [v.get("p50", 0.0) for k, v in r["obs_age_ms"].items() if k.startswith("camera/")]
        print(
            f"{executor:<18} {r['achieved_hz']:6.2f} {j['p50']:7.2f}/{j['p99']:6.2f}/{j['max']:6.1f} "
            f"{i.get('p50', 0):8.2f}/{i.get('p99', 0):7.2f} {robot.get('p50', 0):10.1f}/{robot.get('p99', 0):9.1f} "
            f"{(max(cams) if cams else 0.0):18.1f}  {r['commands_clipped']} / {r['commands_refused']}"
        )


if __name__ == "__main__":
    main()
