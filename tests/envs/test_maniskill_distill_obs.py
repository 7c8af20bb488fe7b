"""ManiSkill for distillation: obs_mode `rgb+state` gives a camera student's keys and a state teacher's
`privileged/state` from one env, and light/colour randomization changes only the rendering, per seed."""

import dataclasses

import numpy as np
import pytest
import torch

try:
    import mani_skill  # noqa: F401
except ImportError as e:
    pytest.skip(f"mani_skill is not installed ({e})", allow_module_level=True)

from robotft.config import DomainRandomizationConfig, load_env_config
from robotft.envs.maniskill import ManiSkillEnv

pytestmark = pytest.mark.maniskill


def test_privileged_state_is_the_state_mode_vector_and_render_randomization_is_seeded():
    # Camera randomization rebuilds the scene at each reset: the preset's camera size and the render nominals
    # must survive the rebuilds.
    dr = DomainRandomizationConfig(light_scale=(0.3, 1.7), color_jitter=0.3, camera_pos_range=0.01)
    distill = dataclasses.replace(load_env_config("maniskill/push_cube_distill", {"sim_backend": "physx_cpu"}),
                                  randomization=dr)
    state = load_env_config("maniskill/push_cube", {"sim_backend": "physx_cpu"})
    with ManiSkillEnv(distill) as env, ManiSkillEnv(state) as teacher_env:
        spec = env.spec.observations
        assert spec["privileged/state"].names == teacher_env.spec.observations["state"].names
        student_names = spec["state"].names
        assert not any(n.startswith(("extra/obj_pose", "extra/goal_pos")) for n in student_names)
        assert spec["rgb/base_camera"].shape == (64, 64, 3)
        obs, reference = env.reset(seed=3), teacher_env.reset(seed=3)
        action = torch.zeros(1, 7)
        action[0, 0] = 0.5
        for _ in range(3):
            torch.testing.assert_close(obs["privileged/state"], reference["state"])
            torch.testing.assert_close(obs["state"], obs["privileged/state"][:, : len(student_names)])
            obs, *_ = env.step(action)
            reference, *_ = teacher_env.step(action)

        randomizer = env._impl._randomizer
        brightness = {}
        for seed in (0, 1, 0):
            image = env.reset(seed=seed)["rgb/base_camera"].float()
            assert image.shape == (1, 64, 64, 3)
            if seed in brightness:
                assert image.mean().item() == pytest.approx(brightness[seed])  # the same draw for the same seed
            brightness[seed] = image.mean().item()
            for materials in randomizer._materials.values():
                for material, nominal in materials:
                    shift = np.asarray(material.base_color[:3]) - np.clip(nominal[:3], 0, 1)
                    assert np.all(np.abs(shift) <= 0.3 + 1e-6)
            for light, nominal in randomizer._lights:
                factor = np.asarray(light.color) / np.maximum(nominal, 1e-9)
                assert np.all((factor >= 0.3 - 1e-6) & (factor <= 1.7 + 1e-6))
        assert abs(brightness[0] - brightness[1]) > 1.0  # another light and other colours, another image
        assert "cube" in randomizer._materials and randomizer._lights
