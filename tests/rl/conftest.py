"""Toy-task fixtures shared by the fine-tuning tests: demonstrations, weak BC policies, evaluation.

Each learning test follows one recipe: scripted demos → a deliberately short (weak) BC → fine-tuning with a
CI-sized budget → the success rate must rise beyond the evaluation noise (400 seeded episodes)."""

import dataclasses
from pathlib import Path

import pytest

from robotft.checkpoint import load_policy
from robotft.cli import main
from robotft.config import EnvConfig
from robotft.envs.chunked import ChunkedEnv
from robotft.envs.factory import make_env
from robotft.evaluation import evaluate
from robotft.finetune import FinetuneConfig, run_finetune
from robotft.rl.ppo import PPOConfig

TOY_NAV2D = EnvConfig(type="toy", task="nav2d", num_envs=100, max_episode_steps=40, control_mode="velocity_2d",
                      reward_mode="dense", control_hz=10.0)


@pytest.fixture(scope="session")
def toy_demos(tmp_path_factory) -> Path:
    """100 scripted (bimodal) nav2d demonstrations, made once per test session."""
    out = tmp_path_factory.mktemp("toy") / "demos.zarr"
    assert main(["data", "generate", "--env", "toy/nav2d", "--episodes", "100", "--out", str(out)]) == 0
    return out


@pytest.fixture(scope="session")
def toy_pretrain(toy_demos):
    """`toy_pretrain(out, policy, steps, *overrides)` → the BC run directory."""

    def run(out: Path, policy: str, steps: int, *overrides: str) -> Path:
        assert main(["pretrain", "--env", "toy/nav2d", "--policy", str(policy), "--data", str(toy_demos),
                     "--steps", str(steps), "--out", str(out), "--train.eval_episodes", "0", *overrides]) == 0
        return out

    return run


@pytest.fixture(scope="session")
def weak_gaussian_bc(tmp_path_factory, toy_pretrain) -> Path:
    """A Gaussian MLP after 600 BC steps: about 0.3 success, room to improve."""
    return toy_pretrain(tmp_path_factory.mktemp("gaussian_bc") / "bc", "gaussian_mlp", 600,
                        "--policy.hidden_dims", "64,64", "--train.lr", "3e-3", "--train.batch_size", "128")


@pytest.fixture(scope="session")
def toy_success():
    """`toy_success(run_dir, deterministic=True)` → success rate of the checkpoint over 400 seeded nav2d
    episodes; `deterministic=False` evaluates the policy's own stochastic sampler (what DPPO optimizes)."""

    def run(run_dir: Path, deterministic: bool = True) -> float:
        policy, _ = load_policy(run_dir)
        env = ChunkedEnv(make_env(TOY_NAV2D), policy.config.obs_steps, policy.config.act_steps)
        return evaluate(lambda o: policy.predict_chunk(o, deterministic=deterministic), env, 400,
                        seed=777).success_rate

    return run


@pytest.fixture(scope="session")
def toy_finetune():
    """`toy_finetune(source, out, algo, rl, **sections)` fine-tunes on 50 nav2d envs → the run directory.
    `rl`: a whole PPOConfig, or a dict of fields set over the algorithm's own defaults (budget sizes only, for
    tests that check the defaults learn)."""

    def run(source: Path, out: Path, algo: str, rl: PPOConfig | dict, **sections) -> Path:
        if isinstance(rl, dict):
            rl = dataclasses.replace(FinetuneConfig.for_algorithm(algo).rl, **rl)
        cfg = FinetuneConfig(source=str(source), out=str(out), algo=algo,
                             env=dataclasses.replace(TOY_NAV2D, num_envs=50), rl=rl, eval_episodes=0,
                             save_every=rl.iterations, seed=0, **sections)
        run_finetune(cfg)
        return out

    return run


TINY_SOURCES = {
    "diffusion": ("diffusion_mlp", ["--policy.hidden_dims", "32,32", "--policy.num_train_timesteps", "10"]),
    "ddim": ("diffusion_mlp", ["--policy.hidden_dims", "32,32", "--policy.num_train_timesteps", "10",
                               "--policy.sampler", "ddim", "--policy.ddim_steps", "4"]),
    "flow": ("flow_transformer", ["--policy.width", "32", "--policy.num_layers", "1", "--policy.num_steps", "3",
                                  "--policy.state_hidden_dims", "32"]),
    "gaussian": ("gaussian_mlp", ["--policy.hidden_dims", "32,32"]),
}
"""Policy family → (preset, flags) of the tiny BC sources the fine-tuning mechanics tests start from."""


@pytest.fixture(scope="session")
def tiny_sources(tmp_path_factory, toy_pretrain) -> dict[str, Path]:
    """Tiny BC checkpoints (20 steps) of every family in TINY_SOURCES, and a zero residual over the Gaussian
    one (`residual`): only the mechanics of fine-tuning are checked on them, not learning."""
    root = tmp_path_factory.mktemp("tiny_sources")
    out = {name: toy_pretrain(root / name, preset, 20, *args) for name, (preset, args) in TINY_SOURCES.items()}
    preset = root / "residual.yaml"
    preset.write_text(f"type: residual\nbase_checkpoint: {out['gaussian']}\nobs_steps: 1\nhorizon_steps: 8\n"
                      "act_steps: 4\nhidden_dims: [32, 32]\n")
    out["residual"] = toy_pretrain(root / "residual", preset, 1, "--train.lr", "0")
    return out
