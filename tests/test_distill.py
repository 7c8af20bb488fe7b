"""DAgger distillation (robotft.distill): a state teacher on the toy reach task, whose goal is visible only
in the student's rendered `rgb/top` image, is distilled into an image-only student."""

from __future__ import annotations

import dataclasses
import json

import pytest

from robotft.checkpoint import load_policy, read_checkpoint
from robotft.config import EnvConfig, from_dict
from robotft.datasets.recording import record_rollouts, rollout_features
from robotft.datasets.store import DatasetWriter, ReplayBuffer
from robotft.distill import DistillConfig, run_distill
from robotft.envs.toy import Nav2DExpert, ToyNavEnv
from robotft.policies.gaussian import GaussianPolicyConfig
from robotft.pretrain import PretrainConfig, TrainConfig, run_pretrain
from robotft.real_robot.rig import RigMismatchError

IMAGE = 24
JITTER = 0.5
"""Start and goal drawn from 1 m squares: a student that ignores the image reaches the goal (0.1 m) rarely."""


def toy_env(num_envs: int = 16, image_size: int = IMAGE) -> EnvConfig:
    return EnvConfig(type="toy", task="reach2d", num_envs=num_envs, control_mode="velocity_2d",
                     max_episode_steps=40, control_hz=10.0, kwargs={"image_size": image_size, "jitter": JITTER})


def student_config(**overrides) -> GaussianPolicyConfig:
    return from_dict(GaussianPolicyConfig, {
        "obs_keys": ["rgb/top"], "obs_steps": 1, "horizon_steps": 4, "act_steps": 2, "hidden_dims": [128, 128],
        "bc_loss": "mse", "image_encoder": {"stages": 1, "crop": 1.0, "num_keypoints": 8}, **overrides})


@pytest.fixture(scope="module")
def teacher(tmp_path_factory) -> str:
    """A state policy (agent and goal positions) trained on scripted demonstrations."""
    root = tmp_path_factory.mktemp("teacher")
    state_env = dataclasses.replace(toy_env(), kwargs={"jitter": JITTER})
    env = ToyNavEnv(16, task="reach2d", max_episode_steps=40, jitter=JITTER)
    with DatasetWriter(root / "demos.zarr", rollout_features(env.spec), fps=10.0, action_spec=env.spec.action) as w:
        record_rollouts(env, Nav2DExpert(16, obstacle_radius=0.0), 64, w, progress=False)
    policy = from_dict(GaussianPolicyConfig, {"obs_keys": ["state"], "horizon_steps": 4, "act_steps": 2,
                                              "hidden_dims": [128, 128], "bc_loss": "mse"})
    train = TrainConfig(steps=600, batch_size=128, lr=3e-3, warmup_steps=20, eval_episodes=0, save_every=600,
                        device="cpu")
    run_pretrain(PretrainConfig(data=str(root / "demos.zarr"), out=str(root / "bc"), env=state_env, train=train),
                 policy)
    return str(root / "bc")


def distill_config(teacher: str, out, **overrides) -> DistillConfig:
    fields = {"rounds": 3, "episodes_per_round": 48, "steps_per_round": 300, "batch_size": 64, "lr": 2e-3,
              "eval_episodes": 64, "device": "cpu", **overrides}
    return DistillConfig(teacher=teacher, out=str(out), env=toy_env(), **fields)


def test_dagger_student_reaches_teacher_success(teacher, tmp_path):
    out = run_distill(distill_config(teacher, tmp_path / "dagger"), student_config())
    ckpt = read_checkpoint(out)
    metrics = ckpt.meta["metrics"]
    print(json.dumps(metrics))
    assert ckpt.meta["round"] == 3
    assert metrics["teacher_success_rate"] >= 0.9
    assert metrics["success_rate"] >= metrics["teacher_success_rate"] - 0.15
    # The student reads only its camera; the store holds what it saw and the teacher's chunks.
    assert list(ckpt.spec.observations) == ["rgb/top"]
    store = ReplayBuffer.open(out / "data" / "round_002.zarr")
    assert store.features["teacher_chunk"].shape == (4, 2)
    assert store.n_episodes == 48
    policy, _ = load_policy(out)
    assert policy.config.obs_keys == ["rgb/top"]
    best = read_checkpoint(out / "best")
    assert best.meta["best_score"] >= metrics["success_rate"] and best.meta["stage"] == "distill"


def test_resume_continues_after_the_last_round(teacher, tmp_path):
    cfg = distill_config(teacher, tmp_path / "run", rounds=1, episodes_per_round=8, steps_per_round=5,
                         eval_episodes=0)
    out = run_distill(cfg, student_config())
    first = (out / "data" / "round_000.zarr" / "data" / "teacher_chunk").stat().st_mtime_ns
    run_distill(dataclasses.replace(cfg, rounds=2), student_config(), resume=True)
    ckpt = read_checkpoint(out)
    assert ckpt.meta["round"] == 2 and ckpt.meta["beta"] == 0.5
    assert (out / "data" / "round_000.zarr" / "data" / "teacher_chunk").stat().st_mtime_ns == first
    assert ReplayBuffer.open(out / "data" / "round_001.zarr").n_episodes == 8
    with pytest.raises(ValueError, match="nothing to resume"):
        run_distill(dataclasses.replace(cfg, rounds=2), student_config(), resume=True)


def test_rig_refuses_a_student_it_cannot_feed_before_training(teacher, tmp_path):
    cfg = distill_config(teacher, tmp_path / "rig", rig="real_robot/franka_d435.yaml")
    with pytest.raises(RigMismatchError, match=r"rgb/top: the rig has no source.*velocity_2d"):
        run_distill(cfg, student_config())
    assert not (tmp_path / "rig").exists()


def test_student_keys_must_be_unprivileged_env_keys_with_a_camera(teacher, tmp_path):
    cfg = distill_config(teacher, tmp_path / "keys")
    with pytest.raises(ValueError, match="no camera key"):
        run_distill(cfg, student_config(obs_keys=["state"]))
    with pytest.raises(ValueError, match=r"student key 'rgb/top' is not an env observation"):
        run_distill(dataclasses.replace(cfg, env=toy_env(image_size=0)), student_config())
    with pytest.raises(ValueError, match="set --policy.horizon_steps <= 4"):
        run_distill(cfg, student_config(horizon_steps=8))
