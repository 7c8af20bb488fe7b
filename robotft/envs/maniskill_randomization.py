"""Physical domain randomization for ManiSkill3 (3.0.1) tasks, applied at every reset.

What ManiSkill 3.0.1 allows, and how each `DomainRandomizationConfig` field is applied:

- `object_pos_range`, `object_yaw_range`: the task's movable objects (actors whose PhysX body is
  `dynamic`: PushCube's cube, PickCube's cube, ...; not the robot, the table or kinematic goal markers)
  are shifted in x/y and rotated about z after the task's own `_initialize_episode` has placed them, by
  wrapping that method (ManiSkill's customization point for initial states). The draws use torch's RNG,
  which ManiSkill seeds from the episode seed there, so seeded resets stay reproducible. CPU and GPU.
- `friction_scale`, `mass_scale`: the same objects get their nominal mass and static/dynamic friction
  times a fresh factor (each collision shape gets its own PhysX material, so the table and the robot,
  which share the default material, keep theirs). CPU backend only: ManiSkill fixes masses and materials
  at GPU initialisation (`Actor.mass` is `@before_gpu_init`), so on `physx_cuda` they are refused.
- `camera_pos_range`, `camera_fov_range`: the sensor cameras' configs (pose, vertical field of view) are
  redrawn from their nominal values before a reset, and that reset rebuilds the scene
  (`options["reconfigure"]`), because ManiSkill reads camera configs only when it builds a scene. That
  rebuild makes each reset slower; CPU backend only (a GPU partial reset cannot reconfigure).
- `light_scale`: after the task's initialization, the ambient light and every light of the scene (ManiSkill
  builds them in each task's `_load_lighting`) get their nominal colour times a fresh factor. CPU backend only.
- `color_jitter`: likewise, every actor's render materials (cube, goal marker, table, ground) get their nominal
  base colour plus one uniform RGB offset per actor, clipped to [0, 1]. CPU backend only.
- `texture_swap_prob`: each actor drawn with an image texture (the table's wood, the floor's tiles) has, with
  this probability per reset, its textures removed and its base colour set to a uniform random RGB (Tobin et
  al. 2017's random textures, as flat colours); otherwise its nominal textures come back, so a camera policy
  cannot rely on the table's or floor's look. CPU backend only.
Lights and colours are render state: they change the camera images, not the physics, and need no rebuild.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import numpy as np
import torch

from robotft.config import DomainRandomizationConfig

_CPU_ONLY = ("friction_scale", "mass_scale", "camera_pos_range", "camera_fov_range", "light_scale", "color_jitter",
             "texture_swap_prob")
_CAMERA_STREAM = 0xCA3


class ManiSkillRandomizer:
    """Installs `cfg`'s physical randomization on a raw ManiSkill env (`gym.make(...).unwrapped`)."""

    def __init__(self, env: Any, cfg: DomainRandomizationConfig, sim_backend: str) -> None:
        active = cfg.active_physical()
        on_gpu = sorted(set(active) & set(_CPU_ONLY))
        if sim_backend != "physx_cpu" and on_gpu:
            raise ValueError(
                f"env.randomization {on_gpu} need env.sim_backend physx_cpu: ManiSkill 3.0.1 fixes masses, "
                "materials and cameras when the GPU simulation starts"
            )
        self.env, self.cfg = env, cfg
        self.cameras = cfg.camera_pos_range > 0 or cfg.camera_fov_range != (0.0, 0.0)
        # Nominal values by actor name (names survive the scene rebuilds that camera randomization causes).
        self._nominal: dict[str, tuple[float, list[tuple[float, float, float]]]] = {}
        self._camera_nominal = {uid: (c.pose.raw_pose[0].cpu().numpy().copy(), float(c.fov))
                                for uid, c in env._sensor_configs.items() if getattr(c, "fov", None) is not None}
        self._camera_rng = np.random.default_rng(_CAMERA_STREAM)
        # The env's own camera overrides (the preset's `sensor_configs`: size, pose), kept under each draw.
        self._custom_cameras = copy.deepcopy(env._custom_sensor_configs or {})
        # Nominal light and material colours of the current scene (a camera rebuild makes a new scene).
        self._render_scene: Any = None
        self._lights: list[tuple[Any, np.ndarray]] = []
        self._ambient: list[tuple[Any, np.ndarray]] = []
        self._materials: dict[str, list[tuple[Any, np.ndarray, Any]]] = {}
        """Per actor name: (material, nominal base colour, nominal base-colour texture or None)."""
        task_initialize = env._initialize_episode

        def initialize_episode(env_idx: torch.Tensor, options: dict) -> None:
            task_initialize(env_idx, options)
            self._after_task_initialization(env_idx)

        # An instance attribute shadows the task's method; ManiSkill's reset calls self._initialize_episode.
        env._initialize_episode = initialize_episode

    def reset_options(self, seed: int | None) -> dict[str, Any]:
        """Options for the coming `env.reset`: with camera randomization, new camera configs and a rebuild."""
        if not self.cameras:
            return {}
        if seed is not None:
            self._camera_rng = np.random.default_rng([seed, _CAMERA_STREAM])
        r, (lo, hi) = self.cfg.camera_pos_range, self.cfg.camera_fov_range
        configs = copy.deepcopy(self._custom_cameras)
        for uid, (raw_pose, fov) in self._camera_nominal.items():
            pose = raw_pose.copy()
            pose[:3] += self._camera_rng.uniform(-r, r, size=3)
            fov_deg = math.degrees(fov) + self._camera_rng.uniform(lo, hi)
            configs[uid] = {**configs.get(uid, {}), "pose": pose.tolist(), "fov": math.radians(fov_deg)}
        self.env._custom_sensor_configs = configs
        return {"reconfigure": True}

    def movable_objects(self) -> dict[str, Any]:
        """The task's dynamic actors by name (rebuilt scenes have new ones)."""
        return {name: a for name, a in self.env.scene.actors.items() if a.px_body_type == "dynamic"}

    def _after_task_initialization(self, env_idx: torch.Tensor) -> None:
        cfg = self.cfg
        for name, actor in self.movable_objects().items():
            if cfg.object_pos_range > 0 or cfg.object_yaw_range > 0:
                self._perturb_pose(actor)
            if cfg.friction_scale != (1.0, 1.0) or cfg.mass_scale != (1.0, 1.0):
                self._scale_physics(name, actor)
        if cfg.light_scale != (1.0, 1.0) or cfg.color_jitter > 0 or cfg.texture_swap_prob > 0:
            self._randomize_render()

    def _randomize_render(self) -> None:
        """Scale the lights, jitter the object colours and swap textures for flat colours, from their nominal
        values (drawn with torch's RNG, which ManiSkill seeds per episode)."""
        if self._render_scene is not self.env.scene:
            self._record_render_nominals()
        lo, hi = self.cfg.light_scale
        factor = float(torch.empty(1).uniform_(lo, hi))
        for system, ambient in self._ambient:
            system.ambient_light = (ambient * factor).tolist()
        for light, color in self._lights:
            light.color = (color * factor).tolist()
        c, swap_prob = self.cfg.color_jitter, self.cfg.texture_swap_prob
        for materials in self._materials.values():
            offset = (torch.rand(3).numpy() * 2 - 1) * c
            textured = any(texture is not None for _, _, texture in materials)
            # No draw for untextured actors or a zero probability: the defaults leave the RNG stream as it was.
            flat = torch.rand(3).numpy() if textured and swap_prob > 0 and float(torch.rand(1)) < swap_prob else None
            for material, color, texture in materials:
                if texture is not None:
                    material.base_color_texture = None if flat is not None else texture
                rgb = flat if flat is not None and texture is not None else np.clip(color[:3] + offset, 0.0, 1.0)
                material.base_color = [*rgb.tolist(), float(color[3])]

    def _record_render_nominals(self) -> None:
        import sapien

        scene = self.env.scene
        self._render_scene = scene
        self._ambient = [(sub.render_system, np.asarray(sub.render_system.ambient_light, dtype=float))
                         for sub in scene.sub_scenes]
        self._lights = [(light, np.asarray(light.color, dtype=float))
                        for sub in scene.sub_scenes for entity in sub.entities
                        for light in entity.components if isinstance(light, sapien.render.RenderLightComponent)]
        self._materials = {}
        for name, actor in scene.actors.items():
            materials = []
            for entity in actor._objs:
                body = entity.find_component_by_type(sapien.render.RenderBodyComponent)
                for shape in [] if body is None else body.render_shapes:
                    parts = shape.parts if hasattr(shape, "parts") else [shape]
                    materials += [(p.material, np.asarray(p.material.base_color, dtype=float),
                                   p.material.base_color_texture) for p in parts]
            if materials:
                self._materials[name] = materials

    def _perturb_pose(self, actor: Any) -> None:
        from mani_skill.utils.structs.pose import Pose

        # Only the envs being reset: on the GPU, set_pose expects exactly their rows (scene._reset_mask).
        raw = actor.pose.raw_pose[self.env.scene._reset_mask[actor._scene_idxs]].clone()
        n, dev = raw.shape[0], raw.device
        r, yaw_r = self.cfg.object_pos_range, self.cfg.object_yaw_range
        raw[:, :2] += (torch.rand(n, 2, device=dev) * 2 - 1) * r
        yaw = (torch.rand(n, device=dev) * 2 - 1) * yaw_r
        rot = torch.stack([torch.cos(yaw / 2), torch.zeros_like(yaw), torch.zeros_like(yaw), torch.sin(yaw / 2)], -1)
        raw[:, 3:] = _quat_mul(rot, raw[:, 3:])
        actor.set_pose(Pose.create_from_pq(raw[:, :3], raw[:, 3:]))

    def _scale_physics(self, name: str, actor: Any) -> None:
        import sapien

        friction, mass = (float(torch.empty(1).uniform_(lo, hi)) for lo, hi in (self.cfg.friction_scale,
                                                                                 self.cfg.mass_scale))
        body = actor._bodies[0]  # CPU backend: one env, one body
        if name not in self._nominal:
            materials = [(m.static_friction, m.dynamic_friction, m.restitution)
                         for m in (s.physical_material for s in body.collision_shapes)]
            self._nominal[name] = (float(body.mass), materials)
        nominal_mass, materials = self._nominal[name]
        body.set_mass(nominal_mass * mass)
        for shape, (static, dynamic, restitution) in zip(body.collision_shapes, materials, strict=True):
            # A new material per shape: editing the shared one would change the table's and robot's too.
            shape.set_physical_material(sapien.physx.PhysxMaterial(static * friction, dynamic * friction, restitution))


def _quat_mul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Hamilton product of `[N, 4]` quaternions in ManiSkill's (w, x, y, z) order."""
    aw, ax, ay, az = a.unbind(-1)
    bw, bx, by, bz = b.unbind(-1)
    return torch.stack([
        aw * bw - ax * bx - ay * by - az * bz,
        aw * bx + ax * bw + ay * bz - az * by,
        aw * by - ax * bz + ay * bw + az * bx,
        aw * bz + ax * by - ay * bx + az * bw,
    ], -1)

