"""Data-parallel training across processes with torch.distributed, launched by `torchrun`.

`torchrun --nproc_per_node 2 -m robotft.cli pretrain ...` (or `... finetune ...`) runs one process per
rank; each reads RANK / WORLD_SIZE / LOCAL_RANK from the environment, joins a process group (NCCL on CUDA,
gloo on CPU), and trains a full copy of the model on its own data: BC pretraining on its shard of the
dataset, RL fine-tuning on its own envs. After every backward pass the gradients are averaged across
ranks (one flat all-reduce), so every rank takes the same optimizer step and the weights stay identical.
Statistics that steer the update (advantage normalization, the KL early stop, reward scaling) are
reduced across ranks too, so every rank makes the same decisions. Rank 0 alone writes checkpoints,
metrics, TensorBoard and the progress bar.

Without torchrun (WORLD_SIZE unset or 1) `DistContext` is a single-process no-op whose reductions return
exactly what the single-process code computed, so one code path serves both.

The gradients are all-reduced by hand rather than through DistributedDataParallel: DDP only hooks
`forward()`, while the policies train through `policy.loss(batch)` and the PPO core through
`algo.logprob` and the critic, and PPO's KL early stop must be able to skip a backward pass on every
rank at once. The cost is that communication does not overlap the backward pass; for the MLP and
UNet sizes here one flat all-reduce per step is small.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

RANK_SEED_STRIDE = 1_000_003
"""Seed offset between ranks: rank r seeds its envs and sampling streams with `seed + r * stride`, far
enough apart that the per-episode seeds of one rank (seed + iteration and reset counters) do not reach the
next rank's in runs of practical length, and small enough for 4000 ranks to stay below 2**32."""

TIMEOUT = datetime.timedelta(hours=2)
"""How long a collective waits for the other ranks. Rank 0 alone evaluates in simulation while the others
wait at their next collective; torch's 30-minute default is shorter than a long evaluation."""


@dataclass(frozen=True)
class DistContext:
    """This process's place in the job; a single-process no-op when `world_size == 1`."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def enabled(self) -> bool:
        """True when there are other ranks to talk to."""
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        """Rank 0: the one process that writes checkpoints, logs and progress."""
        return self.rank == 0

    def device(self, device: str) -> str:
        """The device this rank trains on: `cuda` (or any `cuda:N`) becomes `cuda:<LOCAL_RANK>`, one GPU per
        process; a fixed `cuda:N` would otherwise put every rank on the same GPU."""
        if self.enabled and torch.device(device).type == "cuda":
            return f"cuda:{self.local_rank}"
        return device

    def seed(self, seed: int) -> int:
        """This rank's seed for envs and sampling; rank 0 keeps `seed`, so one rank equals the plain run."""
        return seed + self.rank * RANK_SEED_STRIDE

    # -- collectives (no-ops with one process) --------------------------------------------------------

    def broadcast_parameters(self, tensors: Iterable[torch.Tensor]) -> None:
        """Overwrite `tensors` (parameters, buffers) with rank 0's values, in place."""
        if not self.enabled:
            return
        for t in _unique(tensors):
            dist.broadcast(t.data, src=0)

    def all_reduce_gradients(self, params: Iterable[nn.Parameter]) -> None:
        """Average `.grad` over ranks in one flat all-reduce.

        A parameter without a gradient on some rank counts as a zero gradient there; one without a
        gradient on every rank keeps `grad=None`, so the optimizer skips it exactly as it would in a
        single process (AdamW would otherwise decay and move it)."""
        if not self.enabled:
            return
        params = [p for p in _unique(params) if p.requires_grad]
        if not params:
            return
        device = params[0].device
        flat = torch.cat([
            (p.grad.detach().reshape(-1) if p.grad is not None else torch.zeros(p.numel(), device=device)).float()
            for p in params
        ])
        has_grad = torch.tensor([float(p.grad is not None) for p in params], device=device)
        packed = torch.cat([flat, has_grad])
        dist.all_reduce(packed)
        grads, present = packed[: flat.numel()] / self.world_size, packed[flat.numel():]
        offset = 0
        for p, seen in zip(params, present.tolist(), strict=True):
            n = p.numel()
            if seen > 0:
                p.grad = grads[offset : offset + n].view_as(p).to(p.dtype)
            offset += n

    def mean(self, value: float) -> float:
        """The mean of a scalar over ranks (a KL estimate, a loss to log)."""
        if not self.enabled:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=self._collective_device())
        dist.all_reduce(t)
        return float(t.item()) / self.world_size

    def sum(self, values: list[float]) -> list[float]:
        """Element-wise sums over ranks of a short list of scalars (step, episode and success counts)."""
        if not self.enabled:
            return values
        t = torch.tensor(values, dtype=torch.float64, device=self._collective_device())
        dist.all_reduce(t)
        return t.tolist()

    def gather_lists(self, values: list[float]) -> list[float]:
        """Every rank's list concatenated in rank order (per-episode returns for logging)."""
        if not self.enabled:
            return values
        out: list[list[float]] = [[] for _ in range(self.world_size)]
        dist.all_gather_object(out, values)
        return [v for part in out for v in part]

    def moments(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
        """`(mean, biased variance, count)` of the elements of `x` on all ranks together.

        With one process this is `x.mean(), x.var(unbiased=False), x.numel()` exactly."""
        if not self.enabled:
            return x.mean(), x.var(unbiased=False), x.numel()
        x64 = x.detach().double().reshape(-1)
        t = torch.stack([x64.new_tensor(float(x64.numel())), x64.sum(), (x64 * x64).sum()])
        t = t.to(self._collective_device())
        dist.all_reduce(t)
        n, s, sq = t.tolist()
        if n == 0:
            return x.new_tensor(float("nan")), x.new_tensor(float("nan")), 0
        mean = s / n
        var = max(sq / n - mean * mean, 0.0)
        return x.new_tensor(mean), x.new_tensor(var), int(n)

    def mean_std(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean and unbiased std of `x` over all ranks (advantage normalization); exactly
        `x.mean(), x.std()` with one process."""
        if not self.enabled:
            return x.mean(), x.std()
        mean, var, n = self.moments(x)
        return mean, (var * n / max(n - 1, 1)).sqrt()

    def _collective_device(self) -> torch.device:
        # NCCL reduces only CUDA tensors; gloo only CPU ones.
        if dist.get_backend() == "nccl":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")


def context_from_env() -> DistContext:
    """The rank, world size and local rank torchrun put in the environment (1 process when unset)."""
    try:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        rank = int(os.environ.get("RANK", "0"))
        local = int(os.environ.get("LOCAL_RANK", str(rank)))
    except ValueError as e:
        raise ValueError(f"RANK / WORLD_SIZE / LOCAL_RANK must be integers ({e}); they are set by torchrun") from e
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"RANK={rank} WORLD_SIZE={world}: expected 0 <= RANK < WORLD_SIZE")
    return DistContext(rank=rank, world_size=world, local_rank=local)


@contextmanager
def distributed(device: str) -> Iterator[DistContext]:
    """Join the torchrun job this process belongs to for the duration of a run.

    `device` is the resolved device (`cpu`, `cuda`): NCCL on CUDA, gloo on CPU. A process group that the
    caller already initialised is used as is and left open; one opened here is destroyed on exit."""
    ctx = context_from_env()
    if not ctx.enabled:
        yield ctx
        return
    if dist.is_initialized():
        if dist.get_world_size() != ctx.world_size or dist.get_rank() != ctx.rank:
            raise RuntimeError(f"an initialised process group (rank {dist.get_rank()} of {dist.get_world_size()}) "
                               f"disagrees with RANK={ctx.rank} WORLD_SIZE={ctx.world_size}")
        yield ctx
        return
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.set_device(ctx.local_rank)
    dist.init_process_group(backend="nccl" if cuda else "gloo", timeout=TIMEOUT)
    try:
        yield ctx
    finally:
        dist.destroy_process_group()


def _unique(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """Each tensor once, in first-seen order (an algorithm's actor parameters overlap the policy's)."""
    seen: set[int] = set()
    out = []
    for t in tensors:
        if id(t) not in seen:
            seen.add(id(t))
            out.append(t)
    return out
