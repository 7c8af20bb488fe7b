"""`train/kl_to_base`: how far fine-tuning has moved the policy from where it started, for every algorithm.

Forgetting under RL fine-tuning follows the KL divergence between the fine-tuned and the initial policy on the
task's own states ("RL's Razor", Shenfeld, Pari and Agrawal 2025). Diffusion and flow policies have no
closed-form density over chunks, so the monitor estimates it from samples: at each of `num_obs` rollout
observations it draws `num_samples` chunks from the current policy and from a frozen copy of the initial one, fits a
diagonal Gaussian to each set (executed `act_steps × A` entries, normalized action units, variances floored at
`var_floor`), and averages the closed-form

    KL(N_cur ‖ N_base) = ½ Σ_i [v_i / u_i + (μ_i - m_i)² / u_i - 1 + log(u_i / v_i)]

over the observations (μ, v the current policy's moments, m, u the initial one's). Both sample sets are drawn
with the same random seed, so an unchanged policy scores exactly 0. This is a moment-matched estimate, not the
exact KL: it sees shifts of mean and spread, not of the shape of a multimodal chunk distribution.

Only the parameters that train differ between the two copies, so the copy's state saved for resume holds just those.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from robotft.envs.base import Obs
from robotft.policies.base import Policy


@dataclass
class KLMonitorConfig:
    """The `train/kl_to_base` estimate (`--kl_to_base.X`)."""

    num_obs: int = 32
    """Rollout observations per estimate; 0 turns the monitor off (and keeps no copy of the initial policy)."""
    num_samples: int = 8
    """Chunks drawn per observation from each policy."""
    var_floor: float = 1e-4
    """Lower bound on each fitted variance (normalized action units²): a deterministic policy is a point mass."""
    seed: int = 12345
    """Seed of the sampling noise, shared by both policies."""

    def __post_init__(self) -> None:
        if self.num_obs < 0 or self.num_samples < 2 or self.var_floor <= 0:
            raise ValueError(f"kl_to_base: num_obs must be >= 0, num_samples >= 2 and var_floor > 0; got "
                             f"{self.num_obs}, {self.num_samples}, {self.var_floor}")


class KLToBase:
    """Holds a frozen copy of `policy` as it is now and estimates KL(current ‖ initial) on given observations."""

    def __init__(self, policy: Policy, cfg: KLMonitorConfig) -> None:
        self.policy, self.cfg = policy, cfg
        self.reference = copy.deepcopy(policy).requires_grad_(False).eval() if cfg.num_obs > 0 else None

    @property
    def enabled(self) -> bool:
        return self.reference is not None

    def _moments(self, policy: Policy, obs: Obs) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean and variance `[N, act_steps · A]` of `num_samples` chunks per observation, with the shared seed."""
        n, k = next(iter(obs.values())).shape[0], self.cfg.num_samples
        rep = {key: v.repeat_interleave(k, dim=0) for key, v in obs.items()}
        was_training = policy.training
        policy.eval()
        devices = [rep[next(iter(rep))].device] if rep[next(iter(rep))].is_cuda else []
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            torch.manual_seed(self.cfg.seed)
            chunks = policy.predict_chunk(rep, deterministic=False)
        policy.train(was_training)
        act_steps = self.policy.config.act_steps
        x = self.policy.normalizer.normalize("action", chunks[:, :act_steps].float()).reshape(n, k, -1)
        return x.mean(dim=1), x.var(dim=1).clamp(min=self.cfg.var_floor)

    def estimate(self, obs: Obs) -> float:
        """KL(current ‖ initial) averaged over up to `num_obs` of `obs` (histories `[N, obs_steps, ...]`, or
        `[T, B, obs_steps, ...]` rollout tensors, flattened first). NaN when the monitor is off."""
        if self.reference is None:
            return float("nan")
        flat_dims = next(iter(obs.values())).ndim - len(self._obs_shape(obs))
        obs = {k: v.reshape(-1, *v.shape[flat_dims:]) for k, v in obs.items()}
        n = next(iter(obs.values())).shape[0]
        pick = torch.linspace(0, n - 1, min(n, self.cfg.num_obs)).round().long()
        obs = {k: v[pick.to(v.device)] for k, v in obs.items()}
        mu, var = self._moments(self.policy, obs)
        m, u = self._moments(self.reference, obs)
        kl = 0.5 * (var / u + (mu - m) ** 2 / u - 1 + torch.log(u / var)).sum(dim=1)
        return float(kl.mean())

    def _obs_shape(self, obs: Obs) -> tuple[int, ...]:
        """Per-sample shape of the first key, `(obs_steps, *feature)`, from the policy's spec."""
        key = next(iter(obs))
        return (self.policy.config.obs_steps, *self.policy.spec.observations[key].shape)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The initial policy's values of the parameters that train (the rest equal the current policy's)."""
        if self.reference is None:
            return {}
        trained = {name for name, p in self.policy.named_parameters() if p.requires_grad}
        return {name: p.detach().clone() for name, p in self.reference.named_parameters() if name in trained}

    def load_state_dict(self, state: dict[str, torch.Tensor] | None) -> None:
        """Rebuild the initial copy from the current policy and the saved trained parameters (a resume)."""
        if self.reference is None or state is None:
            return
        self.reference = copy.deepcopy(self.policy).requires_grad_(False).eval()
        params = dict(self.reference.named_parameters())
        with torch.no_grad():
            for name, value in state.items():
                params[name].copy_(value)
