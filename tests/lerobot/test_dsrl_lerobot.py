"""DSRL steers policies imported from LeRobot: a DiffusionPolicy sampled with LeRobot's DDIM scheduler and a
SmolVLA (its flow ODE). Decoding one noise twice gives one chunk, and an iteration of DSRL leaves LeRobot's
weights bit-identical."""

import dataclasses

import lerobot_fixtures
import pytest
import torch
from lerobot_fixtures import TASK

from robotft.checkpoint import load_policy, read_checkpoint
from robotft.config import EnvConfig
from robotft.finetune import FinetuneConfig, run_finetune
from robotft.lerobot.policy import import_lerobot_policy
from robotft.policies.noise_steered import NoiseSteeredPolicy
from robotft.rl.dsrl import DSRLConfig
from robotft.rl.offpolicy import OffPolicyConfig
from robotft.rl.ppo import PPOConfig

TOY_NAV2D = EnvConfig(type="toy", task="nav2d", num_envs=4, max_episode_steps=12, control_mode="velocity_2d",
                      reward_mode="dense", control_hz=10.0)
tiny_vlm = lerobot_fixtures.tiny_vlm
lerobot_smolvla_dir = lerobot_fixtures.lerobot_smolvla_dir


@pytest.fixture(scope="module")
def lerobot_ddim_dir(tmp_path_factory):
    return lerobot_fixtures.make_diffusion_checkpoint(tmp_path_factory.mktemp("lerobot_ddim") / "pretrained_model",
                                                      noise_scheduler_type="DDIM")


@pytest.mark.parametrize("kind", ["diffusion", "smolvla"])
def test_dsrl_steers_a_lerobot_policy_and_leaves_it_bit_identical(kind, tmp_path, request):
    if kind == "diffusion":
        ckpt = import_lerobot_policy(request.getfixturevalue("lerobot_ddim_dir"), tmp_path / "base", TOY_NAV2D,
                                     key_map={"observation.environment_state": "state"})
    else:
        ckpt = import_lerobot_policy(request.getfixturevalue("lerobot_smolvla_dir"), tmp_path / "base", TOY_NAV2D,
                                     task=TASK)
    cfg = FinetuneConfig(source=str(ckpt), out=str(tmp_path / "dsrl"), algo="dsrl", env=TOY_NAV2D,
                         rl=PPOConfig(iterations=1),
                         offpolicy=OffPolicyConfig(steps_per_iter=3, utd=0.5, batch_size=8, critic_hidden=(16,)),
                         dsrl=DSRLConfig(actor_hidden=(16,)), eval_episodes=0, save_every=1,
                         kl_to_base=dataclasses.replace(FinetuneConfig().kl_to_base, num_obs=2, num_samples=2))
    run_finetune(cfg)
    policy, _ = load_policy(cfg.out)
    assert isinstance(policy, NoiseSteeredPolicy)
    obs = {"state": torch.randn(3, policy.config.obs_steps, 4)}
    noise = torch.randn(3, *policy.noise_shape).flatten(1)
    assert torch.equal(policy.decode(obs, noise), policy.decode(obs, noise))
    base = read_checkpoint(ckpt).model_state
    tuned = read_checkpoint(cfg.out).model_state
    for k, v in base.items():
        assert torch.equal(tuned["base." + k], v), f"LeRobot weight {k} changed"


def test_dsrl_refuses_lerobots_stochastic_ddpm(tmp_path):
    ckpt = import_lerobot_policy(lerobot_fixtures.make_diffusion_checkpoint(tmp_path / "ddpm"), tmp_path / "base",
                                 TOY_NAV2D, key_map={"observation.environment_state": "state"})
    policy, _ = load_policy(ckpt)
    from robotft.rl.dsrl import DSRL

    algo = DSRL(policy, DSRLConfig(actor_hidden=(16,)))
    with pytest.raises(ValueError, match="DDIM"):
        algo.act({"state": torch.randn(2, 1, 4)})
