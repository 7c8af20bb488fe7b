"""Every `--algo` as a run: the TensorBoard scalars issue #4 lists, a resume from the last checkpoint that
continues the counters and the algorithm's own state, and a checkpoint that `robotft eval` loads."""

import json
import time

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from robotft import checkpoint as ckpt_io
from robotft.cli import main
from robotft.config import EnvConfig
from robotft.finetune import FinetuneConfig, run_finetune
from robotft.rl.ppo import PPOConfig
from robotft.runlog import read_metrics

TOY_NAV2D = EnvConfig(type="toy", task="nav2d", num_envs=20, max_episode_steps=40, control_mode="velocity_2d",
                      reward_mode="dense", control_hz=10.0)

ALGOS = {"dppo": "diffusion", "reinflow": "flow", "flow_sde": "flow", "ppo": "gaussian", "residual_ppo": "residual",
         "residual_ppo_step": "gaussian"}
SCALARS = ["train/success_rate", "train/episode_return", "train/approx_kl", "train/clip_fraction",
           "train/explained_variance", "train/noise_std", "train/env_steps_per_s", "train/wall_seconds",
           "eval/success_rate", "eval/success_once", "eval/milestone/halfway", "eval/wall_seconds"]


def _config(source, out, algo: str, iterations: int) -> FinetuneConfig:
    # steps_per_iter × 20 envs = 120 chunks of 40-step episodes: episodes end within every iteration.
    return FinetuneConfig(source=str(source), out=str(out), algo=algo,
                          env=TOY_NAV2D,
                          rl=PPOConfig(iterations=iterations, steps_per_iter=12, minibatch_size=60, update_epochs=1,
                                       critic_warmup_iters=0),
                          eval_every=1, eval_episodes=4, save_every=1, seed=0)


@pytest.mark.parametrize("algo", list(ALGOS))
def test_algorithm_logs_scalars_resumes_and_evaluates(tmp_path, tiny_sources, algo, capsys):
    out = tmp_path / algo
    run_finetune(_config(tiny_sources[ALGOS[algo]], out, algo, iterations=2))
    first = ckpt_io.read_checkpoint(out)
    assert first.meta["step"] == 2

    # TensorBoard orders event files by name: creation second, then a per-process writer counter compared as
    # text ("10" < "9"), so a resume within the same second as the first run could be read back first.
    time.sleep(1.1)
    run_finetune(_config(tiny_sources[ALGOS[algo]], out, algo, iterations=3), resume=True)
    resumed = ckpt_io.read_checkpoint(out)
    assert resumed.meta["step"] == 3 and resumed.meta["env_steps"] == first.meta["env_steps"] * 3 // 2
    assert resumed.meta["wall_seconds"] > first.meta["wall_seconds"], "wall-clock must continue across a resume"
    if algo == "reinflow":  # the learned noise net is algorithm state, restored on resume and trained further
        assert resumed.training_state()["ppo"].keys() == first.training_state()["ppo"].keys()

    events = EventAccumulator(str(out / "tb")).Reload()
    tags = set(events.Tags()["scalars"])
    assert not set(SCALARS) - tags, f"{algo} is missing TensorBoard scalars {sorted(set(SCALARS) - tags)}"
    assert "train/entropy" in tags or algo in ("dppo", "flow_sde")
    # One row per iteration and no duplicate after the resume (metrics logged after the checkpoint are purged).
    steps = [e.step for e in events.Scalars("train/approx_kl")]
    assert steps == sorted(set(steps)) and len(steps) == 3
    noise = [e.value for e in events.Scalars("train/noise_std")]
    assert all(v > 0 for v in noise), f"{algo}: the noise scale must be a positive std, got {noise}"
    walls = [e.value for e in events.Scalars("train/wall_seconds")]
    assert walls == sorted(walls) and walls[0] > 0

    capsys.readouterr()
    assert main(["eval", str(out), "--episodes", "4", "--num-envs", "4", "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["episodes"] == 4 and 0.0 <= result["success_rate"] <= 1.0


def test_best_checkpoint_is_the_one_with_the_highest_evaluation_success(tmp_path, tiny_sources, capsys):
    out = tmp_path / "best"
    cfg = _config(tiny_sources["gaussian"], out, "ppo", iterations=4)
    cfg.eval_episodes = 20
    run_finetune(cfg)
    evals = [r for r in read_metrics(out) if "eval/success_rate" in r]
    rates = [r["eval/success_rate"] for r in evals]
    assert len(rates) == 5  # before fine-tuning and after each of the 4 iterations
    best = ckpt_io.read_checkpoint(out / ckpt_io.BEST_DIR)
    assert best.meta["best_score"] == max(rates)
    first_best = rates.index(max(rates))  # ties keep the earliest checkpoint
    assert best.meta["step"] == first_best
    assert ckpt_io.best_score(out) == max(rates)

    capsys.readouterr()
    assert main(["eval", str(out), "--episodes", "2", "--num-envs", "2"]) == 0
    said = capsys.readouterr().err
    assert "loading the latest checkpoint" in said and str(out / ckpt_io.BEST_DIR) in said


@pytest.mark.parametrize("algo", ["dppo", "dsrl"])
def test_updates_run_on_update_threads_and_rollouts_on_one(tmp_path, tiny_sources, monkeypatch, algo):
    """Simulator workers wait during an update, so it takes `update_threads` torch threads; rollouts, which share
    the cores with the workers, keep the process's one thread, restored after every update."""
    import torch

    from robotft.rl.offpolicy import OffPolicy
    from robotft.rl.ppo import PPO

    seen = {"update": [], "collect": []}
    core = PPO if algo == "dppo" else OffPolicy
    for phase in seen:
        original = getattr(core, phase)

        def spy(self, *args, _original=original, _phase=phase, **kwargs):
            seen[_phase].append(torch.get_num_threads())
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(core, phase, spy)
    source = tiny_sources["diffusion" if algo == "dppo" else "flow"]
    cfg = _config(source, tmp_path / algo, algo, iterations=2)
    cfg.update_threads, cfg.eval_episodes = 3, 0
    if algo == "dsrl":
        cfg.offpolicy.warmup_steps = 0
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        run_finetune(cfg)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(previous)
    assert seen["update"] == [3, 3] and set(seen["collect"]) == {1}, seen
