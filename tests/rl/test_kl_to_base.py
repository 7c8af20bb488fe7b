"""`train/kl_to_base` for every `--algo`: exactly 0 for the policy that collected the first iteration (nothing has
been updated yet) and positive once the policy has been updated; and the estimator itself on known Gaussians."""

import math

import pytest
import torch
from tiny_specs import tiny_spec_and_normalizer

from robotft.config import EnvConfig
from robotft.finetune import ALGORITHMS, FinetuneConfig, run_finetune
from robotft.policies.gaussian import GaussianPolicy, GaussianPolicyConfig
from robotft.rl.kl_monitor import KLMonitorConfig, KLToBase
from robotft.rl.offpolicy import OffPolicyConfig
from robotft.rl.ppo import PPOConfig
from robotft.runlog import read_metrics

TOY_NAV2D = EnvConfig(type="toy", task="nav2d", num_envs=20, max_episode_steps=40, control_mode="velocity_2d",
                      reward_mode="dense", control_hz=10.0)
SOURCE_OF = {"dppo": "diffusion", "reinflow": "flow", "flow_sde": "flow", "ppo": "gaussian",
             "residual_ppo": "residual", "dsrl": "flow", "pa_rl": "gaussian", "residual_sac": "gaussian",
             "filtered_bc": "gaussian", "residual_ppo_step": "gaussian"}


def test_every_algorithm_is_covered():
    assert set(SOURCE_OF) == set(ALGORITHMS)


@pytest.fixture(scope="module")
def sources(tmp_path_factory, toy_pretrain, tiny_sources, weak_gaussian_bc):
    root = tmp_path_factory.mktemp("kl_sources")
    out = {
        "diffusion": tiny_sources["diffusion"],
        "flow": tiny_sources["flow"],
        "gaussian": weak_gaussian_bc,  # succeeds in about 0.3 of episodes: filtered BC has data to learn from
    }
    preset = root / "residual.yaml"
    preset.write_text(f"type: residual\nbase_checkpoint: {weak_gaussian_bc}\nobs_steps: 1\nhorizon_steps: 8\n"
                      "act_steps: 4\nhidden_dims: [32, 32]\n")
    out["residual"] = toy_pretrain(root / "residual", preset, 1, "--train.lr", "0")
    return out


@pytest.mark.parametrize("algo", list(SOURCE_OF))
def test_kl_to_base_is_zero_before_any_update_and_positive_after(tmp_path, sources, algo):
    # 10 chunks per env per iteration: 40-step episodes end within every iteration.
    cfg = FinetuneConfig(source=str(sources[SOURCE_OF[algo]]), out=str(tmp_path / algo), algo=algo, env=TOY_NAV2D,
                         rl=PPOConfig(iterations=2, steps_per_iter=10, minibatch_size=50, update_epochs=1,
                                      critic_warmup_iters=0),
                         offpolicy=OffPolicyConfig(steps_per_iter=10, utd=0.1, batch_size=64, critic_hidden=(32,)),
                         eval_episodes=0, save_every=2, seed=0)
    run_finetune(cfg)
    kl = [r["train/kl_to_base"] for r in read_metrics(cfg.out) if "train/kl_to_base" in r]
    assert len(kl) == 2
    assert kl[0] == 0.0, f"{algo}: the first rollout's policy is the initial one, got KL {kl[0]}"
    assert kl[1] > 0.0 and math.isfinite(kl[1]), f"{algo}: after an update the KL must be positive, got {kl[1]}"


def test_estimate_matches_the_closed_form_for_a_shifted_gaussian():
    """Two Gaussian policies with the same σ whose means differ by δ in every executed entry: KL = D δ² / (2 σ²)."""
    spec, norm = tiny_spec_and_normalizer()
    torch.manual_seed(0)
    policy = GaussianPolicy(GaussianPolicyConfig(horizon_steps=4, act_steps=2, hidden_dims=(8,), log_std_init=-2.0),
                            spec, norm)
    monitor = KLToBase(policy, KLMonitorConfig(num_obs=16, num_samples=4000))
    obs = {"state": torch.randn(16, 1, 3)}
    assert monitor.estimate(obs) == 0.0
    delta = 0.05
    with torch.no_grad():
        policy.mean_net[-1].bias += delta
    sigma = math.exp(-2.0)
    expected = 4 * delta**2 / (2 * sigma**2)  # D = act_steps × act_dim = 4 entries
    assert monitor.estimate(obs) == pytest.approx(expected, rel=0.1)
    restored = KLToBase(policy, KLMonitorConfig(num_obs=16, num_samples=4000))
    restored.load_state_dict(monitor.state_dict())
    assert restored.estimate(obs) == pytest.approx(monitor.estimate(obs))
