"""Shared helpers for the policy tests: success rates on the toy nav2d task."""

import pytest
import torch

from robotft.config import EnvConfig
from robotft.envs.chunked import ChunkedEnv
from robotft.envs.factory import make_env
from robotft.evaluation import evaluate

NAV2D = EnvConfig(type="toy", task="nav2d", num_envs=100, max_episode_steps=40, control_mode="velocity_2d",
                  control_hz=10.0)


@pytest.fixture
def nav2d_success():
    """`nav2d_success(act, obs_steps, act_steps, horizon)` → success rate of `act` over 200 seeded episodes;
    `act=None` measures uniform-random chunks, the baseline every BC test must beat."""

    def run(act, obs_steps: int = 1, act_steps: int = 4, horizon: int = 8) -> float:
        env = ChunkedEnv(make_env(NAV2D), obs_steps, act_steps)
        if act is None:
            rng = torch.Generator().manual_seed(0)

            def act(o):
                return torch.rand(o["state"].shape[0], horizon, 2, generator=rng) * 2 - 1

        return evaluate(act, env, 200, seed=777).success_rate

    return run
