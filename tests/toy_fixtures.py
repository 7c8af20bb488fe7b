"""Toy-task fixtures shared by the fine-tuning tests of tests/rl and tests/lerobot: scripted nav2d
demonstrations, BC runs on them and fine-tuning runs from a checkpoint.

A conftest registers them for its folder by naming them (`toy_demos = toy_fixtures.toy_demos`); the tests folder
is on sys.path because it holds the root conftest."""

import dataclasses
from pathlib import Path

import pytest

from robotft.cli import main
from robotft.config import EnvConfig
from robotft.finetune import FinetuneConfig, run_finetune
from robotft.rl.ppo import PPOConfig

TOY_NAV2D = EnvConfig(
    type="toy",
    task="nav2d",
    num_envs=100,
    max_episode_steps=40,
    control_mode="velocity_2d",
    reward_mode="dense",
    control_hz=10.0,
)


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
        assert (
            main(
                [
                    "pretrain",
                    "--env",
                    "toy/nav2d",
                    "--policy",
                    str(policy),
                    "--data",
                    str(toy_demos),
                    "--steps",
                    str(steps),
                    "--out",
                    str(out),
                    "--train.eval_episodes",
                    "0",
                    *overrides,
                ]
            )
            == 0
        )
        return out

    return run


@pytest.fixture(scope="session")
def toy_finetune():
    """`toy_finetune(source, out, algo, rl, env_fields=None, **sections)` fine-tunes on 50 nav2d envs → the run
    directory. `rl`: a whole PPOConfig, or a dict of fields set over the algorithm's own defaults (budget sizes
    only, for tests that check the defaults learn); `env_fields`: EnvConfig fields set over TOY_NAV2D's."""

    def run(source: Path, out: Path, algo: str, rl: PPOConfig | dict, env_fields: dict | None = None,
            **sections) -> Path:
        if isinstance(rl, dict):
            rl = dataclasses.replace(FinetuneConfig.for_algorithm(algo).rl, **rl)
        cfg = FinetuneConfig(
            source=str(source),
            out=str(out),
            algo=algo,
            env=dataclasses.replace(TOY_NAV2D, num_envs=50, **(env_fields or {})),
            rl=rl,
            eval_episodes=0,
            save_every=rl.iterations,
            seed=0,
            **sections,
        )
        run_finetune(cfg)
        return out

    return run
