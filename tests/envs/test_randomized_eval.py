"""`robotft eval --env-override randomization.*`: the same checkpoint evaluated with and without randomization."""

import dataclasses
import json

import pytest
import torch

pytest.importorskip("mujoco")

from robotft.cli import main  # noqa: E402
from robotft.config import load_env_config, to_dict  # noqa: E402
from robotft.datasets.recording import record_rollouts, rollout_features  # noqa: E402
from robotft.datasets.store import DatasetWriter  # noqa: E402
from robotft.envs.factory import make_env  # noqa: E402


class RandomTorques:
    def __init__(self) -> None:
        self.generator = torch.Generator().manual_seed(0)

    def reset(self, env_ids, obs) -> None:
        pass

    def __call__(self, obs):
        return torch.rand(obs["state"].shape[0], 3, generator=self.generator) * 2 - 1


@pytest.fixture(scope="module")
def hopper_checkpoint(tmp_path_factory):
    """A Gaussian policy checkpoint for Hopper (one BC step on random-torque rollouts)."""
    root = tmp_path_factory.mktemp("hopper")
    cfg = dataclasses.replace(load_env_config("mujoco/hopper"), num_envs=2, max_episode_steps=40)
    env = make_env(cfg)
    with DatasetWriter(root / "demos.zarr", rollout_features(env.spec), fps=125.0, action_spec=env.spec.action,
                       env=to_dict(cfg), source="random torques") as writer:
        record_rollouts(env, RandomTorques(), 4, writer, only_success=False, progress=False)
    env.close()
    assert main(["pretrain", "--env", "mujoco/hopper", "--policy", "gaussian_mlp", "--data", str(root / "demos.zarr"),
                 "--steps", "1", "--out", str(root / "bc"), "--env.max_episode_steps", "40",
                 "--train.eval_episodes", "1", "--train.device", "cpu"]) == 0
    return root / "bc"


def evaluate(checkpoint, capsys, *overrides: str) -> dict:
    argv = ["eval", str(checkpoint), "--episodes", "2", "--json", "--device", "cpu"]
    for item in overrides:
        argv += ["--env-override", item]
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_eval_with_and_without_randomization(hopper_checkpoint, capsys):
    plain = evaluate(hopper_checkpoint, capsys)
    assert plain == evaluate(hopper_checkpoint, capsys, "randomization.mass_scale=[1.0,1.0]")  # off: identical
    heavy = evaluate(hopper_checkpoint, capsys, "randomization.mass_scale=[3.0,3.0]",
                     "randomization.friction_scale=[0.5,1.5]")
    assert heavy["mean_return"] != plain["mean_return"] or heavy["mean_length"] != plain["mean_length"]
    noisy = evaluate(hopper_checkpoint, capsys, "randomization.obs_noise_std=0.05",
                     "randomization.action_latency_steps=[2,2]")
    assert noisy["mean_return"] != plain["mean_return"]


def test_eval_refuses_randomization_the_backend_cannot_apply(hopper_checkpoint, capsys):
    assert main(["eval", str(hopper_checkpoint), "--episodes", "1", "--device", "cpu",
                 "--env-override", "randomization.object_pos_range=0.1"]) == 1
    assert "object_pos_range" in capsys.readouterr().err
