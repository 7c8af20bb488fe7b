"""ReinFlow / Flow-Noise (Zhang et al. 2025, arXiv 2505.22094): PPO on a flow policy made stochastic by a
learned noise net.

Every Euler step of the flow becomes the Gaussian transition

    x_{k+1} ~ N(x_k + v_θ(x_k, τ_k, o) Δτ, σ_φ(o, τ_k)²),   σ_φ ∈ [σ_min, σ_max] (tanh-bounded),

so the whole discrete-time chain x_0 → … → x_K has an exact likelihood:

    log π(x_0, …, x_K | o) = log N(x_0; 0, I) + Σ_k log N(x_{k+1}; x_k + v_θ Δτ, σ_φ²),

summed over all `H × A` entries of every step (the executed entries' means depend on the others through the
transformer, so the joint is scored). The chain is one scored transition of the PPO core (`num_scored() = 1`).
σ_φ depends on the observation and the step only, so it is computed before sampling; it trains with the actor
(its parameters are in `actor_parameters()` and in `state_dict()`), pushed up by the entropy bonus
c_H · mean_k,h,a [log σ_φ + ½ log 2πe]. The whole flow policy trains. Evaluation runs the ODE (no noise).

The noise net here reads the normalized observation history and τ_k only, not the latent x_k, which lets the
std be fixed before the chain is sampled (`FlowPolicy.sample_chain` takes it as a tensor).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from robotft.envs.base import Obs
from robotft.policies.denoising_chain import gaussian_logprob_elementwise
from robotft.policies.encoders import flatten_obs, mlp, sinusoidal_embedding
from robotft.policies.flow import FlowPolicy, euler_times
from robotft.rl.algorithm import ActOutput, Algorithm, register_algorithm

_LOG_2PI_E = math.log(2.0 * math.pi * math.e)


@dataclass
class ReinFlowConfig:
    """ReinFlow settings (the PPO core's are under `rl.`)."""

    sigma_min: float = 0.05
    """Lower bound of the learned noise std (normalized action units)."""
    sigma_max: float = 0.2
    """Upper bound of the learned noise std; the noise net starts at the midpoint."""
    noise_hidden_dims: tuple[int, ...] = (128, 128)
    """Hidden widths of the noise net σ_φ."""
    time_embed_dim: int = 16
    """Size of the sinusoidal embedding of τ_k fed to the noise net."""
    ent_coef: float = 0.03
    """Weight c_H of the entropy bonus (mean per-entry entropy of the chain's transitions; the authors' 0.03);
    0 disables it."""

    def __post_init__(self) -> None:
        if not 0 < self.sigma_min < self.sigma_max:
            raise ValueError(
                f"reinflow.sigma_min and sigma_max must satisfy 0 < min < max, got {self.sigma_min}, {self.sigma_max}"
            )
        if self.ent_coef < 0:
            raise ValueError(f"reinflow.ent_coef must be >= 0, got {self.ent_coef}")


class NoiseNet(nn.Module):
    """σ_φ(o, τ_k) `[B, K, H, A]`: an MLP over [normalized obs history, sinusoidal(τ_k)], bounded to
    [σ_min, σ_max] by σ_min + (σ_max - σ_min) · (tanh(raw) + 1) / 2. The output layer starts at zero."""

    def __init__(self, policy: FlowPolicy, cfg: ReinFlowConfig) -> None:
        super().__init__()
        self.obs_shapes, self.normalizer = policy.obs_shapes, policy.normalizer
        self.num_steps, self.horizon, self.act_dim = policy.config.num_steps, policy.config.horizon_steps, policy.act_dim
        self.cfg = cfg
        obs_dim = sum(math.prod(shape) for shape in policy.obs_shapes.values())
        self.net = mlp(obs_dim + cfg.time_embed_dim, tuple(cfg.noise_hidden_dims), self.horizon * self.act_dim)
        nn.init.zeros_(self.net[-1].weight)
        nn.init.zeros_(self.net[-1].bias)

    def forward(self, obs: Obs) -> torch.Tensor:
        cond = flatten_obs(obs, self.obs_shapes, self.normalizer)  # [B, D]
        batch, k = cond.shape[0], self.num_steps
        temb = sinusoidal_embedding(euler_times(k, cond.device), self.cfg.time_embed_dim)  # [K, E]
        x = torch.cat([cond[:, None].expand(-1, k, -1), temb[None].expand(batch, -1, -1)], dim=-1)
        raw = self.net(x).view(batch, k, self.horizon, self.act_dim)
        lo, hi = self.cfg.sigma_min, self.cfg.sigma_max
        return lo + (hi - lo) * (torch.tanh(raw) + 1) / 2


@register_algorithm
class ReinFlow(Algorithm):
    name = "reinflow"
    config_cls = ReinFlowConfig
    exploration_flags = "--reinflow.sigma_min, --reinflow.sigma_max"
    rl_defaults: ClassVar[dict[str, Any]] = {
        "actor_lr": 4.5e-5, "critic_lr": 6.5e-4, "lr_schedule": "cosine", "lr_warmup_iters": 1,
        "actor_min_lr": 2e-5, "critic_min_lr": 3e-4, "update_epochs": 5,
    }
    """The authors' configs (ReinFlow/ReinFlow, `ft_ppo_reflow_mlp`): per-entry mean log-density, clip 0.01,
    target KL 1 (the PPO core's defaults), actor 4.5e-5 → 2e-5 and critic 6.5e-4 → 3e-4 on cosine schedules,
    5 epochs."""

    def __init__(self, policy: FlowPolicy, cfg: ReinFlowConfig) -> None:
        if not isinstance(policy, FlowPolicy):
            raise TypeError(f"reinflow fine-tunes flow_transformer policies; got {type(policy).__name__}")
        self.policy, self.cfg = policy, cfg
        self.noise_net = NoiseNet(policy, cfg).to(next(policy.parameters()).device)

    def act(self, obs: Obs, deterministic: bool = False) -> ActOutput:
        with torch.no_grad():
            std = self.noise_net(obs)
        chain = self.policy.sample_chain(obs, noise_std=std, deterministic=deterministic)
        sample = {"chain": chain.latents}
        with torch.no_grad():
            logprob = self.logprob(obs, sample)
        return ActOutput(actions=chain.actions, sample=sample, logprob=logprob)

    def logprob(self, obs: Obs, sample: dict[str, torch.Tensor]) -> torch.Tensor:
        """`[N, 1]`: log N(x_0; 0, I) + Σ_k log N(x_{k+1}; x_k + v_θ Δτ, σ_φ(o, τ_k)²) over all entries, with
        σ_φ recomputed (with gradients) from the current noise net; divided by the (K + 1) H A entries under the
        default `rl.logprob_reduction` mean (ReinFlow's `normalize_denoising_horizon` and
        `normalize_act_space_dimension`)."""
        latents = sample["chain"]
        steps = self.policy.chain_elementwise_logprob(obs, latents, noise_std=self.noise_net(obs))
        x0 = latents[:, 0]
        initial = gaussian_logprob_elementwise(x0, torch.zeros_like(x0), torch.ones_like(x0))
        entries = torch.cat([initial.flatten(1), steps.flatten(1)], dim=1)  # [N, (K + 1) H A]
        return self.reduce_entries(entries[:, None])

    def actor_parameters(self) -> list[nn.Parameter]:
        return super().actor_parameters() + list(self.noise_net.parameters())

    def extra_loss(self, obs: Obs, sample: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
        """-c_H · mean per-entry entropy ½ log 2πe + log σ_φ of the chain's Gaussian transitions."""
        std = self.noise_net(obs)
        entropy = (std.log() + 0.5 * _LOG_2PI_E).mean()
        return -self.cfg.ent_coef * entropy, {"entropy": entropy.item(), "noise_std": std.mean().item()}

    def state_dict(self) -> dict[str, Any]:
        return {"noise_net": self.noise_net.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.noise_net.load_state_dict(state["noise_net"])
