"""IsaacGym adapter for Furniture-Bench tasks (FurnitureSim; Heo et al. 2023, arXiv 2305.12821).

UNTESTED HERE. Isaac Gym (NVIDIA's Preview 4 release, which needs an NVIDIA GPU, Python <= 3.8 and a manual
download) cannot be installed on the machines this project is tested on. This module is written against
furniture_bench's `FurnitureSim-v0` API (`furniture_bench/envs/furniture_sim_env.py`: `gym.make(
"FurnitureSim-v0", furniture=..., num_envs=..., obs_keys=..., concat_robot_state=True, headless=True)`,
`reset()`, `reset_env(i)`, `refresh()`, `step(action) -> obs, reward [B, 1], done [B, 1], info`) and is
type-checked against `isaacgym-stubs`; the only test run here checks that importing it without Isaac Gym
fails with a message naming what to install.

Install (on a machine with an NVIDIA GPU): Isaac Gym Preview 4 (`pip install -e isaacgym/python`), then
`pip install furniture-bench` (which uses the old `gym` package, not gymnasium).
Isaac Gym must be imported before torch: run robotft through
`python -c "import isaacgym, sys; from robotft.cli import main; sys.exit(main())" eval ...`.

Mapping onto the BatchedEnv contract:
- `state` = FurnitureSim's concatenated `robot_state` (ee pose and velocities, joint positions/velocities,
  gripper width, as `obs_keys` select) followed by `parts_poses` (7 per part, AprilTag frame), float32.
  Camera keys `color_image{1,2,3}` / `depth_image{1,2,3}` become `rgb/{wrist,front,rear}` /
  `depth/{wrist,front,rear}` when `cfg.obs_mode` is `rgb`.
- Action `[B, 8]`: end-effector delta position (m), delta orientation quaternion (x, y, z, w), gripper
  (< 0 opens, > 0 closes): control mode `ee_delta_pose_quat` in the robot base frame at 10 Hz.
- Reward: FurnitureSim's sparse reward (1 for each newly assembled part pair). `terminated` and
  `info["success"]`: every part is assembled. `truncated`: robotft's own counter at `cfg.max_episode_steps`
  (FurnitureSim's `max_env_steps` is set above it, so its own timeout never fires).
- Seeding: FurnitureSim draws initial part poses from numpy's global RNG; `reset(seed)` seeds it with
  `seed + i` before resetting env i.
- Domain randomization: `friction_scale` and `mass_scale` scale each furniture part's nominal shape
  friction and body mass at each reset through `Gym.set_actor_rigid_shape_properties` /
  `set_actor_rigid_body_properties` (as IsaacGymEnvs' domain randomization does).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from robotft.config import DomainRandomizationConfig, EnvConfig
from robotft.envs.base import BatchedEnv, Obs
from robotft.optional import require
from robotft.specs import ActionSpec, EnvSpec, FeatureSpec

if TYPE_CHECKING:
    from isaacgym import gymapi

INSTALL_HINT = (
    "install NVIDIA Isaac Gym Preview 4 (pip install -e isaacgym/python, NVIDIA GPU required) and "
    "furniture-bench (pip install furniture-bench), then import isaacgym before torch"
)
CONTROL_MODE = "ee_delta_pose_quat"
CONTROL_HZ = 10.0
"""FurnitureSim's control rate (furniture_bench.config: robot hz)."""
STATE_OBS = ("robot_state/ee_pos", "robot_state/ee_quat", "robot_state/ee_pos_vel", "robot_state/ee_ori_vel",
             "robot_state/gripper_width", "parts_poses")
"""FurnitureSim observation keys that make up `state` (furniture_bench's DEFAULT_STATE_OBS)."""
CAMERAS = {"1": "wrist", "2": "front", "3": "rear"}
"""FurnitureSim camera index -> robotft camera name."""


@dataclasses.dataclass
class _PartProperties:
    """Nominal physical properties of one furniture part actor (the same in every env)."""

    handle: int
    friction: list[float]
    mass: list[float]


class FurnitureSimEnv(BatchedEnv):
    """`cfg.num_envs` FurnitureSim envs of furniture `cfg.task` (e.g. `one_leg`) on the GPU."""

    def __init__(self, cfg: EnvConfig, device: str | torch.device = "cuda") -> None:
        gym = _import_furniture_sim()
        obs_keys = list(STATE_OBS)
        if cfg.obs_mode == "rgb":
            obs_keys += ["color_image1", "color_image2"]
        elif cfg.obs_mode != "state":
            raise ValueError(f"env.obs_mode {cfg.obs_mode!r}: the isaacgym backend supports state and rgb")
        if cfg.control_mode != CONTROL_MODE:
            raise ValueError(f"env.control_mode {cfg.control_mode!r}: FurnitureSim takes {CONTROL_MODE}")
        self.num_envs = cfg.num_envs
        self.device = torch.device(device)
        self.max_episode_steps = cfg.max_episode_steps
        self.randomization = cfg.randomization
        self._env: Any = gym.make(
            "FurnitureSim-v0",
            furniture=cfg.task,
            num_envs=cfg.num_envs,
            obs_keys=obs_keys,
            concat_robot_state=True,
            headless=True,
            np_step_out=False,
            channel_first=False,
            max_env_steps=cfg.max_episode_steps + 1,
            **cfg.kwargs,
        ).unwrapped
        self._gym: gymapi.Gym = self._env.isaac_gym
        self._parts = self._nominal_part_properties()
        self._elapsed = torch.zeros(self.num_envs, dtype=torch.long, device=self.device)
        first = self._convert(self._env.reset())
        self.spec = EnvSpec(
            observations={k: _feature(k, v) for k, v in first.items()},
            action=ActionSpec(CONTROL_MODE, 8, (-1.0,) * 8, (1.0,) * 8, CONTROL_HZ, "robot_base"),
        )

    def reset(self, seed: int | None = None, env_ids: torch.Tensor | None = None) -> Obs:
        ids = range(self.num_envs) if env_ids is None else [int(i) for i in env_ids]
        for i in ids:
            if seed is not None:
                np.random.seed(seed + i)
            self._randomize(i)
            self._env.reset_env(i)
            self._elapsed[i] = 0
        self._env.refresh()
        return self._convert(self._env._get_observation())

    def step(self, action: torch.Tensor) -> tuple[Obs, torch.Tensor, torch.Tensor, torch.Tensor, dict]:
        if tuple(action.shape) != (self.num_envs, 8):
            raise ValueError(f"FurnitureSim step: action must be [{self.num_envs}, 8], got {list(action.shape)}")
        obs, reward, _, _ = self._env.step(action.to(self._env.device, torch.float32))
        self._elapsed += 1
        success = torch.tensor([f.all_assembled() for f in self._env.furnitures], device=self.device)
        return (
            self._convert(obs),
            reward.view(-1).to(self.device, torch.float32),
            success.clone(),
            self._elapsed >= self.max_episode_steps,
            {"success": success},
        )

    def close(self) -> None:
        self._gym.destroy_sim(self._env.sim)

    def _convert(self, obs: dict[str, torch.Tensor]) -> Obs:
        out = {"state": torch.cat([obs["robot_state"], obs["parts_poses"]], dim=-1).to(self.device, torch.float32)}
        for key, value in obs.items():
            if key.startswith("color_image"):
                out[f"rgb/{CAMERAS[key[-1]]}"] = value.to(self.device, torch.uint8)
            elif key.startswith("depth_image"):
                out[f"depth/{CAMERAS[key[-1]]}"] = value.to(self.device, torch.float32)
        return out

    def _nominal_part_properties(self) -> dict[str, _PartProperties]:
        env0 = self._env.envs[0]
        parts = {}
        for part in self._env.furniture.parts:
            handle = int(self._env.parts_handles[part.name])
            shapes = self._gym.get_actor_rigid_shape_properties(env0, handle)
            bodies = self._gym.get_actor_rigid_body_properties(env0, handle)
            parts[part.name] = _PartProperties(handle, [s.friction for s in shapes], [b.mass for b in bodies])
        return parts

    def _randomize(self, i: int) -> None:
        """Part friction and mass of env `i` = nominal x a factor drawn from numpy's (seeded) global RNG."""
        cfg: DomainRandomizationConfig = self.randomization
        if cfg.friction_scale == (1.0, 1.0) and cfg.mass_scale == (1.0, 1.0):
            return
        env = self._env.envs[i]
        friction, mass = np.random.uniform(*cfg.friction_scale), np.random.uniform(*cfg.mass_scale)
        for part in self._parts.values():
            shapes = self._gym.get_actor_rigid_shape_properties(env, part.handle)
            for shape, nominal in zip(shapes, part.friction, strict=True):
                shape.friction = nominal * friction
            self._gym.set_actor_rigid_shape_properties(env, part.handle, shapes)
            bodies = self._gym.get_actor_rigid_body_properties(env, part.handle)
            for body, nominal in zip(bodies, part.mass, strict=True):
                body.mass = nominal * mass
            self._gym.set_actor_rigid_body_properties(env, part.handle, bodies, True)


def _feature(key: str, value: torch.Tensor) -> FeatureSpec:
    shape, dtype = tuple(value.shape[1:]), str(value.dtype).removeprefix("torch.")
    if key.startswith("rgb/"):
        return FeatureSpec(key, shape, dtype, unit="rgb8", frame="camera")
    if key.startswith("depth/"):
        return FeatureSpec(key, shape, dtype, unit="m", frame="camera")
    return FeatureSpec(key, shape, dtype, unit="mixed", frame="april_tag")


def _import_furniture_sim() -> Any:
    """Import Isaac Gym, then furniture_bench (which registers FurnitureSim-v0 with `gym`)."""
    # isaacgym must precede torch's CUDA use (it registers the gymapi bindings); furniture_bench registers
    # the FurnitureSim envs with `gym`.
    require("isaacgym", None, "the isaacgym env backend", what="Isaac Gym", install=INSTALL_HINT)
    require("furniture_bench", None, "the isaacgym env backend", install=INSTALL_HINT)
    gym = require("gym", None, "the isaacgym env backend", install=INSTALL_HINT)
    return gym
