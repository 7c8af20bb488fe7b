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
                for material, nominal, _ in materials:
                    shift = np.asarray(material.base_color[:3]) - np.clip(nominal[:3], 0, 1)
                    assert np.all(np.abs(shift) <= 0.3 + 1e-6)
            for light, nominal in randomizer._lights:
                factor = np.asarray(light.color) / np.maximum(nominal, 1e-9)
                assert np.all((factor >= 0.3 - 1e-6) & (factor <= 1.7 + 1e-6))
        assert abs(brightness[0] - brightness[1]) > 1.0  # another light and other colours, another image
        assert "cube" in randomizer._materials and randomizer._lights


def test_texture_swap_replaces_the_table_and_floor_textures_with_flat_colours_per_seed():
    dr = DomainRandomizationConfig(texture_swap_prob=0.5)
    distill = dataclasses.replace(load_env_config("maniskill/push_cube_distill", {"sim_backend": "physx_cpu"}),
                                  randomization=dr)
    with ManiSkillEnv(distill) as env:
        randomizer = env._impl._randomizer
        swapped, images = {}, {}
        for seed in range(8):
            images[seed] = env.reset(seed=seed)["rgb/base_camera"].float()
            textured = {name: [m for m, _, texture in materials if texture is not None]
                        for name, materials in randomizer._materials.items()
                        if any(texture is not None for _, _, texture in materials)}
            assert set(textured) == {"table-workspace", "ground"}
            for name, parts in textured.items():
                removed = {m.base_color_texture is None for m in parts}
                assert len(removed) == 1  # all textures of one object go, or none
                swapped[seed, name] = removed.pop()
            cube = randomizer._materials["cube"][0]
            np.testing.assert_allclose(cube[0].base_color, cube[1], atol=1e-6)  # untextured objects keep theirs
        assert 0 < sum(swapped.values()) < len(swapped)  # both outcomes occur at probability 0.5
        same_seed = env.reset(seed=0)["rgb/base_camera"].float()
        torch.testing.assert_close(same_seed, images[0])  # the same draw, nominal textures restored or not alike
        plain = [s for s in range(8) if not swapped[s, "table-workspace"]]
        flat_colour = [s for s in range(8) if swapped[s, "table-workspace"]]
        assert (images[plain[0]] - images[flat_colour[0]]).abs().mean() > 5.0
