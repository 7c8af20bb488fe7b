"""`torchrun ... tests/torchrun_driver.py pretrain|finetune ...`: the robotft CLI, recording for the tests.

Each rank appends to `$ROBOTFT_TEST_RECORD/rank<RANK>.txt` one line `step <optimizer> <sha256>` after every
optimizer step (a hash of the parameters that optimizer updates, through torch's global post-step hook) and
one line `save <step>` for every checkpoint it writes. The test then compares the ranks' files: identical
parameter hashes step by step, and saves on rank 0 only.
"""

import hashlib
import os
import sys
from pathlib import Path

from torch.optim.optimizer import register_optimizer_step_post_hook

from robotft import checkpoint
from robotft.cli import main

record = open(Path(os.environ["ROBOTFT_TEST_RECORD"]) / f"rank{os.environ['RANK']}.txt", "a")  # noqa: SIM115
optimizer_names: dict[int, int] = {}


def after_step(optimizer, args, kwargs) -> None:
    digest = hashlib.sha256()
    for group in optimizer.param_groups:
        for p in group["params"]:
            digest.update(p.detach().cpu().contiguous().numpy().tobytes())
    name = optimizer_names.setdefault(id(optimizer), len(optimizer_names))
    record.write(f"step {name} {digest.hexdigest()}\n")
    record.flush()


save_run_checkpoint = checkpoint.save_run_checkpoint


def save_and_record(run_dir, step, **kwargs):
    record.write(f"save {step}\n")
    record.flush()
    return save_run_checkpoint(run_dir, step, **kwargs)


register_optimizer_step_post_hook(after_step)
checkpoint.save_run_checkpoint = save_and_record
sys.exit(main(sys.argv[1:]))
