"""Noise-steered policy: a frozen diffusion or flow policy whose initial noise comes from a small actor (DSRL,
Wagenmaker et al. 2025, arXiv 2506.15799).

The base maps an initial noise w `[H, A]` to a chunk deterministically (`decode_noise`: DDIM with η = 0 or the flow
ODE); a tanh-Gaussian actor π_ψ(w | o) over w ∈ [-b, b]^(H·A) chooses the noise instead of N(0, I):

    a = base.decode_noise(o, w),   w ~ π_ψ(· | o).

Only ψ is trained (by `--algo dsrl`); the base's weights never change, and the base needs only black-box access
through `decode_noise` (robotft's diffusion and flow policies and the LeRobot policies implement it).

One checkpoint holds everything, as for residual policies: the base's policy config, env spec and normalizer
statistics are embedded in `config.base`, its weights in the policy's `base.*`, so `robotft eval` needs no flags.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from robotft.datasets.normalizer import Normalizer
from robotft.policies.base import Obs, Policy, PolicyConfig, register_policy
from robotft.policies.encoders import flatten_obs, low_dim_obs_shapes
from robotft.policies.residual import build_base, policy_record
from robotft.rl.sac import TanhGaussianActor
from robotft.specs import EnvSpec


@dataclasses.dataclass
class NoiseSteeredPolicyConfig(PolicyConfig):
    """A frozen base policy with a learned distribution over its initial noise (DSRL)."""

    type: str = "noise_steered"
    """Registered policy name."""
    base: dict[str, Any] = dataclasses.field(default_factory=dict)
    """The base policy's `{"policy", "spec", "normalizer"}` (config, env spec, normalizer statistics)."""
    hidden_dims: tuple[int, ...] = (256, 256)
    """Hidden widths of the noise actor's MLP."""
    noise_bound: float = 1.5
    """b: the actor's noise lies in [-b, b]^(H·A) (N(0, I) puts 87% of its mass per entry inside ±1.5)."""
    log_std_min: float = -5.0
    """Lower bound of the actor's log σ (before the tanh)."""
    log_std_max: float = 2.0
    """Upper bound of the actor's log σ."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.base:
            raise ValueError("policy.base must hold the base policy's record (built by --algo dsrl)")
        if self.noise_bound <= 0:
            raise ValueError(f"policy.noise_bound must be > 0, got {self.noise_bound}")


class NoiseSteeredPolicy(Policy):
    """Frozen `base` + noise actor; see the module docstring."""

    def __init__(self, config: NoiseSteeredPolicyConfig, spec: EnvSpec, normalizer: Normalizer, base: Policy):
        super().__init__()
        if not hasattr(base, "decode_noise"):
            raise TypeError(f"DSRL steers policies that decode a given noise deterministically (decode_noise); "
                            f"{type(base).__name__} does not")
        self.config, self.spec, self.normalizer = config, spec, normalizer
        self.base = base.requires_grad_(False).eval()
        self.noise_shape = tuple(base.noise_shape)
        self.obs_shapes = low_dim_obs_shapes(config, spec, normalizer, "noise_steered", images="skip")
        if not self.obs_shapes:
            raise ValueError("the noise actor reads low-dim observations; policy.obs_keys has none")
        obs_dim = sum(math.prod(s) for s in self.obs_shapes.values())
        self.actor = TanhGaussianActor(obs_dim, math.prod(self.noise_shape), tuple(config.hidden_dims),
                                       config.noise_bound, config.log_std_min, config.log_std_max, init_std=1.0,
                                       zero_mean=True)

    def train(self, mode: bool = True) -> NoiseSteeredPolicy:
        """Train mode for the actor; the frozen base always stays in eval mode."""
        super().train(mode)
        self.base.eval()
        return self

    def features(self, obs: Obs) -> torch.Tensor:
        """`[B, F]` the normalized low-dim history the actor reads (clipped: RL leaves the data's range)."""
        return flatten_obs(obs, self.obs_shapes, self.normalizer)

    def noise(self, obs: Obs, deterministic: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """`(w [B, H·A], log π_ψ(w | o) [B])`, reparameterised (gradients reach ψ)."""
        return self.actor(self.features(obs), deterministic)

    @torch.no_grad()
    def decode(self, obs: Obs, noise: torch.Tensor) -> torch.Tensor:
        """The base's chunk `[B, H, A]` env units for flat noise `[B, H·A]`."""
        return self.base.decode_noise(obs, noise.view(noise.shape[0], *self.noise_shape))

    @torch.no_grad()
    def predict_chunk(self, obs: Obs, deterministic: bool = True, *, generator: torch.Generator | None = None
                      ) -> torch.Tensor:
        """Actions `[B, H, A]` env units: the base decoding the actor's noise (its tanh mean if `deterministic`)."""
        return self.decode(obs, self.noise(obs, deterministic)[0])

    def loss(self, batch: dict[str, Any]) -> tuple[torch.Tensor, dict[str, float]]:
        raise NotImplementedError("a noise-steered policy is trained by RL (--algo dsrl); BC trains its base")


def steer(base: Policy, hidden_dims: tuple[int, ...], noise_bound: float) -> NoiseSteeredPolicy:
    """Wrap an in-memory base policy (its weights kept, frozen) in a fresh noise actor."""
    cfg = NoiseSteeredPolicyConfig(
        base=policy_record(base), obs_keys=list(base.config.obs_keys), obs_steps=base.config.obs_steps,
        horizon_steps=base.config.horizon_steps, act_steps=base.config.act_steps,
        normalizer_mode=base.config.normalizer_mode, hidden_dims=tuple(hidden_dims), noise_bound=noise_bound,
    )
    return NoiseSteeredPolicy(cfg, base.spec, base.normalizer, base)


@register_policy("noise_steered", NoiseSteeredPolicyConfig)
def build_noise_steered_policy(config: NoiseSteeredPolicyConfig, spec: EnvSpec, normalizer: Normalizer
                               ) -> NoiseSteeredPolicy:
    """The registered factory: the base is rebuilt from `config.base`; its weights load with the policy's."""
    return NoiseSteeredPolicy(config, spec, normalizer, build_base(config.base))
