"""ManiSkill3 physical domain randomization (CPU backend, one in-process PushCube env each)."""

import math

import pytest
import torch

try:
    import mani_skill  # noqa: F401
except ImportError as e:
    pytest.skip(f"mani_skill is not installed ({e})", allow_module_level=True)

from robotft.config import DomainRandomizationConfig, EnvConfig
from robotft.envs.maniskill import ManiSkillEnv
from robotft.envs.maniskill_randomization import ManiSkillRandomizer

pytestmark = pytest.mark.maniskill


def push_cube(**dr) -> EnvConfig:
    return EnvConfig(type="maniskill", task="PushCube-v1", sim_backend="physx_cpu", max_episode_steps=50,
                     randomization=DomainRandomizationConfig(**dr))


@pytest.fixture(scope="module")
def plain():
    with ManiSkillEnv(push_cube()) as env:
        yield env


def cube_state(env: ManiSkillEnv) -> tuple[float, float, float, torch.Tensor]:
    """(mass, static friction, dynamic friction, raw pose [7]) of PushCube's cube as PhysX holds them."""
    body = env._impl._env.obj._bodies[0]
    material = body.collision_shapes[0].physical_material
    return body.mass, material.static_friction, material.dynamic_friction, env._impl._env.obj.pose.raw_pose[0]


def yaw(q: torch.Tensor) -> float:
    w, x, y, z = q.tolist()
    return math.atan2(2 * (w * z + x * y), 1 - 2 * (y * y + z * z))


def test_mass_friction_and_pose_are_drawn_within_range_at_each_reset(plain):
    with ManiSkillEnv(push_cube(friction_scale=(0.5, 1.5), mass_scale=(0.5, 2.0), object_pos_range=0.05,
                                object_yaw_range=0.5)) as env:
        raw = env._impl._env
        table = raw.scene.actors["table-workspace"]._bodies[0].collision_shapes[0].physical_material
        seen = []
        for seed in range(4):
            env.reset(seed=seed)
            mass, static, dynamic, pose = cube_state(env)
            plain.reset(seed=seed)
            nominal_mass, nominal_static, nominal_dynamic, nominal_pose = cube_state(plain)
            assert 0.5 * nominal_mass - 1e-6 <= mass <= 2.0 * nominal_mass + 1e-6
            assert 0.5 * nominal_static - 1e-6 <= static <= 1.5 * nominal_static + 1e-6
            assert dynamic / nominal_dynamic == pytest.approx(static / nominal_static, rel=1e-5)
            # The offset is on top of the task's own placement with the same seed.
            assert (pose[:2] - nominal_pose[:2]).abs().max() <= 0.05 + 1e-5 and pose[2] == nominal_pose[2]
            assert abs(yaw(pose[3:]) - yaw(nominal_pose[3:])) <= 0.5 + 1e-5
            seen.append((mass, static, pose[0].item()))
            assert table.static_friction == pytest.approx(0.3)  # the table keeps the shared material
        assert all(len({s[j] for s in seen}) == 4 for j in range(3))  # every reset draws anew
        env.reset(seed=2)
        assert cube_state(env)[:2] == seen[2][:2]  # and the same seed draws the same values


def test_friction_randomization_changes_how_far_a_pushed_cube_slides(plain):
    def slide(env: ManiSkillEnv) -> float:
        env.reset(seed=0)
        cube = env._impl._env.obj
        start = cube.pose.p[0, 0].item()
        cube.set_linear_velocity(torch.tensor([[1.0, 0.0, 0.0]]))
        for _ in range(6):
            env.step(torch.zeros(1, 7))
        return cube.pose.p[0, 0].item() - start

    nominal = slide(plain)
    with ManiSkillEnv(push_cube(friction_scale=(4.0, 4.0))) as sticky:
        assert slide(sticky) < 0.6 * nominal


def test_camera_pose_and_fov_are_redrawn_at_each_reset():
    with ManiSkillEnv(push_cube(camera_pos_range=0.1, camera_fov_range=(-10.0, 10.0))) as env:
        raw = env._impl._env
        nominal_pos = torch.tensor([0.3, 0.0, 0.6])  # PushCube's base_camera
        fovs, positions = [], []
        for seed in (0, 1):
            env.reset(seed=seed)
            params = raw._sensors["base_camera"].get_params()
            pos = params["cam2world_gl"][0, :3, 3]
            fy = params["intrinsic_cv"][0, 1, 1].item()  # fy = (H / 2) / tan(fovy / 2)
            fov = math.degrees(2 * math.atan(64 / fy))
            assert (pos - nominal_pos).abs().max() <= 0.1 + 1e-4 and abs(fov - 90.0) <= 10.0 + 1e-3
            fovs.append(fov)
            positions.append(pos)
        assert fovs[0] != pytest.approx(fovs[1]) and not torch.allclose(positions[0], positions[1])


def test_gpu_backend_refuses_what_maniskill_fixes_at_gpu_initialization():
    with pytest.raises(ValueError, match="physx_cpu"):
        ManiSkillRandomizer(None, DomainRandomizationConfig(mass_scale=(0.5, 2.0)), "physx_cuda")
