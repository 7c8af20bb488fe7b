import dataclasses

import pytest

from robotft.config import (
    ConfigError,
    EnvConfig,
    apply_overrides,
    find_preset,
    from_dict,
    load_env_config,
    parse_override_args,
    to_dict,
)


@dataclasses.dataclass
class Inner:
    lr: float = 1e-3
    dims: tuple[int, ...] = (64, 64)


@dataclasses.dataclass
class Outer:
    name: str = "x"
    steps: int = 10
    flag: bool = False
    inner: Inner = dataclasses.field(default_factory=Inner)
    maybe: float | None = None


def test_from_dict_round_trip_and_types():
    cfg = from_dict(Outer, {"name": "y", "steps": 5, "inner": {"lr": "0.1", "dims": [1, 2]}})
    assert cfg.inner.lr == 0.1 and cfg.inner.dims == (1, 2) and cfg.steps == 5
    assert from_dict(Outer, to_dict(cfg)) == cfg


def test_unknown_key_is_named():
    with pytest.raises(ConfigError, match=r"unknown key\(s\) \['stpes'\]"):
        from_dict(Outer, {"stpes": 3})


def test_overrides_coerce_and_reject():
    cfg = apply_overrides(Outer(), {"inner.lr": "0.01", "flag": "true", "steps": "7", "maybe": "none"})
    assert cfg.inner.lr == 0.01 and cfg.flag is True and cfg.steps == 7 and cfg.maybe is None
    assert apply_overrides(Outer(), {"inner.dims": "8,16"}).inner.dims == (8, 16)
    with pytest.raises(ConfigError, match="expected an integer"):
        apply_overrides(Outer(), {"steps": "seven"})
    with pytest.raises(ConfigError, match="unknown field 'lrr'"):
        apply_overrides(Outer(), {"inner.lrr": "1"})
    with pytest.raises(ConfigError, match="expected an integer"):
        apply_overrides(Outer(), {"steps": "2.5"})


def test_parse_override_args():
    assert parse_override_args(["--rl.clip_eps", "0.02", "--env.num-envs=4"]) == {
        "rl.clip_eps": "0.02",
        "env.num_envs": "4",
    }
    with pytest.raises(ConfigError, match="needs a value"):
        parse_override_args(["--rl.clip_eps"])


def test_env_presets_resolve_and_validate():
    cfg = load_env_config("maniskill/push_cube", {"num_envs": "3"})
    assert cfg.backend == "maniskill" and cfg.task == "PushCube-v1" and cfg.num_envs == 3
    assert cfg.max_episode_steps >= 100
    assert load_env_config("maniskill/stack_cube").max_episode_steps >= 150
    with pytest.raises(ConfigError, match="no envs preset named 'maniskill/nope'.*available"):
        find_preset("envs", "maniskill/nope")
    with pytest.raises(ConfigError, match="num_envs must be >= 1"):
        from_dict(EnvConfig, {"num_envs": 0})
