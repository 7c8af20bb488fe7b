"""Counting host syncs: the ops that make the host wait for an accelerator, counted under a TorchDispatchMode."""

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
SYNC_OPS = {aten._local_scalar_dense, aten.nonzero, aten.masked_select, aten.is_nonzero, aten.equal,
            aten.unique_consecutive, aten._unique2, aten.unique_dim}
"""Ops whose result size or value the host must wait for on an accelerator (`.item()`, `bool()`, `int()`,
`nonzero`, boolean-mask selection)."""
MASK_INDEXING = {aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_}


class HostSyncCounter(TorchDispatchMode):
    """Counts the synchronising ops dispatched while active (`.item()`, `bool(t)`, `nonzero`, indexing or
    assignment through a boolean mask, `repeat_interleave` with tensor repeats). Host-side reads that torch
    does not dispatch (`.tolist()` of a CPU tensor) are not seen; on CPU they are not syncs anyway."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0
        self.ops: dict[str, int] = {}
        self.paused = False

    def skip(self, optimizer: torch.optim.Optimizer) -> None:
        """Do not count inside `optimizer.step`: Adam's step counters are host tensors on every device (unless
        `capturable`), so its `.item()` reads of them are no device syncs."""
        original = optimizer.step

        def step(*args, **kwargs):
            self.paused = True
            try:
                return original(*args, **kwargs)
            finally:
                self.paused = False

        optimizer.step = step

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.paused:
            return func(*args, **(kwargs or {}))
        packet = func.overloadpacket
        syncs = packet in SYNC_OPS
        if packet in MASK_INDEXING:
            indices = args[1] if len(args) > 1 else ()
            syncs = any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or ())
        if packet is aten.repeat_interleave and isinstance(args[0], torch.Tensor) and args[0].dtype != torch.bool:
            syncs = syncs or (len(args) == 1 or isinstance(args[1], torch.Tensor))
        if syncs:
            self.count += 1
            self.ops[str(packet)] = self.ops.get(str(packet), 0) + 1
        return func(*args, **(kwargs or {}))
