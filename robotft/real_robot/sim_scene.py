"""The simulated rig's scene: a table, free-body objects and fixed markers around robosuite's Panda MJCF.

`build_model` composes robosuite's Panda (`robots/panda/robot.xml`) and its Franka Hand
(`grippers/panda_gripper.xml`) with `mujoco.MjSpec`, adds a `tcp` site and the table, objects and
markers of a `SimSceneConfig` (e.g. ManiSkill PushCube's 2 cm cube and goal disc), so a deploy rig can
rebuild the scene a policy was trained in. `sample_scene_poses` draws the poses of one episode with the
task's randomization. The world frame of the model is the robot base frame.

mujoco is imported lazily; `MUJOCO_GL` defaults to `egl`, the offscreen backend that works on headless
machines, for the simulated camera that renders this scene.
"""

from __future__ import annotations

import importlib.util
import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from robotft.optional import require
from robotft.real_robot.sim_fiducials import SimFiducialConfig, add_fiducials

INSTALL_HINT = "pip install robotft[robosuite]"

ARM_PREFIX = "panda/"
"""Name prefix of the arm's bodies, joints and actuators in the composed model."""
GRIPPER_PREFIX = "panda/gripper/"
"""Name prefix of the Franka Hand's bodies, joints and actuators."""
SCENE_GROUP = 2

FRICTION_CONES = {"elliptic": "mjCONE_ELLIPTIC", "pyramidal": "mjCONE_PYRAMIDAL"}
"""`SimSceneConfig.friction_cone` -> MuJoCo's `mjtCone` member."""
STIFF_CONTACT_SOLREF = (0.002, 1.0)
"""MuJoCo contact time constant (s) and damping ratio of the table: two physics steps, the stiffest
MuJoCo allows at 1 kHz. MuJoCo's default (0.02 s) lets a PD-driven hand that presses down sink about
7 mm into the table, where PhysX (ManiSkill) stops the fingertips on its surface. Objects keep MuJoCo's
default: as stiff, a fingertip hitting a cube at 0.4 m/s kicks it 3 cm ahead, where ManiSkill's cube
stays at the fingers."""
STIFF_CONTACT_SOLIMP = (0.99, 0.999, 0.001, 0.5, 2.0)
"""MuJoCo contact impedance of the table: near-rigid from 1 mm of penetration."""
# The table's `solmix` weight makes these parameters win over the other geom's in each of its contacts.

FRANKA_INERTIALS: dict[str, tuple[float, tuple[float, float, float], tuple[float, ...]]] = {
    "link1": (
        4.970684,
        (0.003875, 0.002081, -0.04762),
        (0.70337, 0.70661, 0.009117, -0.000139, 0.006772, 0.019169),
    ),
    "link2": (
        0.646926,
        (-0.003141, -0.02872, 0.003495),
        (0.007962, 0.02811, 0.025995, -0.003925, 0.010254, 0.000704),
    ),
    "link3": (
        3.228604,
        (0.027518, 0.039252, -0.066502),
        (0.037242, 0.036155, 0.01083, -0.004761, -0.011396, -0.012805),
    ),
    "link4": (
        3.587895,
        (-0.05317, 0.104419, 0.027454),
        (0.025853, 0.019552, 0.028323, 0.007796, -0.001332, 0.008641),
    ),
    "link5": (
        1.225946,
        (-0.011953, 0.041065, -0.038437),
        (0.035549, 0.029474, 0.008627, -0.002117, -0.004037, 0.000229),
    ),
    "link6": (
        1.666555,
        (0.060149, -0.014117, -0.010517),
        (0.001964, 0.004354, 0.005433, 0.000109, -0.001158, 0.000341),
    ),
    "link7": (
        0.735522,
        (0.010517, -0.004252, 0.061597),
        (0.012516, 0.010027, 0.004815, -0.000428, -0.001196, -0.000741),
    ),
    "right_hand": (0.73, (-0.01, 0.0, 0.03), (0.001, 0.0025, 0.0017, 0.0, 0.0, 0.0)),
}
"""Identified link inertials of the Franka Panda (Gaz et al. 2019, "Dynamic identification of the Franka
Emika Panda robot with retrieval of feasible parameters using penalty-based optimization"), as in
franka_description and ManiSkill's `panda_v2.urdf`: body -> (mass kg, centre of mass m, full inertia
`[ixx, iyy, izz, ixy, ixz, iyz]` kg m^2) in robosuite's link frames, which are the URDF's. robosuite's
own Panda uses rough placeholders (e.g. 0.3 kg m^2 on every axis of link 1), which make the arm respond
to the same PD gains several times slower than the real arm and ManiSkill's."""
"""Geom group of the table, objects and markers (robosuite uses 0 for collision, 1 for visual meshes)."""


def import_mujoco() -> Any:
    """`import mujoco` with `MUJOCO_GL=egl` unless the caller chose a GL backend.

    The GL backend is fixed when mujoco is first imported, so this must run before any other import of
    mujoco in the process for the simulated camera to render headless.
    """
    if "mujoco" not in sys.modules:
        os.environ.setdefault("MUJOCO_GL", "egl")
    return require("mujoco", "robosuite", "the simulated Franka")


def robosuite_assets() -> Path:
    """robosuite's `models/assets` folder, found without importing robosuite (slow and noisy)."""
    spec = importlib.util.find_spec("robosuite")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"the simulated Franka uses the Panda model shipped with robosuite; {INSTALL_HINT}")
    return Path(next(iter(spec.submodule_search_locations))) / "models" / "assets"


# ---- configs -------------------------------------------------------------------------------------------


@dataclass
class SimObjectConfig:
    """A free-floating box on the table (it can be pushed, grasped, knocked over)."""

    name: str
    """Body name; the key of `SimFranka.object_poses()`."""
    half_size: tuple[float, float, float] = (0.02, 0.02, 0.02)
    """Box half-extents (m); ManiSkill PushCube's cube is 0.02."""
    pos: tuple[float, float, float] = (0.6, 0.0, 0.02)
    """Nominal position of the box centre in the robot base frame (m)."""
    quat: tuple[float, float, float, float] = (1.0, 0.0, 0.0, 0.0)
    """Nominal orientation `[w, x, y, z]`."""
    rgba: tuple[float, float, float, float] = (0.85, 0.1, 0.1, 1.0)
    """Colour, red/green/blue/alpha in [0, 1]."""
    mass_kg: float = 0.064
    """Mass (kg); 0.064 is a 4 cm cube of density 1000 kg/m^3."""
    friction: float = 0.3
    """Sliding friction coefficient. MuJoCo uses the larger coefficient of two touching geoms (PhysX, in
    ManiSkill, their mean); 0.3 is SAPIEN's default material, which ManiSkill's cubes and table have."""
    randomize_xy: tuple[float, float] = (0.0, 0.0)
    """At reset, uniform noise of +-these half-ranges (m) is added to the nominal x and y."""
    randomize_yaw_rad: float = 0.0
    """At reset, uniform yaw noise of +- this (rad) about the base z axis."""

    def __post_init__(self) -> None:
        check_size(f"object {self.name!r} half_size", self.half_size, 3)
        if not (self.mass_kg > 0 and self.friction >= 0):
            raise ValueError(
                f"object {self.name!r} needs mass_kg > 0 and friction >= 0, got {self.mass_kg}, {self.friction}"
            )


@dataclass
class SimMarkerConfig:
    """A fixed visual marker (e.g. a goal disc): seen by cameras, not touched by anything."""

    name: str
    """Body name; the key of `SimFranka.object_poses()`."""
    shape: str = "cylinder"
    """`cylinder`, `box` or `sphere`."""
    size: tuple[float, ...] = (0.05, 0.001)
    """MuJoCo geom size (m): cylinder `(radius, half_height)`, box half-extents, sphere `(radius,)`."""
    pos: tuple[float, float, float] = (0.8, 0.0, 0.001)
    """Nominal position in the robot base frame (m), or an offset from `relative_to`'s position."""
    quat: tuple[float, float, float, float] = (1.0, 0.0, 0.0, 0.0)
    """Orientation `[w, x, y, z]`."""
    rgba: tuple[float, float, float, float] = (0.1, 0.8, 0.1, 1.0)
    """Colour, red/green/blue/alpha in [0, 1]."""
    relative_to: str | None = None
    """An object name: `pos` is then an offset (x, y only; z stays absolute) from that object's position
    after its randomisation, as ManiSkill PushCube places its goal 0.2 m in front of the cube."""
    randomize_xy: tuple[float, float] = (0.0, 0.0)
    """At reset, uniform noise of +-these half-ranges (m) is added to x and y."""
    randomize_z: float = 0.0
    """At reset, uniform noise in [0, this] (m) is added to z (ManiSkill PickCube raises its goal by up to
    0.3 m above the cube's centre height)."""

    def __post_init__(self) -> None:
        if not self.randomize_z >= 0:
            raise ValueError(f"marker {self.name!r} randomize_z must be >= 0, got {self.randomize_z}")
        sizes = {"cylinder": 2, "box": 3, "sphere": 1}
        if self.shape not in sizes:
            raise ValueError(f"marker {self.name!r} shape must be one of {sorted(sizes)}, got {self.shape!r}")
        check_size(f"marker {self.name!r} size", self.size, sizes[self.shape])


@dataclass
class SimSceneConfig:
    """What stands around the robot: a table, objects and markers, all in the robot base frame.

    Example (YAML in a rig preset, ManiSkill PushCube):
        scene:
          objects: [{name: cube, half_size: [0.02, 0.02, 0.02], pos: [0.615, 0.0, 0.02],
                     randomize_xy: [0.1, 0.1]}]
          markers: [{name: goal, shape: cylinder, size: [0.1, 0.001], pos: [0.2, 0.0, 0.001],
                     relative_to: cube, rgba: [0.9, 0.1, 0.1, 1]}]
    """

    table_top_z: float = 0.0
    """Height of the table surface (m); 0 puts the robot base on the table, as in ManiSkill."""
    table_center_xy: tuple[float, float] = (0.45, 0.0)
    """Centre of the table top (m)."""
    table_half_size: tuple[float, float] = (0.6, 0.7)
    """Half-extents of the table top in x and y (m)."""
    table_friction: float = 0.3
    """Sliding friction coefficient of the table top (SAPIEN's default material, as ManiSkill's table)."""
    table_rgba: tuple[float, float, float, float] = (0.55, 0.45, 0.35, 1.0)
    """Colour of the table top as the rig's cameras render it (what a camera policy sees of the table)."""
    friction_cone: str = "elliptic"
    """MuJoCo's friction cone, `elliptic` or `pyramidal` (MuJoCo's default). With `impratio`, how firmly
    static friction holds: see `impratio`."""
    impratio: float = 10.0
    """MuJoCo's ratio of frictional to normal constraint impedance (its default: 1). MuJoCo's contacts are soft,
    and with a pyramidal cone at ratio 1 a contact under a steady sideways force creeps where PhysX's static
    friction (ManiSkill) holds: a closed gripper pressing on a cube's top edge slides over the cube instead of
    dragging it. An elliptic cone at ratio 10, as MuJoCo recommends against slip, reproduces ManiSkill there (the
    PushCube teacher from 49 starts with the cube near the robot: 25 successes on the rig with MuJoCo's defaults,
    45 with these, 39 in ManiSkill)."""
    objects: list[SimObjectConfig] = field(default_factory=list)
    """Free-body boxes."""
    markers: list[SimMarkerConfig] = field(default_factory=list)
    """Fixed visual markers."""
    fiducials: list[SimFiducialConfig] = field(default_factory=list)
    """Printed ArUco markers on objects or robot links (robotft.real_robot.sim_fiducials)."""

    def __post_init__(self) -> None:
        if len(self.table_rgba) != 4 or not all(0 <= c <= 1 for c in self.table_rgba):
            raise ValueError(f"scene table_rgba must be 4 values in [0, 1], got {list(self.table_rgba)}")
        if self.friction_cone not in FRICTION_CONES or not self.impratio >= 1:
            raise ValueError(f"scene friction_cone must be one of {sorted(FRICTION_CONES)} and impratio >= 1, got "
                             f"{self.friction_cone!r} and {self.impratio}")
        names = [o.name for o in self.objects] + [m.name for m in self.markers]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"scene object/marker names must be unique, repeated: {duplicates}")
        objects = {o.name for o in self.objects}
        for m in self.markers:
            if m.relative_to is not None and m.relative_to not in objects:
                raise ValueError(
                    f"marker {m.name!r} relative_to {m.relative_to!r} is not an object; objects: {sorted(objects)}"
                )


# ---- the scene -----------------------------------------------------------------------------------------


def build_model(scene: SimSceneConfig, physics_hz: float, flange_to_tcp_m: float) -> Any:
    """Compile the MuJoCo model: Panda + Franka Hand at the origin, a `tcp` site `flange_to_tcp_m` along the
    flange z axis, the table, objects and markers; time step `1 / physics_hz`."""
    mujoco = import_mujoco()
    assets = robosuite_assets()
    arm = mujoco.MjSpec.from_file(str(assets / "robots" / "panda" / "robot.xml"))
    hand = mujoco.MjSpec.from_file(str(assets / "grippers" / "panda_gripper.xml"))
    for name, (mass, com, inertia) in FRANKA_INERTIALS.items():
        body = arm.body(name)
        body.mass, body.ipos, body.explicitinertial = mass, list(com), True
        body.inertia, body.iquat = _principal_inertia(mujoco, inertia)
    # The Hand's mass is in `right_hand` above; its fingers weigh 15 g each, as in ManiSkill's model
    # (robosuite gives each finger and fingertip 0.01 kg m^2, as much as the whole forearm).
    for name, mass in (
        ("right_gripper", 1e-3),
        ("leftfinger", 0.015),
        ("rightfinger", 0.015),
        ("finger_joint1_tip", 1e-3),
        ("finger_joint2_tip", 1e-3),
    ):
        body = hand.body(name)
        body.mass, body.inertia, body.explicitinertial = mass, [2.4e-6, 2.4e-6, 7.5e-7], True
    flange = arm.body("right_hand")  # robosuite's flange frame, already turned -45 deg like the Hand
    flange.add_site(name="tcp", pos=[0.0, 0.0, flange_to_tcp_m], size=[0.005, 0.005, 0.005], group=3)
    flange.add_frame().attach_body(hand.body("right_gripper"), "gripper/", "")

    spec = mujoco.MjSpec()
    spec.modelname = "robotft_sim_franka"
    spec.option.timestep = 1.0 / physics_hz
    spec.option.cone = getattr(mujoco.mjtCone, FRICTION_CONES[scene.friction_cone])
    spec.option.impratio = scene.impratio
    spec.visual.headlight.ambient = [0.3, 0.3, 0.3]
    spec.worldbody.add_light(
        pos=[0.5, 0.0, 2.5], dir=[0.0, 0.0, -1.0], type=mujoco.mjtLightType.mjLIGHT_DIRECTIONAL, castshadow=0
    )
    table_h = 0.02
    spec.worldbody.add_geom(
        name="table",
        type=mujoco.mjtGeom.mjGEOM_BOX,
        size=[*scene.table_half_size, table_h],
        pos=[*scene.table_center_xy, scene.table_top_z - table_h],
        rgba=list(scene.table_rgba),
        friction=[scene.table_friction, 0.005, 0.0001],
        solref=list(STIFF_CONTACT_SOLREF),
        solimp=list(STIFF_CONTACT_SOLIMP),
        solmix=1e3,
        group=SCENE_GROUP,
    )
    spec.worldbody.add_geom(
        name="floor",
        type=mujoco.mjtGeom.mjGEOM_PLANE,
        size=[3.0, 3.0, 0.1],
        pos=[0.0, 0.0, scene.table_top_z - 0.75],
        rgba=[0.35, 0.35, 0.38, 1.0],
        group=SCENE_GROUP,
    )
    spec.worldbody.add_frame().attach_body(arm.body("base"), ARM_PREFIX, "")
    for obj in scene.objects:
        body = spec.worldbody.add_body(name=obj.name, pos=list(obj.pos), quat=list(obj.quat))
        body.add_freejoint(name=f"{obj.name}_joint")
        body.add_geom(
            type=mujoco.mjtGeom.mjGEOM_BOX,
            size=list(obj.half_size),
            rgba=list(obj.rgba),
            mass=obj.mass_kg,
            condim=4,
            friction=[obj.friction, 0.005, 0.0001],
            group=SCENE_GROUP,
        )
    geom_types = {
        "cylinder": mujoco.mjtGeom.mjGEOM_CYLINDER,
        "box": mujoco.mjtGeom.mjGEOM_BOX,
        "sphere": mujoco.mjtGeom.mjGEOM_SPHERE,
    }
    for marker in scene.markers:
        body = spec.worldbody.add_body(
            name=marker.name, pos=list(marker.pos), quat=list(marker.quat), mocap=True
        )
        body.add_geom(
            type=geom_types[marker.shape],
            size=[*marker.size, *[0.0] * (3 - len(marker.size))],
            rgba=list(marker.rgba),
            contype=0,
            conaffinity=0,
            group=SCENE_GROUP,
        )
    add_fiducials(spec, scene.fiducials)
    return spec.compile()


def check_size(name: str, value: tuple[float, ...], size: int, allow_zero: bool = False) -> None:
    arr = np.asarray(value, dtype=np.float64)
    if arr.shape != (size,) or not np.all(np.isfinite(arr)) or (not allow_zero and np.any(arr <= 0)):
        what = "finite numbers" if allow_zero else "numbers > 0"
        raise ValueError(f"{name} must be {size} {what}, got {value}")


def _principal_inertia(mujoco: Any, full: tuple[float, ...]) -> tuple[list[float], list[float]]:
    """Principal moments `[3]` and the quaternion `[4]` (wxyz) of their axes, from a full inertia tensor
    `[ixx, iyy, izz, ixy, ixz, iyz]` (MuJoCo's compiled form of `fullinertia`)."""
    ixx, iyy, izz, ixy, ixz, iyz = full
    moments, axes = np.linalg.eigh(np.array([[ixx, ixy, ixz], [ixy, iyy, iyz], [ixz, iyz, izz]]))
    if np.linalg.det(axes) < 0:
        axes[:, 2] = -axes[:, 2]
    quat = np.zeros(4)
    mujoco.mju_mat2Quat(quat, axes.flatten())
    return moments.tolist(), quat.tolist()


# ---- episode poses -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ObjectPose:
    """Pose of a scene object or marker in the robot base frame."""

    timestamp_s: float
    """When the pose was simulated (s, the robot's clock)."""
    pos: np.ndarray
    """Position `[3]` (m)."""
    quat: np.ndarray
    """Orientation `[4]` `[w, x, y, z]`."""
    grasped: bool | None = None
    """Whether the gripper holds the object (a simulated scene: both fingers press on it, see
    `SimFranka.is_grasping`); None where the source cannot tell (markers, pose estimators)."""


Pose = tuple[np.ndarray, np.ndarray]
"""`(pos [3] m, quat [4] wxyz)` in the robot base frame."""


def sample_scene_poses(
    scene: SimSceneConfig, rng: np.random.Generator | None, given: dict[str, tuple[Any, Any]] | None = None
) -> dict[str, Pose]:
    """The pose of every object and marker for one episode: `given[name]` where set, else the nominal
    pose plus the configured noise drawn from `rng` (no noise when `rng` is None). Markers placed
    `relative_to` an object follow that object's sampled (or given) position."""
    given = dict(given or {})
    poses: dict[str, Pose] = {}
    for obj in scene.objects:
        if obj.name in given:
            pos, quat = given[obj.name]
            poses[obj.name] = (np.asarray(pos, dtype=np.float64), np.asarray(quat, dtype=np.float64))
        else:
            poses[obj.name] = _randomized(obj, rng)
    for mk in scene.markers:
        if mk.name in given:
            pos, quat = given[mk.name]
            poses[mk.name] = (np.asarray(pos, dtype=np.float64), np.asarray(quat, dtype=np.float64))
            continue
        pos = np.array(mk.pos, dtype=np.float64)
        if mk.relative_to is not None:
            pos[:2] += poses[mk.relative_to][0][:2]
        if rng is not None:
            pos[:2] += rng.uniform(-1.0, 1.0, 2) * np.array(mk.randomize_xy)
            if mk.randomize_z > 0:  # drawn only when set, so that other scenes keep their seeded episodes
                pos[2] += rng.uniform(0.0, 1.0) * mk.randomize_z
        poses[mk.name] = (pos, np.array(mk.quat, dtype=np.float64))
    return poses


def _randomized(obj: SimObjectConfig, rng: np.random.Generator | None) -> tuple[np.ndarray, np.ndarray]:
    """The object's nominal pose plus uniform xy and yaw noise (none when `rng` is None)."""
    pos = np.array(obj.pos, dtype=np.float64)
    quat = np.array(obj.quat, dtype=np.float64)
    if rng is None:
        return pos, quat
    pos[:2] += rng.uniform(-1.0, 1.0, 2) * np.array(obj.randomize_xy)
    yaw = rng.uniform(-1.0, 1.0) * obj.randomize_yaw_rad
    w0, z0 = math.cos(yaw / 2), math.sin(yaw / 2)  # rotation about the base z axis, applied first
    w1, x1, y1, z1 = quat
    return pos, np.array([w0 * w1 - z0 * z1, w0 * x1 - z0 * y1, w0 * y1 + z0 * x1, w0 * z1 + z0 * w1])
