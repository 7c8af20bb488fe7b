"""SAC pieces the off-policy algorithms share: a tanh-squashed Gaussian actor and the learned temperature α.

Soft actor-critic (Haarnoja et al. 2018, arXiv 1812.05905): the actor minimises E[α log π(a|s) - Q(s, a)] with
a reparameterised sample a = b · tanh(u), u ~ N(μ_θ(s), σ_θ(s)²), whose log-density is (ibid., Appendix C, eq. 21)

    log π(a|s) = Σ_i [log N(u_i; μ_i, σ_i²) - log(b (1 - tanh²(u_i)))],

and α is tuned so that the policy's entropy tracks a target: min_α E[-α (log π(a|s) + H_target)] (ibid., eq. 18).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from robotft.policies.denoising_chain import gaussian_logprob_elementwise, scaled_tanh_log_det
from robotft.policies.encoders import mlp


class TanhGaussianActor(nn.Module):
    """π(a | x) over `[-bound, bound]^dim` from a feature vector x `[N, in_dim]`: an MLP to (μ, log σ) of u, then
    a = bound · tanh(u). log σ is squashed into [log_std_min, log_std_max]; it starts near `init_std` (DSRL starts
    at σ = 1, close to the base's own N(0, I) noise). With `zero_mean` the mean head starts at 0 for every input,
    so the deterministic action starts at 0 (DSRL: the base's own deterministic decoding)."""

    def __init__(self, in_dim: int, dim: int, hidden_dims: tuple[int, ...], bound: float,
                 log_std_min: float = -5.0, log_std_max: float = 2.0, init_std: float | None = None,
                 zero_mean: bool = False) -> None:
        super().__init__()
        self.dim, self.bound = dim, bound
        self.log_std_min, self.log_std_max = log_std_min, log_std_max
        self.net = mlp(in_dim, hidden_dims, 2 * dim)
        if init_std is not None:
            frac = (math.log(init_std) - log_std_min) / (log_std_max - log_std_min)
            if not 0 < frac < 1:
                raise ValueError(f"init_std {init_std} must lie inside exp([{log_std_min}, {log_std_max}])")
            with torch.no_grad():
                self.net[-1].bias[dim:] = math.atanh(2 * frac - 1)
        if zero_mean:
            with torch.no_grad():
                self.net[-1].weight[:dim] = 0.0
                self.net[-1].bias[:dim] = 0.0

    def _dist(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mean, raw = self.net(x).chunk(2, dim=-1)
        log_std = self.log_std_min + 0.5 * (self.log_std_max - self.log_std_min) * (torch.tanh(raw) + 1)
        return mean, log_std.exp()

    def forward(self, x: torch.Tensor, deterministic: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """`(a [N, dim], log π(a|x) [N])`, a reparameterised sample (the tanh of the mean if `deterministic`)."""
        mean, std = self._dist(x)
        u = mean if deterministic else mean + std * torch.randn_like(mean)
        logprob = (gaussian_logprob_elementwise(u, mean, std) - scaled_tanh_log_det(u, self.bound)).sum(-1)
        return self.bound * torch.tanh(u), logprob


class Temperature(nn.Module):
    """The entropy coefficient α = exp(log α), tuned towards `target_entropy` (or fixed when `learn` is False)."""

    def __init__(self, init: float, target_entropy: float, lr: float, learn: bool = True) -> None:
        super().__init__()
        if init <= 0:
            raise ValueError(f"the initial entropy coefficient must be > 0, got {init}")
        self.log_alpha = nn.Parameter(torch.tensor(math.log(init)), requires_grad=learn)
        self.target_entropy, self.learn = target_entropy, learn
        self.opt = torch.optim.Adam([self.log_alpha], lr=lr) if learn else None

    @property
    def alpha(self) -> torch.Tensor:
        return self.log_alpha.exp().detach()

    def update(self, logprob: torch.Tensor) -> dict[str, float]:
        """One step on -α (log π + H_target) for detached log-densities `[N]`; returns α and the entropy."""
        if self.opt is not None:
            loss = -(self.log_alpha.exp() * (logprob.detach() + self.target_entropy)).mean()
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            self.opt.step()
        return {"alpha": float(self.alpha), "entropy": float(-logprob.detach().mean())}

    def state(self) -> dict:
        return {"log_alpha": self.log_alpha.detach().clone(), "opt": self.opt.state_dict() if self.opt else {}}

    def load(self, state: dict) -> None:
        with torch.no_grad():
            self.log_alpha.copy_(state["log_alpha"])
        if self.opt is not None:
            self.opt.load_state_dict(state["opt"])
