"""RL on a policy with a camera key: PPO must score with the same image preprocessing it sampled with (the
encoder's random crops are a train-mode augmentation), and the critic must leave the camera out."""

import numpy as np
import torch

from robotft.datasets.normalizer import Normalizer
from robotft.envs.base import BatchedEnv, Obs
from robotft.envs.chunked import ChunkedEnv
from robotft.envs.toy import ToyNavEnv
from robotft.finetune import FinetuneConfig, make_critic
from robotft.policies.base import build_policy
from robotft.policies.gaussian import GaussianPolicyConfig
from robotft.policies.vision import ImageEncoderConfig
from robotft.rl.gaussian_ppo import GaussianPPO, GaussianPPOConfig
from robotft.rl.ppo import PPO, PPOConfig
from robotft.specs import EnvSpec, FeatureSpec

SIDE = 32


class CameraNav(BatchedEnv):
    """The toy nav2d task with a top-down camera `rgb/top`: the agent drawn red, the goal green."""

    def __init__(self, num_envs: int) -> None:
        self.inner = ToyNavEnv(num_envs)
        self.num_envs, self.device, self.max_episode_steps = num_envs, self.inner.device, 40
        self.spec = EnvSpec({**self.inner.spec.observations,
                             "rgb/top": FeatureSpec("rgb/top", (SIDE, SIDE, 3), "uint8", unit="rgb8")},
                            self.inner.spec.action)

    def _with_image(self, obs: Obs) -> Obs:
        state = obs["state"]
        image = torch.zeros(state.shape[0], SIDE, SIDE, 3, dtype=torch.uint8)
        pixels = ((state.clamp(-1, 1) + 1) / 2 * (SIDE - 1)).round().long()
        rows = torch.arange(state.shape[0])
        image[rows, pixels[:, 1], pixels[:, 0], 0] = 255
        image[rows, pixels[:, 3], pixels[:, 2], 1] = 255
        return {**obs, "rgb/top": image}

    def reset(self, seed=None, env_ids=None) -> Obs:
        return self._with_image(self.inner.reset(seed=seed, env_ids=env_ids))

    def step(self, action):
        obs, reward, terminated, truncated, info = self.inner.step(action)
        if "final_obs" in info:
            info = {**info, "final_obs": self._with_image(info["final_obs"])}
        return self._with_image(obs), reward, terminated, truncated, info


def test_ppo_scores_camera_policies_as_it_sampled_them_and_the_critic_skips_the_camera():
    torch.manual_seed(0)
    env = CameraNav(num_envs=8)
    rng = np.random.default_rng(0)
    normalizer = Normalizer.fit(
        {"state": rng.uniform(-1, 1, size=(64, 4)), "action": rng.uniform(-1, 1, size=(64, 2)),
         "rgb/top": np.zeros((1, SIDE, SIDE, 3))},
        {"state": "minmax", "action": "minmax", "rgb/top": "identity"},
    )
    policy = build_policy(
        GaussianPolicyConfig(obs_keys=["state", "rgb/top"], horizon_steps=4, act_steps=2, hidden_dims=(32,),
                             image_encoder=ImageEncoderConfig(stages=1, crop=0.75, num_keypoints=4)),
        env.spec, normalizer)
    algo = GaussianPPO(policy, GaussianPPOConfig())
    cfg = FinetuneConfig(rl=PPOConfig(steps_per_iter=4, update_epochs=1, minibatch_size=32, critic_warmup_iters=0,
                                      actor_lr=1e-4, clip_eps=1e-4))
    critic = make_critic(policy, env.spec, normalizer, cfg, algo)
    assert critic.obs_keys == ["state"]

    ppo = PPO(algo, critic, ChunkedEnv(env, 1, 2), cfg.rl)
    buf, next_value, _ = ppo.collect()
    # The crops matter: in train mode the same samples score differently.
    obs, sample = {k: v[0] for k, v in buf.obs.items()}, {k: v[0] for k, v in buf.samples.items()}
    policy.train()
    assert not torch.allclose(algo.logprob(obs, sample), buf.logprobs[0])
    # One epoch of one minibatch: the ratio is computed before any step, so it must be 1 up to rounding,
    # inside even a clip range of 1e-4.
    metrics = ppo.update(buf, next_value)
    assert metrics["clip_fraction"] == 0.0 and abs(metrics["approx_kl"]) < 1e-6
