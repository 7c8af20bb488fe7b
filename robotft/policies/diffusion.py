"""Diffusion policy: an MLP or 1-D UNet noise predictor over action chunks, DDPM/DDIM sampling, DPPO's chain.

BC pretraining is the ε-prediction objective of Ho et al. 2020 (arXiv 2006.11239, eq. 14). Sampling
runs the reverse chain as Gaussian transitions (robotft.policies.denoising_chain); for RL the same
transitions are scored, and the last `ft_denoising_steps` of them are fine-tuned with a trainable
copy of the network, as in DPPO (Ren et al. 2024, arXiv 2409.00588, Sec. 4).

Example:
    config = DiffusionPolicyConfig(obs_steps=1, horizon_steps=8, act_steps=4)
    policy = build_policy(config, spec, normalizer)
    loss, metrics = policy.loss({"obs": {"state": s}, "action": a})  # s [B, 1, D], a [B, 8, A]
    actions = policy.predict_chunk({"state": s})                       # [B, 8, A], env units
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from diffusers import DDPMScheduler
from torch import nn

from robotft.datasets.normalizer import Normalizer
from robotft.policies.base import Obs, Policy, PolicyConfig, register_policy
from robotft.policies.denoising_chain import (
    Chain,
    chain_transitions,
    gaussian_logprob_elementwise,
)
from robotft.policies.encoders import ObsEncoder, check_chunk, sinusoidal_embedding
from robotft.policies.unet import NoiseUNet1D, check_unet_horizon
from robotft.specs import EnvSpec

SAMPLERS = ("ddpm", "ddim")
BACKBONES = ("mlp", "unet")
DETERMINISTIC_SAMPLERS = ("ddim_eta0", "posterior_mean", "model_std")


@dataclasses.dataclass
class DiffusionPolicyConfig(PolicyConfig):
    """Diffusion policy with a residual-MLP (default, DPPO's MLP diffusion) or 1-D UNet noise predictor."""

    type: str = "diffusion_mlp"
    """Registered policy name."""
    backbone: str = "mlp"
    """Noise predictor: `mlp` (residual MLP, `hidden_dims`) or `unet` (conditional 1-D UNet over the
    horizon with FiLM conditioning, Chi et al. 2023; `unet_*` fields; robotft.policies.unet)."""
    hidden_dims: tuple[int, ...] = (512, 512, 512)
    """Widths of the residual MLP's hidden layers (consecutive equal widths get a skip connection)."""
    time_embed_dim: int = 16
    """Size of the sinusoidal embedding of the diffusion timestep."""
    num_train_timesteps: int = 20
    """Diffusion timesteps T of the forward process (DPPO uses 20 to 100)."""
    beta_schedule: str = "squaredcos_cap_v2"
    """diffusers beta schedule; `squaredcos_cap_v2` is the cosine schedule of Nichol & Dhariwal 2021."""
    prediction_type: str = "epsilon"
    """What the network predicts; only `epsilon` (the noise) is implemented."""
    sampler: str = "ddpm"
    """`ddpm`: all T ancestral steps (Ho et al. 2020); `ddim`: `ddim_steps` steps (Song et al. 2021)."""
    ddim_steps: int = 5
    """Number of DDIM steps (timesteps spaced `trailing`, so the first step starts from t = T-1)."""
    ddim_eta: float = 1.0
    """DDIM η of stochastic sampling and of RL transitions (DPPO fine-tunes with η = 1); deterministic
    sampling is set by `deterministic_sampler`."""
    deterministic_sampler: str = "ddim_eta0"
    """What `predict_chunk(deterministic=True)` (evaluation, deployment) runs. `ddim_eta0`: every transition
    is DDIM's with η = 0 over the sampler's timesteps (Song et al. 2021 eq. 12 with σ = 0; for a DDPM policy
    DDIM over all T steps), from x_K = 0, the prior's mean, when no generator is given: the action is a function
    of the observation alone. (On ManiSkill PushCube, 24 episodes each: x_K = 0 83%, random x_K 79%, DDPM's
    own sampler 79%; one fixed random x_K shared by every observation 12-21%. On robosuite PickPlaceCan, x_K = 0
    is far from the typical set of N(0, I) that the network was trained from and halves success: 34% against
    64% with a random x_K and 67% with DDPM's sampler (100 episodes each); that task's recipe therefore
    evaluates with `model_std`.) `posterior_mean`: as `ddim_eta0`, but each DDPM step takes the
    posterior mean μ̃ (Ho et al. 2020 eq. 7) instead (DDIM policies: η = 0). `model_std`: the older,
    not deterministic mode: DDPM steps keep their posterior std σ̃, DDIM takes η = 0, x_K random."""
    denoised_clip: float = 1.0
    """Clip the predicted clean chunk x̂_0 to [-denoised_clip, denoised_clip] at every step (DPPO)."""
    final_action_clip: float = 1.0
    """Clip the normalized final chunk to [-final_action_clip, final_action_clip] before unnormalizing."""
    ema_decay: float = 0.995
    """Decay of the EMA of the network weights during BC; 0 turns EMA off."""
    ema_warmup: bool = True
    """Ramp the EMA decay as min(ema_decay, (1 + n) / (10 + n)) after n updates (diffusers' EMAModel)."""
    ft_denoising_steps: int = 0
    """Number of final denoising transitions fine-tuned by RL (DPPO's K'); 0 = not fine-tuned."""
    unet_down_dims: tuple[int, ...] = (64, 128, 256)
    """UNet backbone: channel widths of its levels; all but the last halve the horizon, so
    `horizon_steps` must be divisible by 2 ** (len(unet_down_dims) - 1) (no padding)."""
    unet_kernel_size: int = 5
    """UNet backbone: temporal Conv1d kernel size (odd, so convolutions keep the length)."""
    unet_n_groups: int = 8
    """UNet backbone: GroupNorm groups; must divide every width in `unet_down_dims`."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.prediction_type != "epsilon":
            raise ValueError(
                f"policy.prediction_type: only 'epsilon' is implemented, got {self.prediction_type!r}"
            )
        if self.sampler not in SAMPLERS:
            raise ValueError(f"policy.sampler must be one of {SAMPLERS}, got {self.sampler!r}")
        if not 1 <= self.ddim_steps <= self.num_train_timesteps:
            raise ValueError(
                f"policy.ddim_steps must be in [1, num_train_timesteps={self.num_train_timesteps}], "
                f"got {self.ddim_steps}"
            )
        if not 0 <= self.ft_denoising_steps <= self.num_denoising_steps:
            raise ValueError(
                f"policy.ft_denoising_steps must be in [0, {self.num_denoising_steps}] (the {self.sampler} "
                f"sampler's steps), got {self.ft_denoising_steps}"
            )
        if self.denoised_clip <= 0 or self.final_action_clip <= 0:
            raise ValueError(
                f"policy.denoised_clip and policy.final_action_clip must be > 0, got "
                f"{self.denoised_clip} and {self.final_action_clip}"
            )
        if not 0 <= self.ema_decay < 1:
            raise ValueError(f"policy.ema_decay must be in [0, 1), got {self.ema_decay}")
        if self.ddim_eta < 0:
            raise ValueError(f"policy.ddim_eta must be >= 0, got {self.ddim_eta}")
        if self.deterministic_sampler not in DETERMINISTIC_SAMPLERS:
            raise ValueError(
                f"policy.deterministic_sampler must be one of {DETERMINISTIC_SAMPLERS}, got "
                f"{self.deterministic_sampler!r}"
            )
        if not self.hidden_dims:
            raise ValueError("policy.hidden_dims must name at least one hidden layer")
        if self.backbone not in BACKBONES:
            raise ValueError(f"policy.backbone must be one of {BACKBONES}, got {self.backbone!r}")
        if self.backbone == "unet":
            if not self.unet_down_dims:
                raise ValueError("policy.unet_down_dims must name at least one level")
            if self.unet_kernel_size < 1 or self.unet_kernel_size % 2 == 0:
                raise ValueError(f"policy.unet_kernel_size must be odd and >= 1, got {self.unet_kernel_size}")
            if self.unet_n_groups < 1 or any(d % self.unet_n_groups for d in self.unet_down_dims):
                raise ValueError(
                    f"policy.unet_n_groups={self.unet_n_groups} must divide every width in "
                    f"unet_down_dims={tuple(self.unet_down_dims)}"
                )
            check_unet_horizon(self.horizon_steps, tuple(self.unet_down_dims))

    @property
    def num_denoising_steps(self) -> int:
        """N, the number of transitions the configured sampler runs."""
        return self.num_train_timesteps if self.sampler == "ddpm" else self.ddim_steps


# --- the sampler's math: pure functions of the schedule, shared by sampling and scoring ------------


def sampler_timesteps(num_train_timesteps: int, sampler: str, ddim_steps: int) -> torch.Tensor:
    """Diffusion timesteps of the sampler's steps, from noisiest to cleanest: `[N]` long.

    DDPM visits every t = T-1, ..., 0. DDIM uses `trailing` spacing t_i = round(T - i T / N) - 1
    (Lin et al. 2024, arXiv 2305.08891, Table 2) so that its first step starts from pure noise.
    """
    if sampler == "ddpm":
        return torch.arange(num_train_timesteps - 1, -1, -1)
    steps = [round(num_train_timesteps - i * num_train_timesteps / ddim_steps) - 1 for i in range(ddim_steps)]
    return torch.tensor(steps, dtype=torch.long)


def predict_x0(
    x_k: torch.Tensor, eps_hat: torch.Tensor, abar_t: torch.Tensor, clip: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Predicted clean sample and the noise consistent with it: `(x̂_0, ε̂)`, both shaped like `x_k`.

    x̂_0 = (x_t - sqrt(1 - ᾱ_t) ε̂) / sqrt(ᾱ_t) (Ho et al. 2020 eq. 4 solved for x_0), clipped to
    [-clip, clip] as DPPO does; ε̂ is then re-derived from the clipped x̂_0 so that DDIM's direction term
    agrees with it (DPPO; diffusers' `use_clipped_model_output`). `abar_t` broadcasts to `x_k`.
    """
    x0 = ((x_k - (1 - abar_t).sqrt() * eps_hat) / abar_t.sqrt()).clamp(-clip, clip)
    eps = (x_k - abar_t.sqrt() * x0) / (1 - abar_t).sqrt()
    return x0, eps


def posterior_std(abar_t: torch.Tensor, abar_prev: torch.Tensor) -> torch.Tensor:
    """σ̃ = sqrt(β̃), β̃ = (1 - ᾱ_prev) / (1 - ᾱ_t) · (1 - ᾱ_t / ᾱ_prev).

    The std of the DDPM posterior q(x_prev | x_t, x_0) (Ho et al. 2020 eq. 7, with the one-step β_t
    written as 1 - ᾱ_t / ᾱ_prev so any subsequence of timesteps works), equal to DDIM's σ at η = 1
    (Song et al. 2021, arXiv 2010.02502, eq. 16). Zero at the last step, where ᾱ_prev = 1.
    """
    return ((1 - abar_prev) / (1 - abar_t) * (1 - abar_t / abar_prev)).clamp(min=0).sqrt()


def ddpm_mean(
    x_k: torch.Tensor, x0: torch.Tensor, abar_t: torch.Tensor, abar_prev: torch.Tensor
) -> torch.Tensor:
    """Mean of the DDPM posterior q(x_prev | x_t, x̂_0) (Ho et al. 2020 eq. 7):

    μ̃ = sqrt(ᾱ_prev) β_t / (1 - ᾱ_t) · x̂_0 + sqrt(α_t) (1 - ᾱ_prev) / (1 - ᾱ_t) · x_t,
    with α_t = ᾱ_t / ᾱ_prev and β_t = 1 - α_t.
    """
    alpha_t = abar_t / abar_prev
    return (abar_prev.sqrt() * (1 - alpha_t) * x0 + alpha_t.sqrt() * (1 - abar_prev) * x_k) / (1 - abar_t)


def ddim_mean(
    x0: torch.Tensor, eps: torch.Tensor, abar_prev: torch.Tensor, std: torch.Tensor
) -> torch.Tensor:
    """Mean of the DDIM transition with noise std σ (Song et al. 2021 eq. 12):

    μ = sqrt(ᾱ_prev) x̂_0 + sqrt(1 - ᾱ_prev - σ²) ε̂.

    The direction coefficient is clamped at 0 when an exploration std exceeds sqrt(1 - ᾱ_prev) (late
    steps with a large `min_std`); the transition then is N(sqrt(ᾱ_prev) x̂_0, σ²).
    """
    return abar_prev.sqrt() * x0 + (1 - abar_prev - std**2).clamp(min=0).sqrt() * eps


# --- network ---------------------------------------------------------------------------------------


class NoiseMLP(nn.Module):
    """ε_θ(x_k, k, cond): a residual MLP on [x_k, time embedding, cond] (DPPO's DiffusionMLP)."""

    def __init__(self, sample_dim: int, cond_dim: int, hidden_dims: tuple[int, ...], time_embed_dim: int):
        super().__init__()
        self.time_embed_dim = time_embed_dim
        self.time_mlp = nn.Sequential(
            nn.Linear(time_embed_dim, 2 * time_embed_dim),
            nn.Mish(),
            nn.Linear(2 * time_embed_dim, time_embed_dim),
        )
        self.inp = nn.Linear(sample_dim + time_embed_dim + cond_dim, hidden_dims[0])
        self.hidden = nn.ModuleList(
            nn.Linear(a, b) for a, b in zip(hidden_dims[:-1], hidden_dims[1:], strict=True)
        )
        self.out = nn.Linear(hidden_dims[-1], sample_dim)

    def forward(self, x: torch.Tensor, t: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        """`x` `[B, H*A]`, `t` `[B]` diffusion timesteps, `cond` `[B, F]` → predicted noise `[B, H*A]`."""
        temb = self.time_mlp(sinusoidal_embedding(t, self.time_embed_dim))
        h = self.inp(torch.cat([x, temb, cond], dim=1))
        for layer in self.hidden:
            y = layer(F.mish(h))
            h = h + y if y.shape == h.shape else y  # pre-activation residual where widths allow
        return self.out(F.mish(h))


# --- policy ----------------------------------------------------------------------------------------


class DiffusionPolicy(Policy):
    """Diffusion policy over normalized action chunks `[B, H, A]`, conditioned on the obs history.

    Networks: `obs_encoder` (the shared ObsEncoder: low-dim keys, and a ResNet per camera for image keys)
    and `net` are trained by BC; `ema_obs_encoder` and `ema_net` (when `ema_decay > 0`) are their EMA, which
    is the model that samples and ships during pretraining (diffusion_policy keeps one EMA of encoder and
    noise net alike). `enable_finetuning(k)` loads the EMA weights into `obs_encoder` and `net`, freezes both,
    drops the EMA, and adds `ft_net`, a trainable copy of `net` used for the last k transitions (the
    observation encoder stays frozen while fine-tuning).
    """

    def __init__(self, config: DiffusionPolicyConfig, spec: EnvSpec, normalizer: Normalizer):
        super().__init__()
        self.spec = spec
        self.normalizer = normalizer
        if spec.action is None:
            raise ValueError("diffusion policy: the env spec has no action spec")
        self.obs_encoder = ObsEncoder(config, spec, normalizer, "diffusion_mlp")
        # enable_finetuning edits the config; a copy keeps the caller's intact.
        self.config = dataclasses.replace(config, image_encoder=self.obs_encoder.image_config)
        self.obs_shapes = self.obs_encoder.low_dim_shapes
        self.act_dim = spec.action.dim
        sample_dim = config.horizon_steps * self.act_dim
        cond_dim = self.obs_encoder.out_dim

        self.net: NoiseMLP | NoiseUNet1D
        if config.backbone == "unet":
            self.net = NoiseUNet1D(
                config.horizon_steps,
                self.act_dim,
                cond_dim,
                tuple(config.unet_down_dims),
                config.unet_kernel_size,
                config.unet_n_groups,
                config.time_embed_dim,
            )
        else:
            self.net = NoiseMLP(sample_dim, cond_dim, tuple(config.hidden_dims), config.time_embed_dim)
        self.ema_net: NoiseMLP | NoiseUNet1D | None = None
        self.ema_obs_encoder: ObsEncoder | None = None
        if config.ema_decay > 0:
            self.ema_net = copy.deepcopy(self.net).requires_grad_(False)
            # The memo shares the normalizer instead of copying it: one set of statistics per policy.
            ema_encoder = copy.deepcopy(self.obs_encoder, memo={id(normalizer): normalizer})
            self.ema_obs_encoder = ema_encoder.requires_grad_(False)
            self.register_buffer("ema_updates", torch.zeros((), dtype=torch.long))
        self.ft_net: NoiseMLP | NoiseUNet1D | None = None

        # Training noise comes from diffusers; sampling reads the same alphas_cumprod.
        self.scheduler = DDPMScheduler(
            num_train_timesteps=config.num_train_timesteps,
            beta_schedule=config.beta_schedule,
            prediction_type=config.prediction_type,
            clip_sample=False,
        )
        abar = self.scheduler.alphas_cumprod.float()
        timesteps = sampler_timesteps(config.num_train_timesteps, config.sampler, config.ddim_steps)
        abar_t = abar[timesteps]
        abar_prev = torch.cat([abar_t[1:], torch.ones(1)])  # ᾱ after the last step is 1 (x_0 itself)
        sigma = posterior_std(abar_t, abar_prev)
        if config.sampler == "ddim":
            sigma = config.ddim_eta * sigma
        # Derived from the config, so not saved in checkpoints; buffers so they follow .to(device).
        self.register_buffer("timesteps", timesteps, persistent=False)
        self.register_buffer("abar_t", abar_t, persistent=False)
        self.register_buffer("abar_prev", abar_prev, persistent=False)
        self.register_buffer("sigma", sigma, persistent=False)  # [N] the model's own transition std σ_k
        # The same stds on the host, so that checks on them need no device sync.
        self._sigma_host: list[float] = sigma.tolist()

        if config.ft_denoising_steps > 0:
            self.enable_finetuning(config.ft_denoising_steps)

    # --- conditioning and units ---

    def encode_obs(self, obs: Obs) -> torch.Tensor:
        """The one place an obs dict becomes conditioning for sampling and scoring: `[B, F]`, the normalized,
        flattened low-dim history and the image features, from the EMA encoder while one is kept (it pairs
        with the EMA noise net that samples).

        `obs[key]`: `[B, obs_steps, *feature_shape]` in env units (uint8 pixels for `rgb/` keys).
        """
        encoder = self.ema_obs_encoder if self.ema_obs_encoder is not None else self.obs_encoder
        return encoder(obs)

    def _to_actions(self, x0: torch.Tensor) -> torch.Tensor:
        """Final normalized sample `[B, H*A]` → env-unit chunk `[B, H, A]` (clipped first)."""
        clip = self.config.final_action_clip
        chunk = x0.clamp(-clip, clip).view(-1, self.config.horizon_steps, self.act_dim)
        return self.normalizer.unnormalize("action", chunk)

    # --- BC ---

    def loss(self, batch: dict[str, Any]) -> tuple[torch.Tensor, dict[str, float]]:
        """ε-prediction MSE (Ho et al. 2020 eq. 14) of `net` with k ~ U{0, ..., T-1}.

        `batch`: `{"obs": Obs, "action": [B, H, A]}` in env units.
        """
        cond = self.obs_encoder(batch["obs"])
        check_chunk("batch['action']", batch["action"], self.config.horizon_steps, self.act_dim)
        x0 = self.normalizer.normalize("action", batch["action"]).flatten(1)
        noise = torch.randn_like(x0)
        t = torch.randint(0, self.config.num_train_timesteps, (x0.shape[0],), device=x0.device)
        x_t = self.scheduler.add_noise(x0, noise, t)
        loss = F.mse_loss(self.net(x_t, t, cond), noise)
        return loss, {"bc_loss": loss.item()}

    def train(self, mode: bool = True) -> DiffusionPolicy:
        """Train mode, except that a fine-tuned policy's frozen observation encoder stays in eval mode: its
        image crops must be the same center crops when PPO re-scores a chain as when it was sampled."""
        super().train(mode)
        if self.ft_net is not None:
            self.obs_encoder.eval()
        return self

    def on_train_step_end(self) -> None:
        """EMA update ema ← decay · ema + (1 - decay) · net, with the warm-up of `config.ema_warmup`."""
        if self.ema_net is None:
            return
        n = int(self.ema_updates)
        decay = (
            min(self.config.ema_decay, (1 + n) / (10 + n))
            if self.config.ema_warmup
            else self.config.ema_decay
        )
        with torch.no_grad():
            ema = [*self.ema_net.parameters(), *self.ema_obs_encoder.parameters()]
            live = [*self.net.parameters(), *self.obs_encoder.parameters()]
            # One fused multi-tensor kernel instead of a Python loop over parameters (as torch's swa_utils
            # does for its EMA): the UNet has ~100 tensors.
            torch._foreach_lerp_(ema, live, 1 - decay)
        self.ema_updates += 1

    def export_state_dict(self) -> dict[str, torch.Tensor]:
        """Weights to ship: the EMA weights in place of `net`'s, without EMA bookkeeping."""
        state = self.state_dict()
        if self.ema_net is None:
            return state
        shipped = {k: v for k, v in state.items() if not k.startswith("ema_")}
        shipped.update({f"net.{k}": v for k, v in self.ema_net.state_dict().items()})
        shipped.update({f"obs_encoder.{k}": v for k, v in self.ema_obs_encoder.state_dict().items()})
        return shipped

    def load_state_dict(self, state_dict: dict[str, Any], strict: bool = True, assign: bool = False) -> Any:
        """Load a `state_dict()` (resume) or an `export_state_dict()` (a shipped checkpoint); the latter has
        no EMA entries, so the EMA starts from the weights it ships."""
        if self.ema_net is not None and "ema_updates" not in state_dict:
            state_dict = dict(state_dict)
            net_keys = [k for k in state_dict if k.startswith(("net.", "obs_encoder."))]
            state_dict.update({"ema_" + k: state_dict[k] for k in net_keys})
            state_dict["ema_updates"] = torch.zeros((), dtype=torch.long)
        return super().load_state_dict(state_dict, strict=strict, assign=assign)

    # --- the chain ---

    @property
    def num_denoising_steps(self) -> int:
        """N, the number of transitions of the configured sampler."""
        return self.config.num_denoising_steps

    @property
    def first_recorded_step(self) -> int:
        """Index of the first transition an RL chain records and scores: N - ft_denoising_steps (0 if not
        fine-tuning)."""
        ft = self.config.ft_denoising_steps
        return self.num_denoising_steps - ft if ft > 0 else 0

    def enable_finetuning(self, ft_denoising_steps: int) -> None:
        """Prepare DPPO fine-tuning of the last `ft_denoising_steps` transitions.

        The pretrained model (the EMA weights, if kept) goes into `net`, which is frozen; `ft_net` is a
        trainable copy of it used for the fine-tuned transitions. Recorded in `config.ft_denoising_steps`
        so that a checkpoint rebuilds both networks.
        """
        if self.ft_net is not None:
            raise RuntimeError(
                f"fine-tuning already enabled with ft_denoising_steps={self.config.ft_denoising_steps}"
            )
        if not 1 <= ft_denoising_steps <= self.num_denoising_steps:
            raise ValueError(
                f"ft_denoising_steps must be in [1, {self.num_denoising_steps}] (the {self.config.sampler} "
                f"sampler's steps), got {ft_denoising_steps}"
            )
        if self.ema_net is not None:
            self.net.load_state_dict(self.ema_net.state_dict())
            self.obs_encoder.load_state_dict(self.ema_obs_encoder.state_dict())
            self.ema_net = None
            self.ema_obs_encoder = None
            self.ema_updates = None
        self.net.requires_grad_(False)
        self.obs_encoder.requires_grad_(False).eval()
        self.ft_net = copy.deepcopy(self.net).requires_grad_(True)
        self.config.ft_denoising_steps = ft_denoising_steps

    def _predict_eps(
        self, cond: torch.Tensor, x: torch.Tensor, index: torch.Tensor, net: str
    ) -> torch.Tensor:
        """ε̂ `[B, H*A]` for rows at sampler steps `index` `[B]`. `net`, decided on the host so that no row
        selection syncs with the device: `base` (the pretrained model; the EMA weights while pretraining),
        `ft` (`ft_net`), or `mixed` (each row's own network, both evaluated and selected with `where`)."""
        t = self.timesteps[index]
        base = self.ema_net if self.ema_net is not None else self.net
        if net == "base" or self.ft_net is None:
            return base(x, t, cond)
        if net == "ft":
            return self.ft_net(x, t, cond)
        use_ft = (index >= self.first_recorded_step)[:, None]
        return torch.where(use_ft, self.ft_net(x, t, cond), base(x, t, cond))

    def _net_for(self, steps: list[int] | None, use_base: bool = False) -> str:
        """Which network computes steps `steps` (host ints; None: unknown on the host): see `_predict_eps`."""
        if self.ft_net is None or use_base:
            return "base"
        if steps is None:
            return "mixed"
        first = self.first_recorded_step
        if all(i >= first for i in steps):
            return "ft"
        return "base" if all(i < first for i in steps) else "mixed"

    def _transition_std(self, index: torch.Tensor, min_std: float, deterministic: bool) -> torch.Tensor:
        """Std `[B]` of the transitions at steps `index`.

        Exploration (`deterministic=False`): max(σ_k, min_std), DPPO's min_sampling_denoising_std.
        Deterministic: 0 (every step takes its mean), except with `deterministic_sampler: model_std`, where
        DDPM keeps its posterior σ̃_k.
        """
        if deterministic:
            if self.config.sampler == "ddpm" and self.config.deterministic_sampler == "model_std":
                return self.sigma[index]
            return self.sigma.new_zeros(index.shape)
        return self.sigma[index].clamp(min=min_std)

    def exploration_std(self, min_std: float) -> torch.Tensor:
        """`[K]` exploration stds max(σ_k, min_std) of the recorded (fine-tuned) transitions."""
        index = torch.arange(self.first_recorded_step, self.num_denoising_steps, device=self.sigma.device)
        return self._transition_std(index, min_std, deterministic=False)

    def _gaussian(
        self, x: torch.Tensor, eps_hat: torch.Tensor, index: torch.Tensor, min_std: float, deterministic: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean `[B, H*A]` and std `[B, 1]` of x_prev given x `[B, H*A]` and the network's ε̂ at `index`.

        Exploration transitions and `model_std` use the sampler's own mean (DDPM: μ̃); a deterministic
        `ddim_eta0` step is DDIM's mean with σ = 0 whatever the sampler."""
        abar_t, abar_prev = self.abar_t[index, None], self.abar_prev[index, None]
        x0, eps = predict_x0(x, eps_hat, abar_t, self.config.denoised_clip)
        std = self._transition_std(index, min_std, deterministic)[:, None]
        ddpm = self.config.sampler == "ddpm" and not (
            deterministic and self.config.deterministic_sampler == "ddim_eta0"
        )
        if ddpm:
            return ddpm_mean(x, x0, abar_t, abar_prev), std
        return ddim_mean(x0, eps, abar_prev, std), std

    def _check_scorable(self, steps: list[int] | None, min_std: float, index: torch.Tensor | None = None) -> None:
        """Refuse to score transitions of std 0. Checked on the host (`steps`, or any std when `min_std > 0`);
        only a device-held `index` with `min_std <= 0` needs a device read."""
        if min_std > 0:
            return
        if steps is None:
            steps = sorted({int(i) for i in index.tolist()})
        zero = sorted({i for i in steps if self._sigma_host[i] <= 0})
        if zero:
            raise ValueError(
                f"transitions at steps {zero} have std 0 (a point mass, no log-density) with min_std={min_std}; "
                "pass min_std > 0 to score them"
            )

    def _denoise(
        self,
        cond: torch.Tensor,
        min_std: float,
        deterministic: bool,
        generator: torch.Generator | None,
        score_std: float | None,
        use_base: bool = False,
        x: torch.Tensor | None = None,
    ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Run the whole chain from x_K (`x`, else x_K ~ N(0, I)). Returns the recorded latents (from step
        `first_recorded_step` on, each `[B, H*A]`) and, unless `score_std` is None, their transitions'
        per-entry log-densities `[B, H*A]` under the exploration transitions with std floor `score_std`.

        The step index is a host int: which network runs a step is decided without reading the device, so
        the loop has no host syncs and compiles as one graph."""
        batch, dim = cond.shape[0], self.config.horizon_steps * self.act_dim
        first = self.first_recorded_step
        if x is None:
            x = torch.randn(batch, dim, generator=generator, device=cond.device)
        latents, logprobs = [x] if first == 0 else [], []
        noiseless = deterministic and not (
            self.config.sampler == "ddpm" and self.config.deterministic_sampler == "model_std"
        )
        for i in range(self.num_denoising_steps):
            index = torch.full((batch,), i, dtype=torch.long, device=cond.device)
            eps_hat = self._predict_eps(cond, x, index, self._net_for([i], use_base))
            mean, std = self._gaussian(x, eps_hat, index, min_std, deterministic)
            x_prev = mean if noiseless else mean + std * torch.randn(x.shape, generator=generator, device=x.device)
            if score_std is not None and i >= first:
                # With noise off the sample came from the model's own transition; score it under the
                # exploration transition all the same, so logprobs always mean the same distribution.
                if deterministic or score_std != min_std:
                    mean, std = self._gaussian(x, eps_hat, index, score_std, deterministic=False)
                logprobs.append(gaussian_logprob_elementwise(x_prev, mean, std))
            if i + 1 >= first:
                latents.append(x_prev)
            x = x_prev
        return latents, logprobs

    @torch.no_grad()
    def predict_chunk(
        self, obs: Obs, deterministic: bool = True, *, generator: torch.Generator | None = None
    ) -> torch.Tensor:
        """Actions `[B, H, A]` in env units: with `deterministic`, the chain of `config.deterministic_sampler`
        (default DDIM η = 0 from x_K = 0, unless `generator` draws x_K: a function of the observation alone);
        otherwise the model's stochastic sampler (DDPM, or DDIM with η = ddim_eta).
        """
        cond = self.encode_obs(obs)
        x = None
        if deterministic and generator is None and self.config.deterministic_sampler != "model_std":
            x = cond.new_zeros(cond.shape[0], self.config.horizon_steps * self.act_dim)
        latents, _ = self._denoise(cond, 0.0, deterministic, generator, score_std=None, x=x)
        return self._to_actions(latents[-1])

    @property
    def noise_shape(self) -> tuple[int, int]:
        """Shape `(H, A)` of one chain's initial noise x_K (normalized action units)."""
        return (self.config.horizon_steps, self.act_dim)

    @torch.no_grad()
    def decode_noise(self, obs: Obs, noise: torch.Tensor) -> torch.Tensor:
        """Actions `[B, H, A]` env units from the given initial noise x_K `[B, H, A]`: the deterministic chain that
        evaluation runs (`deterministic_sampler`; by default DDIM with η = 0 over the sampler's steps, whichever
        sampler the policy was trained with), a deterministic map (DSRL, Wagenmaker et al. 2025, arXiv
        2506.15799, steers it). x_K = 0 gives exactly the policy's deterministic evaluation chunk."""
        if self.config.sampler == "ddpm" and self.config.deterministic_sampler == "model_std":
            raise ValueError("decoding a given noise needs a deterministic chain: this policy's deterministic_sampler "
                             "'model_std' draws DDPM noise at every step; fine-tune with "
                             "--policy.deterministic_sampler ddim_eta0")
        check_chunk("noise", noise, self.config.horizon_steps, self.act_dim)
        cond = self.encode_obs(obs)
        x = noise.reshape(noise.shape[0], -1)
        for i in range(self.num_denoising_steps):
            index = torch.full((x.shape[0],), i, dtype=torch.long, device=x.device)
            x, _ = self._gaussian(x, self._predict_eps(cond, x, index, self._net_for([i])), index, 0.0, deterministic=True)
        return self._to_actions(x)

    @torch.no_grad()
    def sample_chain(
        self,
        obs: Obs,
        *,
        min_std: float = 0.0,
        deterministic: bool = False,
        generator: torch.Generator | None = None,
        use_base: bool = False,
        logprob_min_std: float | None = None,
    ) -> Chain:
        """Run the chain and record its last `ft_denoising_steps` transitions (all if 0), DPPO-style.

        Exploration transitions have std max(σ_k, min_std) (DDIM: η chosen so that its std is this, Song
        et al. eq. 12); `deterministic=True` takes the same path with noise off (`deterministic_sampler`).
        Logprobs are those of the exploration transitions with std floor `logprob_min_std` (default
        `min_std`; an algorithm that scores with another floor gets its log-probabilities from the sampling
        pass, with no second network pass), so that floor must make them non-zero. `use_base=True` runs every
        step with the frozen pretrained network (DPPO's BC regularizer samples the base policy); its logprobs
        are then the base policy's.
        """
        score_std = min_std if logprob_min_std is None else logprob_min_std
        cond = self.encode_obs(obs)
        steps = list(range(self.first_recorded_step, self.num_denoising_steps))
        self._check_scorable(steps, score_std)
        latents, logprobs = self._denoise(
            cond, min_std, deterministic, generator, score_std=score_std, use_base=use_base
        )
        batch = cond.shape[0]
        chunk = (batch, len(latents), self.config.horizon_steps, self.act_dim)
        elementwise = torch.stack(logprobs, dim=1).view(batch, len(steps), *chunk[2:])
        return Chain(
            latents=torch.stack(latents, dim=1).view(chunk),
            step_indices=torch.tensor(steps, dtype=torch.long),
            logprob=elementwise.sum(dim=(-1, -2)),
            actions=self._to_actions(latents[-1]),
            elementwise_logprob=elementwise,
        )

    def transition_logprob(
        self,
        cond: torch.Tensor,
        x_k: torch.Tensor,
        x_prev: torch.Tensor,
        step_index: torch.Tensor | int,
        min_std: float,
    ) -> torch.Tensor:
        """Log-density `[B]` of x_prev `[B, H, A]` given x_k `[B, H, A]` under the exploration transition at
        sampler step `step_index` (an int, or `[B]` with one step per row), with gradients through the
        network of that step. `cond` `[B, F]` from `encode_obs`."""
        return self.transition_elementwise_logprob(cond, x_k, x_prev, step_index, min_std).flatten(1).sum(1)

    def transition_elementwise_logprob(
        self,
        cond: torch.Tensor,
        x_k: torch.Tensor,
        x_prev: torch.Tensor,
        step_index: torch.Tensor | int,
        min_std: float,
    ) -> torch.Tensor:
        """`transition_logprob` before the sum over the chunk: per-entry log-densities `[B, H, A]`."""
        check_chunk("x_k", x_k, self.config.horizon_steps, self.act_dim)
        check_chunk("x_prev", x_prev, self.config.horizon_steps, self.act_dim)
        batch = x_k.shape[0]
        if cond.shape[0] != batch or x_prev.shape[0] != batch:
            raise ValueError(
                f"batch sizes differ: cond {cond.shape[0]}, x_k {batch}, x_prev {x_prev.shape[0]}"
            )
        index = torch.as_tensor(step_index, dtype=torch.long, device=x_k.device).expand(batch)
        return self._transition_elementwise(cond, x_k, x_prev, index, _host_steps(step_index), min_std)

    def _transition_elementwise(
        self,
        cond: torch.Tensor,
        x_k: torch.Tensor,
        x_prev: torch.Tensor,
        index: torch.Tensor,
        steps: list[int] | None,
        min_std: float,
    ) -> torch.Tensor:
        """`transition_elementwise_logprob` with the steps `index` `[B]` also as host ints `steps` (None when
        unknown), which pick the network without reading the device."""
        self._check_scorable(steps, min_std, index)
        x = x_k.flatten(1)
        eps_hat = self._predict_eps(cond, x, index, self._net_for(steps))
        mean, std = self._gaussian(x, eps_hat, index, min_std, deterministic=False)
        return gaussian_logprob_elementwise(x_prev.flatten(1), mean, std).view_as(x_prev)

    def chain_logprob(self, obs: Obs, chain: Chain, min_std: float) -> torch.Tensor:
        """Log-densities `[B, K]` of a recorded chain's transitions, all in one network call."""
        lp = self.chain_elementwise_logprob(obs, chain.latents, min_std, chain.step_indices)
        return lp.sum(dim=(-1, -2))

    def chain_elementwise_logprob(
        self, obs: Obs, latents: torch.Tensor, min_std: float, step_indices: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Per-entry log-densities `[B, K, H, A]` of chains `latents` `[B, K+1, H, A]` (a `Chain.latents`).

        `step_indices` `[K]` defaults to the last K steps, which is what `sample_chain` records. DPPO's
        surrogate clamps and averages these entries; `chain_logprob` sums them (the exact log-density).
        """
        if latents.ndim != 4 or tuple(latents.shape[2:]) != (self.config.horizon_steps, self.act_dim):
            raise ValueError(
                f"chain latents: expected [B, K+1, {self.config.horizon_steps}, {self.act_dim}], "
                f"got {tuple(latents.shape)}"
            )
        k = latents.shape[1] - 1
        if not 1 <= k <= self.num_denoising_steps:
            raise ValueError(
                f"chain latents hold {k} transitions; the sampler has {self.num_denoising_steps}"
            )
        if step_indices is None:
            step_indices = torch.arange(self.num_denoising_steps - k, self.num_denoising_steps)
        cond = self.encode_obs(obs).repeat_interleave(k, dim=0)  # row b * K + j, as chain_transitions
        x_k, x_prev, index = chain_transitions(latents, step_indices)
        check_chunk("x_k", x_k, self.config.horizon_steps, self.act_dim)
        lp = self._transition_elementwise(cond, x_k, x_prev, index, _host_steps(step_indices), min_std)
        return lp.view(latents.shape[0], k, *lp.shape[1:])


def _host_steps(step_index: torch.Tensor | int) -> list[int] | None:
    """The sampler steps of `step_index` as host ints when they are known without reading a device (an int,
    or a CPU tensor); None for a tensor on an accelerator."""
    if isinstance(step_index, int):
        return [step_index]
    if step_index.device.type == "cpu":
        return sorted(set(step_index.tolist()))
    return None


@register_policy("diffusion_mlp", DiffusionPolicyConfig)
def build_diffusion_policy(
    config: DiffusionPolicyConfig, spec: EnvSpec, normalizer: Normalizer
) -> DiffusionPolicy:
    """The registered factory; a config with `ft_denoising_steps > 0` gets `ft_net` before weights load."""
    return DiffusionPolicy(config, spec, normalizer)
