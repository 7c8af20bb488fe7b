"""Per-algorithm defaults: `robotft finetune --algo X` with no `rl.` flags takes X's own published values, the
resolved values are saved with the run, and X's first actor update is healthy (it moves the policy without
clipping most samples). With the PPO core's DPPO-sized clip, summed log-densities clipped 77-98% of samples."""

import json
import math

import pytest

from robotft.cli import main
from robotft.finetune import ALGORITHMS, FinetuneConfig
from robotft.rl.ppo import PPOConfig
from robotft.runlog import read_metrics

ALGOS = {"dppo": "diffusion", "reinflow": "flow", "flow_sde": "flow", "ppo": "gaussian", "residual_ppo": "residual",
         "residual_ppo_step": "gaussian"}


def _finetune(source, out, algo: str, *flags: str) -> list[dict]:
    # Only the env size and the evaluation are set; every rl./algorithm field keeps its default. The run lasts
    # until the first actor update (after the algorithm's critic warm-up).
    warmup = FinetuneConfig.for_algorithm(algo).rl.critic_warmup_iters
    assert main(["finetune", "--from", str(source), "--algo", algo, "--out", str(out), "--iterations",
                 str(warmup + 1), "--env.num_envs", "16", "--eval_episodes", "0", *flags]) == 0
    return [r for r in read_metrics(out) if "train/actor_trained" in r]


@pytest.mark.parametrize("algo", list(ALGOS))
def test_first_actor_update_is_healthy_with_defaults(tmp_path, tiny_sources, algo):
    rows = _finetune(tiny_sources[ALGOS[algo]], tmp_path / algo, algo)
    first = rows[-1]
    assert first["train/actor_trained"] == 1.0
    assert first["train/clip_fraction"] < 0.3, f"{algo}: {first['train/clip_fraction']:.2f} of samples clipped"
    assert first["train/approx_kl"] != 0.0, f"{algo}: the update did not move the policy"
    assert all(math.isfinite(v) for k, v in first.items() if isinstance(v, float)), first

    saved = json.loads((tmp_path / algo / "config.json").read_text())["run"]["rl"]
    for field, value in ALGORITHMS[algo].rl_defaults.items():
        assert saved[field] == value, f"{algo}: rl.{field} saved as {saved[field]!r}, its default is {value!r}"


def test_a_user_flag_wins_over_the_algorithm_default(tmp_path, tiny_sources):
    _finetune(tiny_sources["gaussian"], tmp_path / "ppo", "ppo", "--rl.clip_eps", "0.05")
    saved = json.loads((tmp_path / "ppo" / "config.json").read_text())["run"]["rl"]
    assert saved["clip_eps"] == 0.05 and saved["logprob_reduction"] == "mean" and saved["actor_lr"] == 1e-4


def test_algorithms_declare_different_defaults():
    """The summed-density algorithms do not run on DPPO's clip range (the bug this guards against), and Gaussian
    PPO from a BC runs on DPPO's Gaussian baseline's values, not CleanRL's from-scratch ones."""
    dppo, ppo = FinetuneConfig.for_algorithm("dppo").rl, FinetuneConfig.for_algorithm("ppo").rl
    residual = FinetuneConfig.for_algorithm("residual_ppo").rl
    assert dppo.clip_eps == PPOConfig().clip_eps and dppo.logprob_reduction == "mean"
    assert residual.clip_eps == 0.2 and residual.logprob_reduction == "sum"
    assert (ppo.logprob_reduction, ppo.clip_eps, ppo.actor_lr, ppo.target_kl) == ("mean", 0.01, 1e-4, 1.0)


@pytest.mark.parametrize("algo", list(ALGOS))
def test_an_algorithm_built_directly_scores_as_its_runs_do(algo):
    """The class's log-density reduction is the one its runs resolve (Flow-SDE's `none`, residual PPO's `sum`),
    so a library user or a unit test that builds it without `make_algorithm` clips the same ratios."""
    assert ALGORITHMS[algo].logprob_reduction == FinetuneConfig.for_algorithm(algo).rl.logprob_reduction


def test_dppo_runs_from_a_ddim_policy_with_default_flags(tmp_path, tiny_sources):
    """dppo.ft_denoising_steps (DPPO's 10) is capped at the sampler's own number of steps (here DDIM's 4)."""
    _finetune(tiny_sources["ddim"], tmp_path / "dppo_ddim", "dppo")
    saved = json.loads((tmp_path / "dppo_ddim" / "checkpoint" / "config.json").read_text())["policy"]
    assert saved["ft_denoising_steps"] == 4
