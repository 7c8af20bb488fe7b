"""PPO on a Gaussian MLP policy (Schulman et al. 2017, arXiv 1707.06347; CleanRL's `ppo_continuous_action`;
DPPO's Gaussian baseline, Ren et al. 2024).

One action is one chunk a ~ N(μ_θ(o), diag(σ²)); it is scored as K = 1 transition whose log-density is the
diagonal-Gaussian one over the executed `act_steps × act_dim` entries (the rest of the chunk never reaches the
env, so it would only add noise to the ratio): averaged per entry by default, as DPPO's Gaussian baseline does
when it fine-tunes a BC, or summed (the exact joint density, CleanRL's, `--rl.logprob_reduction sum`). The actor
loss adds an entropy bonus -c_H · H[π(· | o)] over the same entries. The whole policy (mean MLP and log σ) trains.

From scratch: `robotft finetune` starts from a checkpoint, and `robotft pretrain --policy gaussian_mlp
--steps 1 --train.lr 0` writes one with freshly initialised weights (the first step of the LR warm-up has a
zero learning rate anyway); the demonstrations are then only used for the normalizer's statistics.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import torch

from robotft.envs.base import Obs
from robotft.policies.gaussian import GaussianPolicy
from robotft.rl.algorithm import ActOutput, Algorithm, register_algorithm


@dataclass
class GaussianPPOConfig:
    """Gaussian-PPO settings (the PPO core's are under `rl.`; CleanRL uses rl.clip_eps 0.2)."""

    ent_coef: float = 0.0
    """Weight c_H of the entropy bonus (per executed chunk); 0 disables it."""

    def __post_init__(self) -> None:
        if self.ent_coef < 0:
            raise ValueError(f"ppo.ent_coef must be >= 0, got {self.ent_coef}")


class EntropyBonusConfig(Protocol):
    """What GaussianChunkPPO reads of its algorithm's config section (`ppo.` or `residual_ppo.`)."""

    ent_coef: float


class GaussianChunkPPO(Algorithm):
    """PPO over a policy whose chunk is one diagonal-Gaussian draw with σ shared by its H steps (the Gaussian
    MLP; the residual of residual PPO): scored as K = 1 transition, the log-density of the executed
    `act_steps × act_dim` entries summed or averaged (`rl.logprob_reduction`), with an entropy bonus over the
    same entries."""

    cfg: EntropyBonusConfig

    @abc.abstractmethod
    def elementwise_logprob(self, obs: Obs, sample: dict[str, torch.Tensor]) -> torch.Tensor:
        """`[N, H, A]` per-entry log-densities of the stored Gaussian draw."""

    def logprob(self, obs: Obs, sample: dict[str, torch.Tensor]) -> torch.Tensor:
        """`[N, 1]`: the log-density of the executed `act_steps × act_dim` entries, summed (the exact joint)
        or averaged (`rl.logprob_reduction`)."""
        lp = self.elementwise_logprob(obs, sample)
        return self.reduce_entries(lp[:, None, : self.policy.config.act_steps])

    def extra_loss(self, obs: Obs, sample: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
        """-c_H · entropy of the executed entries: `act_steps / H` of the chunk's (σ is shared by the H steps)."""
        cfg = self.policy.config
        entropy = self.policy.entropy(obs).mean() * cfg.act_steps / cfg.horizon_steps
        return -self.cfg.ent_coef * entropy, {"entropy": entropy.item(), "noise_std": self.policy.std().mean().item()}


@register_algorithm
class GaussianPPO(GaussianChunkPPO):
    name = "ppo"
    config_cls = GaussianPPOConfig
    rl_defaults: ClassVar[dict[str, Any]] = {
        "logprob_reduction": "mean", "clip_eps": 0.01, "actor_lr": 1e-4, "critic_lr": 1e-3, "update_epochs": 10,
        "target_kl": 1.0,
    }
    """DPPO's Gaussian fine-tuning baseline (Ren et al. 2024, `ft_ppo_gaussian_mlp`): the mean per-entry
    log-density, clip 0.01, actor lr 1e-4, critic lr 1e-3, 10 epochs, KL early stop at 1. These fit a policy
    that starts from BC with a small σ. CleanRL's values for training from scratch (the exact joint density,
    clip 0.2, lr 3e-4, 4 epochs, target KL 0.1) move such a policy by hundreds of nats of KL in one Adam step."""

    def __init__(self, policy: GaussianPolicy, cfg: GaussianPPOConfig) -> None:
        if not isinstance(policy, GaussianPolicy):
            raise TypeError(f"ppo fine-tunes gaussian_mlp policies; got {type(policy).__name__}")
        self.policy, self.cfg = policy, cfg

    def act(self, obs: Obs, deterministic: bool = False) -> ActOutput:
        if deterministic:
            with torch.no_grad():
                mean = self.policy.mean(obs)
            actions, sample = self.policy.to_actions(mean), {"action": mean}
        else:
            actions, chunk, _ = self.policy.sample_with_logprob(obs)
            sample = {"action": chunk}
        with torch.no_grad():
            logprob = self.logprob(obs, sample)
        return ActOutput(actions=actions, sample=sample, logprob=logprob)

    def elementwise_logprob(self, obs: Obs, sample: dict[str, torch.Tensor]) -> torch.Tensor:
        """log N(a; μ_θ(o), σ²) per entry of the stored chunk a."""
        return self.policy.elementwise_logprob(obs, sample["action"])
