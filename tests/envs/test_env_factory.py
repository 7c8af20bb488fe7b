"""make_env: dispatch on env.type, clear errors for unknown env types and missing simulators."""

import sys

import pytest

from robotft.config import EnvConfig, load_env_config
from robotft.envs.factory import make_env
from robotft.envs.toy import ToyNavEnv


def test_toy_preset_builds_a_toy_env():
    env = make_env(load_env_config("toy/nav2d"))
    assert isinstance(env, ToyNavEnv) and env.num_envs == 64 and env.max_episode_steps == 40


def test_unknown_env_type_lists_the_available_ones():
    with pytest.raises(ValueError, match=r"env.type 'isaac' is unknown; available: \[.*'maniskill', 'mujoco'.*'toy'\]"):
        make_env(EnvConfig(type="isaac"))


def test_missing_mani_skill_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "mani_skill", None)  # makes `import mani_skill` fail
    with pytest.raises(ImportError, match=r"pip install robotft\[maniskill\]"):
        make_env(EnvConfig(type="maniskill", task="PushCube-v1"))
