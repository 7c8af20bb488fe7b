"""Residual PPO (ResiP, Ankile et al. 2024, arXiv 2407.16677): PPO on a Gaussian residual over a frozen base.

One action is one chunk a = clip(a^base + s ⊙ r), r ~ N(r_θ(o, a^base), diag(σ²)) (robotft.policies.residual).
The sample stores the base chunk and the residual, so the residual is re-scored against the base chunk it
was sampled for (the base may itself be stochastic). It is scored as K = 1 transition: the exact Gaussian
log-density of r over the executed `act_steps × act_dim` entries. As in ResiP the critic sees the
observation and the base action, V(o, a^base); for a bootstrap observation without a stored sample the
base is run again. The actor loss adds an entropy bonus. Only r_θ and σ train; the base gets no gradient. A
checkpoint that is not a residual policy is wrapped in a zero-initialised residual at the start.

`residual_ppo_step` is ResiP's closed loop: one transition is one env step, the base re-planning every `act_steps`
of its own and executing its plan open loop, the residual correcting every step from the current observation
(`ResidualPolicyConfig.closed_loop`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from robotft.envs.base import Obs
from robotft.policies.residual import ResidualPolicy, wrap_residual
from robotft.rl.algorithm import ActOutput, register_algorithm
from robotft.rl.gaussian_ppo import GaussianChunkPPO


@dataclass
class ResidualPPOConfig:
    """Residual-PPO settings (the PPO core's are under `rl.`)."""

    ent_coef: float = 0.0
    """Weight c_H of the entropy bonus on the residual's Gaussian (per executed chunk); 0 disables it."""
    residual_hidden: tuple[int, ...] = (256, 256)
    """Hidden widths of the residual MLP (used when wrapping a base policy)."""
    log_std_init: float = -4.0
    """Initial log σ of the residual, normalized action units (used when wrapping a base policy). σ = e⁻⁴ ≈ 0.02
    keeps the exploring rollouts close to the base: PickCube's success needs the arm static at the goal, and
    exploration noise of 0.1 (DPPO's floor) took a 29% BC's rollouts to 0% success."""

    def __post_init__(self) -> None:
        if self.ent_coef < 0:
            raise ValueError(f"residual_ppo.ent_coef must be >= 0, got {self.ent_coef}")


@register_algorithm
class ResidualPPO(GaussianChunkPPO):
    name = "residual_ppo"
    config_cls = ResidualPPOConfig
    exploration_flags = "--residual_ppo.log_std_init"
    rl_defaults: ClassVar[dict[str, Any]] = {
        "logprob_reduction": "sum", "clip_eps": 0.2, "actor_lr": 3e-5, "update_epochs": 10, "target_kl": 0.1,
        "steps_per_iter": 200, "lr_schedule": "cosine",
    }
    """ResiP's PPO (arXiv 2407.16677, Table 5): exact joint log-density, clip 0.2, KL early stop at 0.1 (ResiP runs
    up to 50 full-batch epochs; 10 epochs of minibatches take similar steps here). The actor learning rate is
    ResiP's 3e-4 / 10: ResiP scales its residual's output by 0.1, which makes each Adam step move the executed
    action 10x less relative to σ than here, where the residual acts unscaled with σ₀ = e⁻⁴. Large rollouts (200
    chunks per env) and a cosine decay. Measured on PickCube from a 29% BC with 4 CPU envs, 120 iterations
    (384k env steps), 100-episode evaluations: at 3e-4, 48%, 33% (seeds 0, 2; seed 1 at 60 iterations 35%), 97
    of 120 updates stopped by the KL limit and clip fractions of 0.3-0.4; at 3e-5, 49%, 43% and 41% (seeds 2, 1, 0).
    Earlier, at 3e-4: 50 chunks per env held it at 30-34%; 200 with a constant rate rose to 46% at 112k env
    steps, then fell to 20% by 160k."""

    closed_loop: ClassVar[bool] = False
    """Whether a base policy is wrapped in a closed-loop (per-step) residual."""

    def __init__(self, policy: ResidualPolicy, cfg: ResidualPPOConfig) -> None:
        if not isinstance(policy, ResidualPolicy):
            policy = wrap_residual(policy, cfg.residual_hidden, cfg.log_std_init, closed_loop=self.closed_loop)
        elif self.closed_loop and not policy.config.closed_loop:
            raise ValueError(f"{self.name} trains a closed-loop residual; this checkpoint holds an open-loop one "
                             "(fine-tune it with residual_ppo, or start residual_ppo_step from its base)")
        self.policy, self.cfg = policy, cfg
        plan = policy.config.plan_every
        self.critic_extra_dim = (plan * policy.act_dim + plan) if plan else policy.config.horizon_steps * policy.act_dim
        """Size of the critic's extra input: the flattened, normalized base chunk; in the closed loop the base's
        whole plan and a one-hot of the current step in it."""

    def act(self, obs: Obs, deterministic: bool = False) -> ActOutput:
        if deterministic:
            with torch.no_grad():
                base_action = self.policy.base_chunk(obs)
                residual = self.policy.residual_mean(obs, base_action)
            actions = self.policy.to_actions(base_action, residual)
            sample = {"base_action": base_action, "residual": residual}
        else:
            actions, sample, _ = self.policy.sample_with_logprob(obs)
        if self.policy.config.closed_loop:
            sample["base_plan"] = self.policy.base_plan(obs)
        with torch.no_grad():
            logprob = self.logprob(obs, sample)
        return ActOutput(actions=actions, sample=sample, logprob=logprob)

    def elementwise_logprob(self, obs: Obs, sample: dict[str, torch.Tensor]) -> torch.Tensor:
        """log N(r; r_θ(o, a^base), σ²) per entry of the stored residual r, against its stored base chunk."""
        return self.policy.elementwise_logprob(obs, sample)

    def critic_extra(self, obs: Obs, sample: dict[str, torch.Tensor] | None) -> torch.Tensor:
        """What the critic conditions on besides the observation: `[N, H * A]` the normalized base chunk (the
        stored one, or for an observation without a sample, when bootstrapping, a fresh one). In the closed loop
        `[N, K * A + K]` the base's whole plan and a one-hot of the current step h: the base executes the rest of
        its plan whatever the current observation is, so the value of a state depends on it."""
        policy = self.policy
        if not policy.config.closed_loop:
            base_action = sample["base_action"] if sample is not None else policy.base_chunk(obs)
            return policy.normalizer.normalize("action", base_action).flatten(1)
        plan = sample["base_plan"] if sample is not None else policy.base_plan(obs)
        return torch.cat([policy.normalizer.normalize("action", plan).flatten(1), policy.plan_step_onehot(obs)], dim=-1)


@register_algorithm
class ResidualPPOStep(ResidualPPO):
    name = "residual_ppo_step"
    closed_loop = True
    exploration_flags = "--residual_ppo_step.log_std_init"
    rl_defaults: ClassVar[dict[str, Any]] = {
        **ResidualPPO.rl_defaults, "steps_per_iter": 1600, "num_minibatches": 16, "gamma": 0.9987, "gae_lambda": 0.9936,
    }
    """Residual PPO's values per env step instead of per 8-step chunk, so that the two differ in the loop alone:
    the same env steps per iteration (200 chunks of 8 = 1600 steps per env), the same optimizer steps (16
    minibatches × 10 epochs at 4 envs), and the same discount and GAE horizons (0.99^(1/8), 0.95^(1/8)). Clip 0.2
    and KL stop 0.1 are ResiP's, which are per step (arXiv 2407.16677, Table 5)."""
