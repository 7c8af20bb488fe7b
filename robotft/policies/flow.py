"""Flow-matching policy with a π0-style action expert (Black et al. 2024, arXiv 2410.24164).

Observation tokens (the *prefix*) are encoded once per chunk; a small transformer, the action expert, maps one
token per action step (noisy action + flow time) to a velocity, attending to itself and, by cross-attention,
to the prefix. The prefix is one state token from an MLP over the normalized low-dim observation history,
followed by one image token per camera and history step (the keypoint features of the shared ResNet image
encoder, robotft.policies.vision, projected to the token width, plus a learned embedding of which camera
and step it is); `encode_prefix` is where task-text tokens are concatenated later.

Time convention (π0 paper, Sec. IV): τ = 0 is noise, τ = 1 is data,

    x_τ = τ · a + (1 - τ) · ε,   ε ~ N(0, I),   u = d x_τ / dτ = a - ε,

and BC minimises E ‖v_θ(x_τ, τ, o) - u‖². (The paper prints u = ε - a: that is the velocity of openpi's
mirrored time t = 1 - τ, in which x_t = t · ε + (1 - t) · a and sampling runs from t = 1 to 0; the two are
the same flow.) τ is drawn as in π0: τ = s · (1 - b), b ~ Beta(1.5, 1), s = 0.999, which puts more weight
on noisy times (openpi: t = 0.999 · b + 0.001); `time_sampling: uniform` draws τ = s · U(0, 1) instead.

Sampling integrates dx/dτ = v_θ from x_0 ~ N(0, I) with K Euler steps, x_{k+1} = x_k + v_θ(x_k, τ_k) Δτ,
τ_k = k / K, Δτ = 1 / K. For flow RL (ReinFlow, Zhang et al. 2025, arXiv 2505.22094; Flow-SDE) each step
is the Gaussian transition x_{k+1} ~ N(x_k + v_θ Δτ, σ_k²) of a denoising chain
(robotft.policies.denoising_chain), with σ chosen by the algorithm.

Example:
    config = FlowPolicyConfig(obs_steps=1, horizon_steps=8, act_steps=4, num_steps=10)
    policy = build_policy(config, spec, normalizer)
    loss, metrics = policy.loss({"obs": {"state": s}, "action": a})  # s [B, 1, D], a [B, 8, A]
    actions = policy.predict_chunk({"state": s})                       # [B, 8, A], env units
    chain = policy.sample_chain({"state": s}, noise_std=0.1)           # K transitions with logprobs
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from robotft.datasets.normalizer import Normalizer
from robotft.policies.base import Obs, Policy, PolicyConfig, register_policy
from robotft.policies.denoising_chain import Chain, chain_transitions, gaussian_logprob_elementwise
from robotft.policies.encoders import ObsEncoder, check_chunk, mlp, sinusoidal_embedding
from robotft.specs import EnvSpec

TIME_SAMPLINGS = ("beta", "uniform")
MAX_STEPS = 10


@dataclasses.dataclass
class FlowPolicyConfig(PolicyConfig):
    """Flow-matching policy with a transformer action expert (π0-style, scaled down for low-dim tasks)."""

    type: str = "flow_transformer"
    """Registered policy name."""
    width: int = 128
    """Token width d_model of the action expert and the prefix tokens."""
    num_layers: int = 2
    """Transformer decoder layers of the action expert (self-attention, cross-attention to the prefix, MLP)."""
    num_heads: int = 4
    """Attention heads (must divide `width`)."""
    state_hidden_dims: tuple[int, ...] = (256,)
    """Hidden widths of the MLP that turns the normalized obs history into the state token."""
    time_embed_dim: int = 64
    """Size of the sinusoidal embedding of the flow time τ."""
    num_steps: int = 10
    """Euler steps K of sampling (1 to 10)."""
    time_sampling: str = "beta"
    """Training-time distribution of τ: `beta` (π0: τ = s (1 - b), b ~ Beta(beta_a, beta_b)) or `uniform`."""
    beta_a: float = 1.5
    """First Beta shape parameter (π0: 1.5)."""
    beta_b: float = 1.0
    """Second Beta shape parameter (π0: 1)."""
    time_max: float = 0.999
    """s: training times lie in [0, s] (π0: 0.999), so the target never needs τ = 1 exactly."""
    final_action_clip: float = 1.0
    """Clip the normalized final chunk to [-final_action_clip, final_action_clip] before unnormalizing."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 1 <= self.num_steps <= MAX_STEPS:
            raise ValueError(f"policy.num_steps must be in [1, {MAX_STEPS}], got {self.num_steps}")
        if self.time_sampling not in TIME_SAMPLINGS:
            raise ValueError(
                f"policy.time_sampling must be one of {TIME_SAMPLINGS}, got {self.time_sampling!r}"
            )
        if self.beta_a <= 0 or self.beta_b <= 0:
            raise ValueError(f"policy.beta_a and policy.beta_b must be > 0, got {self.beta_a}, {self.beta_b}")
        if not 0 < self.time_max <= 1:
            raise ValueError(f"policy.time_max must be in (0, 1], got {self.time_max}")
        if self.width % self.num_heads:
            raise ValueError(
                f"policy.width={self.width} must be divisible by policy.num_heads={self.num_heads}"
            )
        if self.num_layers < 1:
            raise ValueError(f"policy.num_layers must be >= 1, got {self.num_layers}")
        if self.final_action_clip <= 0:
            raise ValueError(f"policy.final_action_clip must be > 0, got {self.final_action_clip}")


# --- the flow's math ---------------------------------------------------------------------------------


def interpolate(action: torch.Tensor, noise: torch.Tensor, tau: torch.Tensor) -> torch.Tensor:
    """x_τ = τ a + (1 - τ) ε (π0 Sec. IV). `action`, `noise` `[B, H, A]`, `tau` `[B]`."""
    tau = tau[:, None, None]
    return tau * action + (1 - tau) * noise


def target_velocity(action: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """u = d x_τ / dτ = a - ε, the conditional velocity of the linear path (Lipman et al. 2023,
    arXiv 2210.02747, eq. 23 with σ_min = 0; see the module docstring for π0's printed sign)."""
    return action - noise


def euler_times(num_steps: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """τ_k = k / K for the K Euler steps, `[K]`; every step has Δτ = 1 / K."""
    return torch.arange(num_steps, device=device, dtype=torch.float32) / num_steps


# --- network ---------------------------------------------------------------------------------------


class ActionExpert(nn.Module):
    """v_θ(x, τ, prefix): π0's action expert at small scale.

    Action tokens: an MLP over [W x_h, φ(τ)] for each chunk step h (π0's action-time MLP), plus a learned
    position embedding. They run through pre-norm transformer decoder layers: bidirectional self-attention
    among the action tokens and cross-attention to the prefix tokens (π0's blockwise attention, in which
    action tokens see the whole prefix and the prefix never sees the actions).

    `num_times` scalar times per sample are each embedded and concatenated: 1 for the flow time τ; MeanFlow
    (robotft.policies.meanflow) adds the interval length.
    """

    def __init__(self, act_dim: int, horizon: int, config: FlowPolicyConfig, num_times: int = 1):
        super().__init__()
        width = config.width
        self.time_embed_dim = config.time_embed_dim
        self.action_in = nn.Linear(act_dim, width)
        self.action_time_mlp = nn.Sequential(
            nn.Linear(width + num_times * config.time_embed_dim, width), nn.SiLU(), nn.Linear(width, width)
        )
        self.position = nn.Parameter(0.02 * torch.randn(horizon, width))
        layer = nn.TransformerDecoderLayer(
            width,
            config.num_heads,
            dim_feedforward=4 * width,
            dropout=0.0,
            activation="gelu",
            batch_first=True,
            norm_first=True,
        )
        self.decoder = nn.TransformerDecoder(layer, config.num_layers, norm=nn.LayerNorm(width))
        self.out = nn.Linear(width, act_dim)

    def forward(self, prefix: torch.Tensor, x: torch.Tensor, *times: torch.Tensor) -> torch.Tensor:
        """`prefix` `[B, P, D]`, `x` `[B, H, A]`, `times`: `num_times` tensors `[B]` → velocity `[B, H, A]`."""
        temb = torch.cat([sinusoidal_embedding(t, self.time_embed_dim) for t in times], dim=-1)
        temb = temb[:, None].expand(-1, x.shape[1], -1)
        tokens = self.action_time_mlp(torch.cat([self.action_in(x), temb], dim=-1)) + self.position
        return self.out(self.decoder(tokens, prefix))


# --- policy ----------------------------------------------------------------------------------------


class FlowPolicy(Policy):
    """Flow-matching policy over normalized action chunks `[B, H, A]`, conditioned on prefix tokens."""

    instantaneous_velocity = True
    """`velocity()` is the flow's instantaneous velocity v(x, τ), which the SDE conversion of Flow-SDE needs."""

    def __init__(self, config: FlowPolicyConfig, spec: EnvSpec, normalizer: Normalizer):
        super().__init__()
        self.spec, self.normalizer = spec, normalizer
        self.obs_encoder = ObsEncoder(config, spec, normalizer, "flow_transformer")
        self.config = dataclasses.replace(config, image_encoder=self.obs_encoder.image_config)
        self.obs_shapes = self.obs_encoder.low_dim_shapes
        self.act_dim = spec.action.dim
        enc = self.obs_encoder
        self.state_encoder = (
            mlp(enc.low_dim_dim, tuple(config.state_hidden_dims), config.width) if enc.low_dim_dim else None
        )
        self.image_proj = nn.Linear(enc.image_feature_dim, config.width) if enc.num_image_tokens else None
        self.image_position = (
            nn.Parameter(0.02 * torch.randn(enc.num_image_tokens, config.width)) if enc.num_image_tokens else None
        )
        self.expert = ActionExpert(self.act_dim, config.horizon_steps, config)
        self.register_buffer(
            "beta_params", torch.tensor([config.beta_a, config.beta_b]), persistent=False
        )  # a buffer so the Beta sampler follows .to(device)

    # --- the network's two halves ---

    def encode_prefix(self, obs: Obs) -> torch.Tensor:
        """Observation tokens `[B, P, D]`: the state token (an MLP over the normalized, flattened low-dim
        history; absent when the policy reads only images), then one token per camera and history step.
        Computed once per chunk and reused by every Euler step."""
        tokens = []
        low_dim = self.obs_encoder.low_dim(obs)
        if low_dim is not None:
            tokens.append(self.state_encoder(low_dim)[:, None])
        images = self.obs_encoder.image_tokens(obs)
        if images is not None:
            tokens.append(self.image_proj(images) + self.image_position)
        return torch.cat(tokens, dim=1)

    def velocity(self, prefix: torch.Tensor, x: torch.Tensor, tau: torch.Tensor) -> torch.Tensor:
        """v_θ(x, τ, o) `[B, H, A]` for normalized chunks `x` `[B, H, A]` at times `tau` `[B]` (or a float)."""
        tau = torch.as_tensor(tau, dtype=torch.float32, device=x.device).expand(x.shape[0])
        return self.expert(prefix, x, tau)

    # --- BC ---

    def sample_time(self, batch: int, device: torch.device | str) -> torch.Tensor:
        """Training times τ `[batch]` in [0, time_max]: π0's s (1 - b), b ~ Beta(1.5, 1), or s · U(0, 1)."""
        s = self.config.time_max
        if self.config.time_sampling == "uniform":
            return s * torch.rand(batch, device=device)
        b = torch.distributions.Beta(self.beta_params[0], self.beta_params[1]).sample((batch,))
        return s * (1 - b)

    def loss(self, batch: dict[str, Any]) -> tuple[torch.Tensor, dict[str, float]]:
        """Flow-matching MSE E ‖v_θ(x_τ, τ, o) - (a - ε)‖² (π0 Sec. IV, module docstring for the sign).

        `batch`: `{"obs": Obs, "action": [B, H, A]}` in env units.
        """
        check_chunk("batch['action']", batch["action"], self.config.horizon_steps, self.act_dim)
        action = self.normalizer.normalize("action", batch["action"])
        noise = torch.randn_like(action)
        tau = self.sample_time(action.shape[0], action.device)
        v = self.velocity(self.encode_prefix(batch["obs"]), interpolate(action, noise, tau), tau)
        loss = F.mse_loss(v, target_velocity(action, noise))
        return loss, {"bc_loss": loss.item()}

    # --- sampling: the Euler chain ---

    def to_actions(self, x: torch.Tensor) -> torch.Tensor:
        """Final normalized chunk `[B, H, A]` → env units (clipped to ±final_action_clip first)."""
        clip = self.config.final_action_clip
        return self.normalizer.unnormalize("action", x.clamp(-clip, clip))

    def initial_noise(self, batch: int, device: torch.device | str, generator: torch.Generator | None = None):
        """x_0 ~ N(0, I) `[batch, H, A]`."""
        shape = (batch, self.config.horizon_steps, self.act_dim)
        return torch.randn(shape, generator=generator, device=device)

    def _euler(
        self,
        prefix: torch.Tensor,
        x: torch.Tensor,
        std: torch.Tensor | None,
        generator: torch.Generator | None,
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """K steps from x_0 = `x` `[B, H, A]`; `std` `[B, K, H, A]` adds N(0, σ²) noise to step k (None: the
        ODE). Returns the latents x_0, …, x_K and the transition means x_k + v Δτ, each `[B, H, A]`."""
        k_steps = self.config.num_steps
        latents, means = [x], []
        for k, tau in enumerate(euler_times(k_steps, x.device)):
            mean = x + self.velocity(prefix, x, tau) / k_steps
            x = (
                mean
                if std is None
                else mean + std[:, k] * torch.randn(mean.shape, generator=generator, device=mean.device)
            )
            latents.append(x)
            means.append(mean)
        return latents, means

    @torch.no_grad()
    def predict_chunk(
        self, obs: Obs, deterministic: bool = True, *, generator: torch.Generator | None = None
    ) -> torch.Tensor:
        """Actions `[B, H, A]` in env units: the K-step Euler ODE solution from x_0 ~ N(0, I) (seeded by
        `generator`). The prefix is encoded once. Flow sampling has no exploration noise of its own, so
        `deterministic` does not change the result; RL noise enters through `sample_chain`."""
        prefix = self.encode_prefix(obs)
        latents, _ = self._euler(
            prefix, self.initial_noise(prefix.shape[0], prefix.device, generator), None, None
        )
        return self.to_actions(latents[-1])

    @property
    def noise_shape(self) -> tuple[int, int]:
        """Shape `(H, A)` of one chunk's initial noise x_0 (the latent's shape, normalized units)."""
        return (self.config.horizon_steps, self.act_dim)

    @torch.no_grad()
    def decode_noise(self, obs: Obs, noise: torch.Tensor) -> torch.Tensor:
        """Actions `[B, H, A_env]` env units from the given initial noise x_0 `[B, *noise_shape]`: the K-step Euler
        solution of the flow ODE, a deterministic map (DSRL, Wagenmaker et al. 2025, arXiv 2506.15799, steers it)."""
        if tuple(noise.shape[1:]) != self.noise_shape:
            raise ValueError(f"noise: expected [B, {self.noise_shape[0]}, {self.noise_shape[1]}], got {tuple(noise.shape)}")
        latents, _ = self._euler(self.encode_prefix(obs), noise, None, None)
        return self.to_actions(latents[-1])

    def _noise_std(self, noise_std: float | torch.Tensor, batch: int, device: torch.device) -> torch.Tensor:
        """σ as `[B, K, H, A]` from a float, `[K]` (per step), `[B, K]` or `[B, K, H, A]`; must be > 0."""
        k, h, a = self.config.num_steps, self.config.horizon_steps, self.act_dim
        std = torch.as_tensor(noise_std, dtype=torch.float32, device=device)
        if std.ndim == 1 and std.shape[0] == k:
            std = std[None, :, None, None]
        elif std.ndim == 2:
            std = std[:, :, None, None]
        try:
            std = std.expand(batch, k, h, a)
        except RuntimeError:
            raise ValueError(
                f"noise_std: expected a float, [K={k}], [B={batch}, K] or [B, K, {h}, {a}], "
                f"got shape {tuple(torch.as_tensor(noise_std).shape)}"
            ) from None
        message = (
            "noise_std has zero entries: a deterministic Euler step is a point mass with no log-density; "
            "pass noise_std > 0 to score transitions (deterministic=True still samples the ODE path)"
        )
        if not isinstance(noise_std, torch.Tensor):
            if not float(noise_std) > 0:
                raise ValueError(message)
        elif std.device.type == "cpu":
            if not bool((std > 0).all()):
                raise ValueError(message)
        else:  # a learned std on an accelerator: checked there, without a host sync
            torch._assert_async((std > 0).all(), message)
        return std

    @torch.no_grad()
    def sample_chain(
        self,
        obs: Obs,
        noise_std: float | torch.Tensor,
        *,
        deterministic: bool = False,
        generator: torch.Generator | None = None,
    ) -> Chain:
        """Run the K Euler steps as Gaussian transitions x_{k+1} ~ N(x_k + v_θ(x_k, τ_k) Δτ, σ_k²) and record
        all of them (for ReinFlow / Flow-SDE).

        `noise_std` σ: a float, `[K]` per step, `[B, K]` or `[B, K, H, A]`; it must be > 0 because the
        transitions are scored under it. `deterministic=True` follows the ODE (σ = 0 when sampling, as
        diffusion.py's `deterministic`) while still scoring under σ. Latents are normalized and unclipped;
        `actions` is x_K clipped and in env units. The prefix is encoded once.
        """
        prefix = self.encode_prefix(obs)
        batch = prefix.shape[0]
        std = self._noise_std(noise_std, batch, prefix.device)
        x0 = self.initial_noise(batch, prefix.device, generator)
        latents, means = self._euler(prefix, x0, None if deterministic else std, generator)
        logprob = torch.stack(
            [
                gaussian_logprob_elementwise(latents[k + 1], means[k], std[:, k]).sum(dim=(1, 2))
                for k in range(self.config.num_steps)
            ],
            dim=1,
        )
        return Chain(
            latents=torch.stack(latents, dim=1),
            step_indices=torch.arange(self.config.num_steps, device=prefix.device),
            logprob=logprob,
            actions=self.to_actions(latents[-1]),
        )

    def chain_elementwise_logprob(
        self, obs: Obs, latents: torch.Tensor, noise_std: float | torch.Tensor
    ) -> torch.Tensor:
        """Per-entry log N(x_{k+1}; x_k + v_θ(x_k, τ_k) Δτ, σ_k²) `[B, K, H, A]` of chains `latents`
        `[B, K+1, H, A]` (a `Chain.latents` from `sample_chain`), with gradients, in one network call."""
        k, h, a = self.config.num_steps, self.config.horizon_steps, self.act_dim
        if latents.ndim != 4 or tuple(latents.shape[1:]) != (k + 1, h, a):
            raise ValueError(f"chain latents: expected [B, {k + 1}, {h}, {a}], got {tuple(latents.shape)}")
        batch = latents.shape[0]
        std = self._noise_std(noise_std, batch, latents.device)
        prefix = self.encode_prefix(obs).repeat_interleave(k, dim=0)  # row b * K + j, as chain_transitions
        x_k, x_next, index = chain_transitions(latents, torch.arange(k))
        mean = x_k + self.velocity(prefix, x_k, index.float() / k) / k
        return gaussian_logprob_elementwise(x_next, mean, std.flatten(0, 1)).view(batch, k, h, a)

    def chain_logprob(self, obs: Obs, chain: Chain, noise_std: float | torch.Tensor) -> torch.Tensor:
        """Log-densities `[B, K]` of a recorded chain's transitions (the exact sums over H × A)."""
        return self.chain_elementwise_logprob(obs, chain.latents, noise_std).sum(dim=(-1, -2))


@register_policy("flow_transformer", FlowPolicyConfig)
def build_flow_policy(config: FlowPolicyConfig, spec: EnvSpec, normalizer: Normalizer) -> FlowPolicy:
    """The registered factory."""
    return FlowPolicy(config, spec, normalizer)
