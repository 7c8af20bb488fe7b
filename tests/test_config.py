import dataclasses
import re

import pytest

from robotft.config import (
    ConfigError,
    EnvConfig,
    apply_overrides,
    find_preset,
    from_dict,
    list_presets,
    load_env_config,
    migrate_type_key,
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
    assert cfg.type == "maniskill" and cfg.task == "PushCube-v1" and cfg.num_envs == 3
    assert cfg.max_episode_steps >= 100
    assert load_env_config("maniskill/stack_cube").max_episode_steps >= 150
    with pytest.raises(ConfigError, match="no envs preset named 'maniskill/nope'.*available"):
        find_preset("envs", "maniskill/nope")
    with pytest.raises(ConfigError, match="num_envs must be >= 1"):
        from_dict(EnvConfig, {"num_envs": 0})


# -- files written before `type` was the one discriminator key: env presets and rig devices said `backend:`,
# dataset recipes `source:`. They load unchanged (robotft.config.migrate_type_key, applied by from_dict).


def _old_keys(text: str, old: str) -> str:
    """A preset's text as it was written before the rename: every block-style `type:` key named `old`
    (inline mappings such as `executor: {type: async}` kept `type` all along)."""
    return re.sub(r"^(\s*(?:- )?)type:", rf"\1{old}:", text, flags=re.M)


def test_migrate_type_key_renames_the_old_key_and_refuses_a_conflict():
    assert migrate_type_key({"backend": "toy", "task": "nav2d"}, "backend", "f.yaml") == {
        "type": "toy",
        "task": "nav2d",
    }
    assert migrate_type_key({"type": "toy", "backend": "toy"}, "backend", "f.yaml") == {"type": "toy"}
    assert migrate_type_key({"type": "toy"}, "backend", "f.yaml") == {"type": "toy"}
    with pytest.raises(
        ConfigError, match=r"f.yaml: gives both 'type' \('toy'\) and 'backend' \('maniskill'\)"
    ):
        migrate_type_key({"type": "toy", "backend": "maniskill"}, "backend", "f.yaml")


def _presets_without_base(folder: str) -> list[str]:
    return [n for n in list_presets(folder) if "\nbase:" not in find_preset(folder, n).read_text()]


@pytest.mark.parametrize("name", _presets_without_base("envs"))
def test_an_env_preset_with_the_old_key_loads(tmp_path, name):
    old = tmp_path / "old.yaml"
    old.write_text(_old_keys(find_preset("envs", name).read_text(), "backend"))
    assert "backend:" in old.read_text()
    assert load_env_config(str(old)) == load_env_config(name)


@pytest.mark.parametrize("name", ["franka_d435", "sim_franka"])
def test_a_rig_preset_with_the_old_key_loads(tmp_path, name):
    from robotft.real_robot.rig import load_rig

    text = find_preset("real_robot", name).read_text()
    text += (
        "objects: [cube]\nobject_poses:\n  type: fiducial\n  config: {camera: base, markers: [{object: cube, "
        "id: 0, size_m: 0.03}]}\n"
    )
    (tmp_path / "new.yaml").write_text(text)
    (tmp_path / "old.yaml").write_text(_old_keys(text, "backend"))
    old, new = load_rig(str(tmp_path / "old.yaml")), load_rig(str(tmp_path / "new.yaml"))
    assert old == new and new.object_poses.type == "fiducial" and new.cameras[0].type in ("sim", "realsense")
    # The observation mapping's `source:` (robot, object, camera, constant) is not a discriminator: it stays.
    assert "robot" in {s.source for o in new.observations for s in o.sources}


@pytest.mark.parametrize("name", _presets_without_base("datasets"))
def test_a_dataset_recipe_with_the_old_key_loads(tmp_path, name):
    from robotft.datasets.recipe import load_recipe

    old = tmp_path / "old.yaml"
    old.write_text(_old_keys(find_preset("datasets", name).read_text(), "source"))
    assert "\nsource:" in old.read_text()
    assert load_recipe(str(old))[0] == load_recipe(name)[0]


def test_a_checkpoint_and_a_saved_run_with_the_old_key_load(tmp_path, monkeypatch):
    import json

    import torch
    from tiny_specs import tiny_spec_and_normalizer

    from robotft import checkpoint as ck
    from robotft.cli import build_parser, resolve_finetune, resolve_pretrain
    from robotft.finetune import FinetuneConfig
    from robotft.pretrain import PretrainConfig

    env = EnvConfig(type="toy", task="nav2d", num_envs=3, control_mode="velocity_2d")
    old_env = {"backend": "toy", **{k: v for k, v in to_dict(env).items() if k != "type"}}
    spec, normalizer = tiny_spec_and_normalizer()
    path = ck.write_checkpoint(
        tmp_path / "ckpt",
        model_state={"w": torch.zeros(1)},
        normalizer=normalizer,
        config={"policy": {"type": "x"}, "spec": spec.to_dict(), "env": old_env},
        meta={"stage": "pretrain"},
    )
    assert ck.read_checkpoint(path).env_config() == env

    # `--config` reruns of runs saved with the old key (config.json's `run.env`).
    monkeypatch.chdir(tmp_path)
    (tmp_path / "store.zarr").mkdir()
    policy = {"type": "diffusion_mlp", "hidden_dims": [16, 16]}
    pretrain = {"stage": "pretrain", **to_dict(PretrainConfig(data="store.zarr", env=env)), "env": old_env}
    (tmp_path / "pretrain.json").write_text(json.dumps({"run": pretrain, "policy": policy}))
    cfg, _ = resolve_pretrain(*build_parser().parse_known_args(["pretrain", "--config", "pretrain.json"]))
    assert cfg.env == env
    finetune = {"stage": "finetune", **to_dict(FinetuneConfig(source=str(path), env=env)), "env": old_env}
    (tmp_path / "finetune.json").write_text(json.dumps({"run": finetune}))
    cfg, _ = resolve_finetune(*build_parser().parse_known_args(["finetune", "--config", "finetune.json"]))
    assert cfg.env == env


def test_both_keys_with_different_values_are_refused_naming_the_file_and_both_keys(tmp_path):
    import torch
    from tiny_specs import tiny_spec_and_normalizer

    from robotft import checkpoint as ck
    from robotft.real_robot.rig import load_rig

    env = tmp_path / "env.yaml"
    env.write_text("type: toy\nbackend: toy\ntask: nav2d\n")
    assert load_env_config(str(env)).type == "toy"  # both, saying the same: fine
    env.write_text("type: toy\nbackend: maniskill\n")
    with pytest.raises(
        ConfigError, match=rf"{env}: gives both 'type' \('toy'\) and 'backend' \('maniskill'\)"
    ):
        load_env_config(str(env))
    rig = tmp_path / "rig.yaml"
    rig.write_text("cameras:\n  - {name: base, type: sim, backend: realsense}\n")
    with pytest.raises(ConfigError, match=rf"{rig}.cameras\[0\]: gives both 'type' \('sim'\) and 'backend'"):
        load_rig(str(rig))
    spec, normalizer = tiny_spec_and_normalizer()
    path = ck.write_checkpoint(
        tmp_path / "ckpt",
        model_state={"w": torch.zeros(1)},
        normalizer=normalizer,
        config={
            "policy": {"type": "x"},
            "spec": spec.to_dict(),
            "env": {"type": "toy", "backend": "maniskill"},
        },
        meta={},
    )
    with pytest.raises(
        ConfigError, match=r"ckpt/config.json: env: gives both 'type' \('toy'\) and 'backend'"
    ):
        ck.read_checkpoint(path).env_config()


def test_update_threads_default_to_the_cores_shared_by_the_local_ranks(monkeypatch):
    from robotft.threads import available_cores, update_threads

    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    monkeypatch.delenv("ROBOTFT_UPDATE_THREADS", raising=False)
    assert update_threads(0) == available_cores() and update_threads(5) == 5
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(2 * available_cores()))
    assert update_threads(0) == 1  # never fewer than one thread


def test_update_threads_environment_variable_caps_the_default(monkeypatch):
    """Processes updating side by side (several runs, the parallel test suite) cap the default this way; an
    explicit count still wins, and a value that is not a positive integer is named."""
    from robotft.threads import update_threads

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    monkeypatch.setenv("ROBOTFT_UPDATE_THREADS", "3")
    assert update_threads(0) == 3 and update_threads(5) == 5
    for bad in ("0", "two", "-1"):
        monkeypatch.setenv("ROBOTFT_UPDATE_THREADS", bad)
        with pytest.raises(ValueError, match=f"ROBOTFT_UPDATE_THREADS must be a positive integer, got '{bad}'"):
            update_threads(0)


def test_process_threads_environment_variable_is_validated(monkeypatch, capsys):
    """`ROBOTFT_NUM_THREADS` sets the process's torch threads; a bad value fails the command with one line that
    names the variable, before any work starts."""
    import torch

    from robotft.cli import main
    from robotft.threads import process_threads

    monkeypatch.delenv("ROBOTFT_NUM_THREADS", raising=False)
    assert process_threads() == 1
    monkeypatch.setenv("ROBOTFT_NUM_THREADS", "2")
    assert process_threads() == 2
    previous = torch.get_num_threads()
    try:
        for bad in ("0", "1.5", "all", "²"):
            monkeypatch.setenv("ROBOTFT_NUM_THREADS", bad)
            assert main(["eval", "no-such-checkpoint"]) == 1
            err = capsys.readouterr().err
            assert f"ROBOTFT_NUM_THREADS must be a positive integer, got '{bad}'" in err
            assert "no-such-checkpoint" not in err
    finally:
        torch.set_num_threads(previous)


def test_negative_update_threads_are_refused():
    from robotft.finetune import FinetuneConfig

    with pytest.raises(ValueError, match="update_threads must be >= 0"):
        FinetuneConfig(update_threads=-1)
