"""robosuite's robomimic tasks with the Panda behind the BatchedEnv contract.

Tasks: Lift, PickPlaceCan, NutAssemblySquare (one Panda) and TwoArmTransport (two Pandas), the
benchmark of robomimic (Mandlekar et al. 2021, "What Matters in Learning from Offline Human
Demonstrations for Robot Manipulation"). Control: robosuite's default composite controller, OSC_POSE
per arm (Khatib 1987 operational-space control): per arm 6 delta-pose inputs in [-1, 1], scaled to
0.05 m and 0.5 rad per step in the robot base frame, then the gripper (-1 open, +1 close).

Observations use robomimic's low-dimensional keys, concatenated in this order into `state`: per arm
`robot<i>_eef_pos`, `robot<i>_eef_quat` (x, y, z, w), `robot<i>_gripper_qpos`, then `object` (robosuite's
`object-state`); `FeatureSpec.names` names every dimension. With `obs_mode: rgb` the cameras are
rendered offscreen (EGL by default; `MUJOCO_GL=osmesa` for OSMesa where libOSMesa is installed) into
`rgb/<camera>` uint8 `[H, W, 3]`, upright (robosuite renders OpenGL-style, bottom row first).

Seeding: `reset(seed)` reseeds robosuite's generator, which draws the initial joint noise and object
placements, so equal seeds give equal trajectories in any process. robosuite also draws a little
randomness when it builds the model (Lift's cube half-size, 2.0-2.2 cm); that model is built once from a
fixed seed, the same in every env, unless `kwargs.hard_reset: true` rebuilds it at each reset.

`num_envs == 1` simulates in this process; `num_envs > 1` spreads the envs over worker processes
(robotft.envs.workers; `env.worker_processes`, one per core by default). robosuite does not end episodes:
here `terminated` is success (as robomimic's rollouts stop at success) and `truncated` comes from a step
counter against `max_episode_steps`. Lift, PickPlaceCan and NutAssemblySquare report their stages as
milestones (`info["milestone/<name>"]`, MILESTONES).
robosuite is imported lazily, inside the functions that build envs.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from typing import Any

import numpy as np
import torch

from robotft.config import EnvConfig
from robotft.envs.base import MILESTONE_PREFIX, BatchedEnv, Obs
from robotft.envs.workers import PooledEnv, WorkerPool
from robotft.optional import require
from robotft.specs import ActionSpec, EnvSpec, FeatureSpec

INSTALL_HINT = "pip install robotft[robosuite]"
CONTROL_MODE = "OSC_POSE"
"""The only control mode: robosuite 1.5.2's JOINT_VELOCITY controller is broken (docs/environment.md)."""
TASKS: dict[str, int] = {"Lift": 1, "PickPlaceCan": 1, "NutAssemblySquare": 1, "TwoArmTransport": 2}
"""Supported robosuite env names -> number of Panda arms."""
DEFAULT_CAMERAS: dict[str, tuple[str, ...]] = {
    "TwoArmTransport": ("shouldercamera0", "shouldercamera1", "robot0_eye_in_hand", "robot1_eye_in_hand"),
}
"""robomimic's image cameras per task, where they differ from `agentview` + `robot0_eye_in_hand`."""
SPARSE_ONLY = ("TwoArmTransport",)
"""Tasks without a shaped reward in robosuite (it would silently fall back to sparse)."""
DEFAULT_IMAGE_SIZE = 84
"""Camera height and width (robomimic's image datasets are 84x84); `kwargs.camera_heights` changes it."""
ROBOT_STATE_KEYS: dict[str, tuple[str, ...]] = {
    "eef_pos": ("x", "y", "z"),
    "eef_quat": ("qx", "qy", "qz", "qw"),
    "gripper_qpos": ("left_finger", "right_finger"),
}
"""robomimic's per-arm low-dim observation keys (after `robot<i>_`) and the names of their dimensions."""
LIFTED_M = 0.05
"""PickPlaceCan's `lifted` milestone: the grasped can this far (metres) above where the episode started it."""
MILESTONES: dict[str, tuple[str, ...]] = {
    "Lift": ("grasped",),
    "PickPlaceCan": ("grasped", "lifted", "over_bin"),
    "NutAssemblySquare": ("grasped",),
}
"""Task -> its milestones in order, the stages of robosuite's staged rewards (reach, grasp, lift, hover):
`grasped` the task's object held (robosuite's grasp check), `lifted` (LIFTED_M), `over_bin` the can above its
target bin (within a quarter of the bin's size of its placement, robosuite's hover check)."""
_OWNED_KWARGS = {
    "robots": "env.task (the Panda arms are fixed per task)",
    "controller_configs": "env.control_mode",
    "has_renderer": "nothing (on-screen rendering is never used)",
    "has_offscreen_renderer": "env.obs_mode",
    "use_camera_obs": "env.obs_mode",
    "reward_shaping": "env.reward_mode",
    "control_freq": "env.control_hz",
    "ignore_done": "env.max_episode_steps",
    "horizon": "env.max_episode_steps",
    "seed": "reset(seed=...)",
}
"""suite.make arguments this adapter sets itself -> the robotft setting that controls them."""


def state_keys(num_arms: int) -> list[str]:
    """robomimic's low-dim keys in the order they are concatenated into `state`."""
    return [f"robot{i}_{k}" for i in range(num_arms) for k in ROBOT_STATE_KEYS] + ["object"]


def state_names(num_arms: int, object_names: list[str]) -> tuple[str, ...]:
    """Per-dimension names of `state`: `robot0_eef_pos.x`, ..., then `object.<name>` for each object dim."""
    robot = [f"robot{i}_{k}.{c}" for i in range(num_arms) for k, comps in ROBOT_STATE_KEYS.items() for c in comps]
    return (*robot, *(f"object.{n}" for n in object_names))


def default_cameras(task: str) -> tuple[str, ...]:
    return DEFAULT_CAMERAS.get(task, ("agentview", "robot0_eye_in_hand"))


def check_config(cfg: EnvConfig) -> None:
    """Raise ValueError naming the env setting this adapter cannot honour (before any process starts)."""
    if cfg.task not in TASKS:
        raise ValueError(f"env.task {cfg.task!r}: the robosuite adapter supports {sorted(TASKS)}")
    if cfg.control_mode != CONTROL_MODE:
        raise ValueError(
            f"env.control_mode {cfg.control_mode!r}: the robosuite adapter supports only {CONTROL_MODE!r} "
            "(robosuite 1.5.2's JOINT_VELOCITY controller is broken)"
        )
    if cfg.obs_mode not in ("state", "rgb"):
        raise ValueError(f"env.obs_mode {cfg.obs_mode!r}: the robosuite adapter supports state and rgb")
    if cfg.reward_mode not in ("dense", "sparse"):
        raise ValueError(f"env.reward_mode {cfg.reward_mode!r}: the robosuite adapter supports dense and sparse")
    if cfg.task in SPARSE_ONLY and cfg.reward_mode != "sparse":
        raise ValueError(f"env.reward_mode {cfg.reward_mode!r}: robosuite implements only a sparse reward for {cfg.task}")
    owned = sorted(set(cfg.kwargs) & set(_OWNED_KWARGS))
    if owned:
        raise ValueError(
            f"env.kwargs {owned}: set by the robosuite adapter; use "
            + ", ".join(f"{k} -> {_OWNED_KWARGS[k]}" for k in owned)
        )


class RobosuiteEnv(PooledEnv):
    """A robomimic task in robosuite as a BatchedEnv; in this process or spread over worker processes.

    Observations: `state` float32 `[B, D]` (see the module docstring), plus with `obs_mode: rgb`
    `rgb/<camera>` uint8 `[B, H, W, 3]` for each camera (`kwargs.camera_names`, default robomimic's).
    `info["success"]` is bool `[B]`. `reset(seed)` seeds env i with `seed + i`; equal seeds give equal
    trajectories under equal actions. `cfg.kwargs` go to `robosuite.make` (e.g. `camera_heights`).
    """

    def __init__(self, cfg: EnvConfig, device: str | torch.device = "cpu") -> None:
        check_config(cfg)
        # Fail here, not in every worker, when robosuite is missing (find_spec does not import it).
        if importlib.util.find_spec("robosuite") is None:
            raise ImportError(f"the robosuite env backend needs robosuite; {INSTALL_HINT}")
        if cfg.num_envs > 1:
            worker_cfg = dataclasses.replace(cfg, num_envs=1)
            self._use(WorkerPool(_build_worker_env, worker_cfg, cfg.num_envs, device, "robosuite",
                                 num_processes=cfg.worker_processes))
        else:
            self._use(_SingleRobosuite(cfg, device))


def _build_worker_env(cfg: EnvConfig) -> BatchedEnv:
    """One env of a worker process (module level: the worker pool pickles it by name)."""
    return _SingleRobosuite(cfg, "cpu")


class _SingleRobosuite(BatchedEnv):
    """One robosuite env in this process (batch 1)."""

    def __init__(self, cfg: EnvConfig, device: str | torch.device) -> None:
        if cfg.num_envs != 1:
            raise ValueError(f"_SingleRobosuite simulates one env, got env.num_envs={cfg.num_envs}")
        check_config(cfg)
        suite = _import_robosuite()
        from robosuite.controllers import load_composite_controller_config

        self.num_envs = 1
        self.device = torch.device(device)
        self.max_episode_steps = cfg.max_episode_steps
        self.num_arms = TASKS[cfg.task]
        rgb = cfg.obs_mode == "rgb"
        kwargs: dict[str, Any] = {
            "camera_names": list(default_cameras(cfg.task)),
            "camera_heights": DEFAULT_IMAGE_SIZE,
            "camera_widths": DEFAULT_IMAGE_SIZE,
            # A hard reset rebuilds the MuJoCo model (and the renderer) at every reset, ~0.6 s each; it only
            # redraws model-level randomness (Lift's cube size). `kwargs.hard_reset: true` turns it on.
            "hard_reset": False,
            **cfg.kwargs,
        }
        cameras = kwargs["camera_names"]
        self.cameras: list[str] = [cameras] if isinstance(cameras, str) else list(cameras)
        self._env = suite.make(
            cfg.task,
            robots=["Panda"] * self.num_arms,
            controller_configs=load_composite_controller_config(controller=None, robot="Panda"),
            has_renderer=False,
            has_offscreen_renderer=rgb,
            use_camera_obs=rgb,
            reward_shaping=cfg.reward_mode == "dense",
            control_freq=cfg.control_hz,
            # Episodes end here (success, max_episode_steps), never inside robosuite.
            ignore_done=True,
            # Model-level randomness (Lift's cube size) is drawn when robosuite builds the model: a fixed
            # seed gives every env and worker the same model, so a reset seed alone fixes an episode.
            seed=0,
            **kwargs,
        )
        if not rgb:
            self.cameras = []
        self._milestones = MILESTONES.get(cfg.task, ())
        self._start_z = 0.0
        """PickPlaceCan: the can's height at the episode's start (its `lifted` milestone)."""
        self._elapsed = 0
        raw = self._env.reset()
        self._last_obs = self._convert_obs(raw)
        self.spec = self._make_spec(self._last_obs, self._object_names(raw), cfg.control_hz)

    def reset(self, seed: int | None = None, env_ids: torch.Tensor | None = None) -> Obs:
        if env_ids is not None and [int(i) for i in env_ids] not in ([], [0]):
            raise ValueError(f"robosuite reset: env_ids must index the single env 0, got {env_ids.tolist()}")
        if env_ids is not None and len(env_ids) == 0:
            return self._last_obs
        if seed is not None:
            # Reseed robosuite's generator in place: the placement samplers hold a reference to it.
            self._env.rng.bit_generator.state = np.random.default_rng(seed).bit_generator.state
        self._elapsed = 0
        self._last_obs = self._convert_obs(self._env.reset())
        if "lifted" in self._milestones:
            self._start_z = float(self._object_pos()[2])
        return self._last_obs

    def step(self, action: torch.Tensor) -> tuple[Obs, torch.Tensor, torch.Tensor, torch.Tensor, dict]:
        if tuple(action.shape) != (1, self.spec.action.dim):
            raise ValueError(f"robosuite step: action must be [1, {self.spec.action.dim}], got {list(action.shape)}")
        raw, reward, _, _ = self._env.step(action[0].detach().to("cpu", torch.float64).numpy())
        self._elapsed += 1
        success = bool(self._env._check_success())
        self._last_obs = self._convert_obs(raw)
        info = {"success": torch.tensor([success], device=self.device)}
        for name, reached in self._reached_milestones().items():
            info[MILESTONE_PREFIX + name] = torch.tensor([reached], device=self.device)
        return (
            self._last_obs,
            torch.tensor([reward], dtype=torch.float32, device=self.device),
            torch.tensor([success], device=self.device),
            torch.tensor([self._elapsed >= self.max_episode_steps], device=self.device),
            info,
        )

    def _task_object(self) -> Any:
        """The object the task moves: Lift's cube, PickPlaceCan's can, NutAssemblySquare's square nut."""
        env = self._env
        if hasattr(env, "nuts"):
            return env.nuts[env.nut_id]
        return env.objects[env.object_id] if hasattr(env, "objects") else env.cube

    def _object_pos(self) -> np.ndarray:
        return self._env.sim.data.body_xpos[self._env.sim.model.body_name2id(self._task_object().root_body)]

    def _reached_milestones(self) -> dict[str, bool]:
        """This step's milestones (MILESTONES), in task order."""
        if not self._milestones:
            return {}
        env = self._env
        grasped = bool(env._check_grasp(gripper=env.robots[0].gripper, object_geoms=self._task_object().contact_geoms))
        reached = {"grasped": grasped}
        pos = self._object_pos() if {"lifted", "over_bin"} & set(self._milestones) else None
        if "lifted" in self._milestones:
            reached["lifted"] = grasped and pos[2] > self._start_z + LIFTED_M
        if "over_bin" in self._milestones:
            target = env.target_bin_placements[env.object_id]
            reached["over_bin"] = bool(np.all(np.abs(pos[:2] - target[:2]) < env.bin_size[:2] / 4.0))
        return reached

    def render_rgb(self) -> torch.Tensor | None:
        """The first camera's latest frame `[1, H, W, 3]`; None without camera observations."""
        return self._last_obs[f"rgb/{self.cameras[0]}"].clone() if self.cameras else None

    def close(self) -> None:
        self._env.close()

    def _convert_obs(self, raw: dict[str, np.ndarray]) -> Obs:
        parts = [np.ravel(raw["object-state" if k == "object" else k]) for k in state_keys(self.num_arms)]
        obs = {"state": torch.as_tensor(np.concatenate(parts), dtype=torch.float32, device=self.device)[None]}
        for cam in self.cameras:
            upright = np.ascontiguousarray(raw[f"{cam}_image"][::-1])
            obs[f"rgb/{cam}"] = torch.as_tensor(upright, device=self.device)[None]
        return obs

    def _object_names(self, raw: dict[str, np.ndarray]) -> list[str]:
        """Names of the `object-state` dims, from the active object observables in robosuite's order."""
        names = []
        for key, observable in self._env._observables.items():
            if observable.modality != "object" or not (observable.is_enabled() and observable.is_active()):
                continue
            size = np.size(raw[key])
            comps = next((c for suffix, c in _SUFFIX_COMPONENTS.items() if key.endswith(suffix)), None)
            comps = comps if comps is not None and len(comps) == size else [str(j) for j in range(size)]
            names += [f"{key}.{c}" if size > 1 else key for c in comps]
        if len(names) != np.size(raw["object-state"]):
            raise RuntimeError(
                f"robosuite {type(self._env).__name__}: object observables have {len(names)} dims but "
                f"object-state has {np.size(raw['object-state'])}"
            )
        return names

    def _make_spec(self, obs: Obs, object_names: list[str], control_hz: float) -> EnvSpec:
        names = state_names(self.num_arms, object_names)
        features = {
            # eef positions in metres and quaternions in the world frame; object poses likewise.
            "state": FeatureSpec("state", (len(names),), "float32", unit="mixed", frame="world", names=names)
        }
        for cam in self.cameras:
            shape = tuple(obs[f"rgb/{cam}"].shape[1:])
            features[f"rgb/{cam}"] = FeatureSpec(f"rgb/{cam}", shape, "uint8", unit="rgb8", frame=cam)
        low, high = self._env.action_spec
        action = ActionSpec(
            CONTROL_MODE, int(low.size), tuple(map(float, low)), tuple(map(float, high)), float(control_hz), "robot_base"
        )
        return EnvSpec(observations=features, action=action)


_SUFFIX_COMPONENTS = {"_pos": ("x", "y", "z"), "_quat": ("qx", "qy", "qz", "qw")}
"""Names of the components of robosuite observables ending in these suffixes."""


def _import_robosuite() -> Any:
    """Import robosuite; a clear error naming the extra when it is missing."""
    return require("robosuite", "robosuite", "the robosuite env backend")
