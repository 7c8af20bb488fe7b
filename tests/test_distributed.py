"""Data-parallel training under torchrun (2 CPU processes, gloo) and the single-process defaults.

The torchrun runs go through `tests/torchrun_driver.py`, the robotft CLI plus a record per rank of a hash of
the parameters after every optimizer step and of every checkpoint it saves."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from robotft.checkpoint import read_checkpoint
from robotft.cli import main
from robotft.datasets.sampler import infinite_batches
from robotft.distributed import DistContext, context_from_env
from robotft.rl.ppo import group_relative_advantages
from robotft.runlog import read_metrics

DRIVER = Path(__file__).parent / "torchrun_driver.py"
TORCHRUN = Path(sys.executable).parent / "torchrun"


def torchrun(*args, record: Path, cwd: Path, module: bool = False) -> subprocess.CompletedProcess:
    """`torchrun --nproc_per_node 2` on this machine's loopback: the driver (recording into `record`), or
    `-m robotft.cli` exactly as a user would type it."""
    with socket.socket() as s:  # a free port for the rendezvous, so parallel runs do not collide
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    target = ["-m", "robotft.cli"] if module else [str(DRIVER)]
    argv = [str(TORCHRUN), "--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port", str(port),
            *target, *map(str, args)]
    record.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "ROBOTFT_TEST_RECORD": str(record), "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo",
           "PYTHONUNBUFFERED": "1"}
    env.pop("ROBOTFT_DEBUG", None)
    proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"`{' '.join(argv)}` exited {proc.returncode}\n{proc.stderr[-6000:]}"
    return proc


def records(record: Path) -> tuple[list[str], list[str]]:
    return (record / "rank0.txt").read_text().splitlines(), (record / "rank1.txt").read_text().splitlines()


def assert_ranks_in_step(record: Path, steps: int) -> list[str]:
    """Both ranks took `steps` optimizer steps with identical parameters after each; returns rank 0's lines."""
    rank0, rank1 = records(record)
    steps0 = [line for line in rank0 if line.startswith("step ")]
    steps1 = [line for line in rank1 if line.startswith("step ")]
    assert len(steps0) == steps, rank0
    assert steps0 == steps1, "parameters differ between ranks"
    assert len(set(steps0)) == len(steps0), "the parameters did not change between steps"
    return rank0


@pytest.fixture(scope="module")
def demos(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dist") / "demos.zarr"
    assert main(["data", "generate", "--env", "toy/nav2d", "--episodes", "20", "--out", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def bc(tmp_path_factory, demos) -> Path:
    """A Gaussian BC run of 6 steps on 2 ranks (global batch 32), saved at steps 3 and 6."""
    out = tmp_path_factory.mktemp("dist_bc")
    torchrun("pretrain", "--env", "toy/nav2d", "--policy", "gaussian_mlp", "--data", demos, "--steps", 6,
             "--out", out / "bc", "--train.batch_size", 32, "--train.eval_episodes", 0, "--train.save_every", 3,
             "--train.log_every", 2, "--policy.hidden_dims", "32,32", record=out / "record", cwd=out)
    return out


def test_torchrun_pretrain_keeps_ranks_identical_and_rank0_writes(bc):
    rank0 = assert_ranks_in_step(bc / "record", steps=6)
    _, rank1 = records(bc / "record")
    assert [line for line in rank0 if line.startswith("save")] == ["save 3", "save 6"]
    assert not [line for line in rank1 if line.startswith("save")], "rank 1 wrote a checkpoint"
    assert read_checkpoint(bc / "bc").meta["step"] == 6
    assert [r["step"] for r in read_metrics(bc / "bc")] == [2, 4, 6], "each step must be logged once"


def test_torchrun_pretrain_resumes_with_the_plain_cli(bc, demos):
    """`torchrun -m robotft.cli pretrain --resume` (no driver) continues the 2-rank run from step 6."""
    torchrun("pretrain", "--env", "toy/nav2d", "--policy", "gaussian_mlp", "--data", demos, "--steps", 8,
             "--out", bc / "bc", "--train.batch_size", 32, "--train.eval_episodes", 0, "--train.save_every", 3,
             "--train.log_every", 2, "--policy.hidden_dims", "32,32", "--resume", record=bc / "record_resume",
             cwd=bc, module=True)
    assert read_checkpoint(bc / "bc").meta["step"] == 8
    assert [r["step"] for r in read_metrics(bc / "bc")] == [2, 4, 6, 8]


def test_torchrun_finetune_iteration_keeps_ranks_identical(bc, tmp_path):
    """Two PPO iterations (critic warm-up, then actor and critic) on 2 ranks of 8 envs each, with a KL early
    stop that must fire on both ranks at the same minibatch, and global reward scaling."""
    torchrun("finetune", "--from", bc / "bc", "--algo", "ppo", "--iterations", 2, "--out", tmp_path / "ft",
             "--env.num_envs", 8, "--rl.steps_per_iter", 5, "--rl.update_epochs", 2, "--rl.minibatch_size", 20,
             "--rl.critic_warmup_iters", 1, "--rl.actor_lr", "0.01", "--rl.target_kl", "1e-7",
             "--rl.reward_scale", "true",
             "--eval_episodes", 0, record=tmp_path / "record", cwd=tmp_path)
    rank0, rank1 = records(tmp_path / "record")
    steps0 = [line for line in rank0 if line.startswith("step ")]
    assert steps0 == [line for line in rank1 if line.startswith("step ")], "parameters differ between ranks"
    # Iteration 0: 2 epochs x 2 minibatches of the critic alone (optimizer 0). Iteration 1: actor (optimizer 1)
    # and critic step on the first minibatch; the large actor step trips the KL stop on the second.
    assert [line.split()[1] for line in steps0] == ["0", "0", "0", "0", "0", "1"], steps0
    assert [line for line in rank0 if line.startswith("save")] == ["save 2"]
    assert not [line for line in rank1 if line.startswith("save")], "rank 1 wrote a checkpoint"
    metrics = [r for r in read_metrics(tmp_path / "ft") if "train/env_steps" in r]
    # Both ranks' env steps count: 2 ranks x 8 envs x 5 chunks x 4 steps per chunk per iteration.
    assert [r["train/env_steps"] for r in metrics] == [320, 640]
    ckpt = read_checkpoint(tmp_path / "ft")
    assert ckpt.meta["env_steps"] == 640
    state = ckpt.training_state()["ppo"]["reward_scaler"]
    # The return statistics cover both ranks' envs: 16 returns per chunk, 10 chunks.
    assert float(state["count"]) == pytest.approx(160, abs=0.01)


# -- single process: the same code path, no process group ------------------------------------------------


def test_single_process_context_is_a_no_op_with_exact_statistics(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    ctx = context_from_env()
    assert (ctx.rank, ctx.world_size, ctx.enabled, ctx.is_main) == (0, 1, False, True)
    assert ctx.seed(7) == 7 and ctx.device("cuda") == "cuda"
    x = torch.randn(37)
    mean, std = ctx.mean_std(x)
    assert torch.equal(mean, x.mean()) and torch.equal(std, x.std())
    m, v, n = ctx.moments(x)
    assert torch.equal(v, x.var(unbiased=False)) and n == 37
    assert ctx.sum([1.0, 2.0]) == [1.0, 2.0] and ctx.gather_lists([3.0]) == [3.0]


def test_context_from_env_rejects_bad_ranks(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "2")
    with pytest.raises(ValueError, match="RANK=2 WORLD_SIZE=2"):
        context_from_env()
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    ctx = context_from_env()
    assert ctx.device("cuda") == "cuda:1" and ctx.device("cpu") == "cpu" and ctx.seed(0) != 0


def test_group_advantages_unchanged_without_a_process_group():
    rewards = torch.tensor([[0.0, 1.0], [1.0, 0.0], [0.5, 2.0]])
    dones = torch.tensor([[0.0, 1.0], [1.0, 0.0], [0.0, 1.0]])
    adv = group_relative_advantages(rewards, dones, dist=DistContext())
    group = torch.tensor([1.0, 1.0, 2.0])  # episodes: env 0 [0, 1], env 1 [1], env 1 [0, 2]
    expected_first = (1.0 - group.mean()) / (group.std() + 1e-8)
    assert adv[0, 0] == pytest.approx(float(expected_first))
    assert adv[2, 0] == 0.0  # env 0's second episode is unfinished


def test_sharded_batches_are_disjoint_and_cover_the_dataset():
    """Two ranks' batches of one epoch are disjoint halves of one global batch; together they cover the data."""
    data = torch.utils.data.TensorDataset(torch.arange(40))
    streams = [infinite_batches(data, batch_size=8, seed=3, rank=r, world_size=2) for r in range(2)]
    epoch = [[next(s)[0] for _ in range(5)] for s in streams]  # 5 steps x 4 samples per rank = one epoch
    seen = [torch.cat(e).tolist() for e in epoch]
    assert all(len(b) == 4 for e in epoch for b in e)
    assert not set(seen[0]) & set(seen[1])
    assert sorted(seen[0] + seen[1]) == list(range(40))
    next_epoch = torch.cat([next(streams[0])[0] for _ in range(5)]).tolist()
    assert next_epoch != seen[0] and sorted(next_epoch) != sorted(seen[0]), "each epoch reshuffles the shards"
    with pytest.raises(ValueError, match="multiple of the number of processes"):
        infinite_batches(data, batch_size=7, seed=0, rank=0, world_size=2)


def test_single_process_batches_match_a_seeded_dataloader():
    data = torch.utils.data.TensorDataset(torch.arange(10))
    ours = infinite_batches(data, batch_size=4, seed=5)
    loader = torch.utils.data.DataLoader(data, batch_size=4, shuffle=True, drop_last=True,
                                         generator=torch.Generator().manual_seed(5))
    expected = [b[0] for _ in range(2) for b in loader]
    got = [next(ours)[0] for _ in range(len(expected))]
    assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))


def test_each_rank_takes_its_own_gpu_whatever_cuda_device_is_named():
    rank1 = DistContext(rank=1, world_size=2, local_rank=1)
    assert rank1.device("cuda") == rank1.device("cuda:0") == "cuda:1"
    assert rank1.device("cpu") == "cpu"
    assert DistContext().device("cuda:0") == "cuda:0"  # one process: as asked
