import numpy as np
import torch

from robotft.datasets.recording import record_rollouts, rollout_features
from robotft.datasets.store import DatasetWriter, ReplayBuffer
from robotft.envs.base import BatchedEnv
from robotft.specs import ActionSpec, EnvSpec, FeatureSpec


class PointMass(BatchedEnv):
    """1-D point mass: state = [position, goal]; action = velocity step in [-1, 1] * 0.1.
    Success (and termination) when within 0.05 of the goal."""

    def __init__(self, num_envs: int, max_episode_steps: int = 30):
        self.num_envs = num_envs
        self.device = torch.device("cpu")
        self.max_episode_steps = max_episode_steps
        self.spec = EnvSpec(
            observations={"state": FeatureSpec("state", (2,), "float32", unit="m")},
            action=ActionSpec("velocity", 1, (-1.0,), (1.0,), control_hz=10.0),
        )
        self.pos = torch.zeros(num_envs)
        self.goal = torch.zeros(num_envs)
        self.t = torch.zeros(num_envs, dtype=torch.long)
        self.reset_seeds: list[int] = []

    def _obs(self):
        return {"state": torch.stack([self.pos, self.goal], dim=1)}

    def reset(self, seed=None, env_ids=None):
        ids = torch.arange(self.num_envs) if env_ids is None else env_ids
        for i in ids.tolist():
            s = seed + i
            self.reset_seeds.append(s)
            g = torch.Generator().manual_seed(s)
            self.pos[i] = 0.0
            self.goal[i] = torch.rand((), generator=g) * 2 - 1
            self.t[i] = 0
        return self._obs()

    def step(self, action):
        self.pos = self.pos + 0.1 * action[:, 0].clamp(-1, 1)
        self.t += 1
        dist = (self.pos - self.goal).abs()
        success = dist < 0.05
        return self._obs(), -dist, success, self.t >= self.max_episode_steps, {"success": success}


class Expert:
    """Drives to the goal, except in env 1, which it drives away (those episodes fail)."""

    def __init__(self):
        self.resets = []

    def reset(self, env_ids, obs):
        self.resets.append(env_ids.tolist())

    def __call__(self, obs):
        pos, goal = obs["state"][:, 0], obs["state"][:, 1]
        a = ((goal - pos) / 0.1).clamp(-1, 1)
        a[1] = -torch.sign(goal[1] - pos[1])
        return a[:, None]


def test_record_only_successful_episodes(tmp_path):
    env, expert = PointMass(num_envs=3, max_episode_steps=12), Expert()
    path = tmp_path / "rec.zarr"
    with DatasetWriter(path, rollout_features(env.spec), fps=10.0, action_spec=env.spec.action) as w:
        stats = record_rollouts(env, expert, n_episodes=5, writer=w, seed=100, task="reach", progress=False)
    assert stats["kept"] == 5 and stats["attempted"] >= 5 and 0 < stats["success_rate"] < 1
    assert stats["seconds"] > 0
    assert len(env.reset_seeds) == len(set(env.reset_seeds))  # every reset got a fresh seed
    buf = ReplayBuffer.open(path)
    assert buf.n_episodes == 5 and buf.episode_tasks == ["reach"] * 5
    assert set(buf.keys) == {"state", "action", "reward", "success"}
    for i in range(buf.n_episodes):
        ep = buf.episode(i)
        assert ep["success"][-1] and not ep["success"][:-1].any()
        assert ep["state"][0, 0] == 0.0  # first observation is the one right after reset
        # obs[t] is the state before action[t]: pos advances by 0.1 * action.
        np.testing.assert_allclose(np.diff(ep["state"][:, 0]), 0.1 * ep["action"][:-1, 0], atol=1e-6)
        assert ep["reward"].dtype == np.float32


def test_record_keeps_failures_when_asked(tmp_path):
    env = PointMass(num_envs=2, max_episode_steps=3)
    path = tmp_path / "rec.zarr"
    with DatasetWriter(path, rollout_features(env.spec), fps=10.0) as w:
        stats = record_rollouts(env, Expert(), n_episodes=4, writer=w, only_success=False, progress=False)
    buf = ReplayBuffer.open(path)
    assert stats["kept"] == buf.n_episodes == 4
    assert not all(buf.episode(i)["success"][-1] for i in range(4))
