"""Toy-task fixtures of the fine-tuning tests: weak BC policies, tiny BC sources and evaluation (the
demonstrations, BC and fine-tuning runners come from tests/toy_fixtures.py, shared with tests/lerobot).

Each learning test follows one recipe: scripted demos → a deliberately short (weak) BC → fine-tuning with a
CI-sized budget → the success rate must rise beyond the evaluation noise (400 seeded episodes)."""

from pathlib import Path

import pytest
import toy_fixtures
from toy_fixtures import TOY_NAV2D

from robotft.checkpoint import load_policy
from robotft.envs.chunked import ChunkedEnv
from robotft.envs.factory import make_env
from robotft.evaluation import evaluate

toy_demos = toy_fixtures.toy_demos
toy_pretrain = toy_fixtures.toy_pretrain
toy_finetune = toy_fixtures.toy_finetune


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
        env = ChunkedEnv.for_policy(make_env(TOY_NAV2D), policy.config)
        return evaluate(lambda o: policy.predict_chunk(o, deterministic=deterministic), env, 400,
                        seed=777).success_rate

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
