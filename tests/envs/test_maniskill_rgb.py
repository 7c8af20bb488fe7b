"""ManiSkill adapter with camera observations (obs_mode rgb, 64x64): `rgb/<camera>` uint8 next to `state`, in
this process and from worker processes, with the same frames for the same seed."""

import pytest
import torch

try:
    import mani_skill  # noqa: F401
except ImportError as e:
    pytest.skip(f"mani_skill is not installed ({e})", allow_module_level=True)

from robotft.config import load_env_config
from robotft.envs.maniskill import ManiSkillEnv
from robotft.threads import available_cores

pytestmark = pytest.mark.maniskill

CAMERA = "rgb/base_camera"


def rgb_env(num_envs: int) -> ManiSkillEnv:
    return ManiSkillEnv(load_env_config("maniskill/push_cube_rgb", {"sim_backend": "physx_cpu", "num_envs": num_envs}))


def check_obs(obs: dict, batch: int, state_dim: int) -> None:
    assert set(obs) == {"state", CAMERA}
    assert obs[CAMERA].dtype == torch.uint8 and obs[CAMERA].shape == (batch, 64, 64, 3)
    assert obs["state"].dtype == torch.float32 and obs["state"].shape == (batch, state_dim)


def test_rgb_observations_in_process_and_in_workers():
    with rgb_env(1) as single:
        spec = single.spec.observations
        assert spec[CAMERA].shape == (64, 64, 3) and spec[CAMERA].dtype == "uint8" and spec[CAMERA].unit == "rgb8"
        state_dim = spec["state"].shape[0]
        first = single.reset(seed=5)
        check_obs(first, 1, state_dim)
        stepped, *_ = single.step(torch.zeros(1, 7))
        check_obs(stepped, 1, state_dim)
        assert first[CAMERA].float().std() > 0  # a rendered scene, not a blank frame
    with rgb_env(2) as pool:
        assert len(pool.worker_pids) == min(2, available_cores()) and pool.spec.observations[CAMERA] == spec[CAMERA]
        obs = pool.reset(seed=5)  # env i is seeded with 5 + i
        check_obs(obs, 2, state_dim)
        torch.testing.assert_close(obs["state"][:1], first["state"])
        assert (obs[CAMERA][:1].float() - first[CAMERA].float()).abs().mean() < 1.0
        assert not torch.equal(obs[CAMERA][0], obs[CAMERA][1])  # different seeds, different scenes
        stepped, *_ = pool.step(torch.zeros(2, 7))
        check_obs(stepped, 2, state_dim)
