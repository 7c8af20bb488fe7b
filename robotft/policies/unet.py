"""Conditional 1-D UNet noise predictor over action chunks (Chi et al. 2023, arXiv 2303.04137, Sec. 3.3).

The chunk `[B, H, A]` is treated as an A-channel signal of length H. Temporal Conv1d residual blocks
(Conv1d → GroupNorm → Mish, twice) run down the horizon with stride-2 downsampling, through two middle
blocks, and back up with transposed convolutions and skip connections. Every residual block is
FiLM-conditioned (Perez et al. 2018): a per-channel scale and bias computed from [diffusion-step
embedding, obs conditioning] modulate its first conv block's output, as in diffusion_policy's
`ConditionalUnet1D`.

`NoiseUNet1D` has `NoiseMLP`'s call signature, `net(x [B, H*A], t [B], cond [B, F]) -> eps [B, H*A]`, so
the diffusion policy's EMA, DPPO's `ft_net` copy, sampling and scoring use it unchanged.

Odd horizons are not padded: with L = len(down_dims) levels the horizon is halved L - 1 times, so it
must be divisible by 2 ** (L - 1) (`check_unet_horizon`, called by `DiffusionPolicyConfig`).
"""

from __future__ import annotations

import torch
from torch import nn

from robotft.policies.encoders import sinusoidal_embedding


def check_unet_horizon(horizon_steps: int, down_dims: tuple[int, ...]) -> None:
    """Raise unless `horizon_steps` survives len(down_dims) - 1 halvings exactly."""
    factor = 2 ** (len(down_dims) - 1)
    if horizon_steps % factor:
        raise ValueError(
            f"policy.horizon_steps={horizon_steps} must be divisible by 2**(len(unet_down_dims)-1)={factor} "
            f"for the UNet backbone with unet_down_dims={tuple(down_dims)} (odd lengths are not padded); "
            "change horizon_steps or use fewer levels"
        )


class Conv1dBlock(nn.Sequential):
    """Conv1d (same length) → GroupNorm → Mish: `[B, C_in, L]` → `[B, C_out, L]`."""

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, n_groups: int):
        super().__init__(
            nn.Conv1d(in_channels, out_channels, kernel_size, padding=kernel_size // 2),
            nn.GroupNorm(n_groups, out_channels),
            nn.Mish(),
        )


class FiLMResidualBlock1D(nn.Module):
    """Two conv blocks with FiLM between them and a (1x1-conv where widths differ) residual path.

    FiLM: `cond` `[B, D]` → Mish → Linear → per-channel (scale, bias), out = scale · h + bias.
    """

    def __init__(self, in_channels: int, out_channels: int, cond_dim: int, kernel_size: int, n_groups: int):
        super().__init__()
        self.block1 = Conv1dBlock(in_channels, out_channels, kernel_size, n_groups)
        self.block2 = Conv1dBlock(out_channels, out_channels, kernel_size, n_groups)
        self.film = nn.Sequential(nn.Mish(), nn.Linear(cond_dim, 2 * out_channels))
        self.residual = (
            nn.Conv1d(in_channels, out_channels, 1) if in_channels != out_channels else nn.Identity()
        )

    def forward(self, x: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        """`x` `[B, C_in, L]`, `cond` `[B, D]` → `[B, C_out, L]`."""
        h = self.block1(x)
        scale, bias = self.film(cond)[:, :, None].chunk(2, dim=1)
        h = self.block2(scale * h + bias)
        return h + self.residual(x)


class ConditionalUnet1D(nn.Module):
    """ε_θ on `[B, C, L]` signals with global conditioning `[B, F]` (diffusion_policy's ConditionalUnet1D).

    `down_dims` are the channel widths of the levels; every level but the last halves the length.
    The diffusion step goes through a sinusoidal embedding and an MLP, is concatenated with `cond`, and
    the result conditions every residual block by FiLM.
    """

    def __init__(
        self,
        in_channels: int,
        cond_dim: int,
        down_dims: tuple[int, ...] = (64, 128, 256),
        kernel_size: int = 5,
        n_groups: int = 8,
        time_embed_dim: int = 64,
    ):
        super().__init__()
        self.time_embed_dim = time_embed_dim
        self.time_mlp = nn.Sequential(
            nn.Linear(time_embed_dim, 4 * time_embed_dim),
            nn.Mish(),
            nn.Linear(4 * time_embed_dim, time_embed_dim),
        )
        film_dim = time_embed_dim + cond_dim
        dims = [in_channels, *down_dims]
        pairs = list(zip(dims[:-1], dims[1:], strict=True))

        def block(a: int, b: int) -> FiLMResidualBlock1D:
            return FiLMResidualBlock1D(a, b, film_dim, kernel_size, n_groups)

        self.down = nn.ModuleList()
        for i, (a, b) in enumerate(pairs):
            last = i == len(pairs) - 1
            self.down.append(
                nn.ModuleList([block(a, b), block(b, b), nn.Identity() if last else nn.Conv1d(b, b, 3, 2, 1)])
            )
        self.mid = nn.ModuleList([block(down_dims[-1], down_dims[-1]), block(down_dims[-1], down_dims[-1])])
        self.up = nn.ModuleList()
        for a, b in reversed(pairs[1:]):  # b: the skip's width, a: the level above
            self.up.append(nn.ModuleList([block(2 * b, a), block(a, a), nn.ConvTranspose1d(a, a, 4, 2, 1)]))
        self.final = Conv1dBlock(down_dims[0], down_dims[0], kernel_size, n_groups)
        self.out = nn.Conv1d(down_dims[0], in_channels, 1)

    def forward(self, x: torch.Tensor, t: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        """`x` `[B, C, L]`, `t` `[B]`, `cond` `[B, F]` → `[B, C, L]`."""
        film = torch.cat([self.time_mlp(sinusoidal_embedding(t, self.time_embed_dim)), cond], dim=1)
        h, skips = x, []
        for res1, res2, downsample in self.down:
            h = res2(res1(h, film), film)
            skips.append(h)
            h = downsample(h)
        for res in self.mid:
            h = res(h, film)
        for res1, res2, upsample in self.up:
            h = torch.cat([h, skips.pop()], dim=1)
            h = upsample(res2(res1(h, film), film))
        return self.out(self.final(h))


class NoiseUNet1D(ConditionalUnet1D):
    """`ConditionalUnet1D` with `NoiseMLP`'s interface: flat chunks `[B, H*A]` in and out, reshaped to
    `[B, A, H]` (channels = action dims, length = horizon) inside."""

    def __init__(
        self,
        horizon_steps: int,
        act_dim: int,
        cond_dim: int,
        down_dims: tuple[int, ...] = (64, 128, 256),
        kernel_size: int = 5,
        n_groups: int = 8,
        time_embed_dim: int = 64,
    ):
        check_unet_horizon(horizon_steps, down_dims)
        super().__init__(act_dim, cond_dim, down_dims, kernel_size, n_groups, time_embed_dim)
        self.horizon_steps, self.act_dim = horizon_steps, act_dim

    def forward(self, x: torch.Tensor, t: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        """`x` `[B, H*A]`, `t` `[B]` diffusion timesteps, `cond` `[B, F]` → predicted noise `[B, H*A]`."""
        batch = x.shape[0]
        signal = x.view(batch, self.horizon_steps, self.act_dim).transpose(1, 2)
        return super().forward(signal, t, cond).transpose(1, 2).reshape(batch, -1)
