"""Toy 2-D navigation suite: pure torch, batched, fast, with multimodal scripted demonstrations.

Tasks
- `nav2d`: a point agent starts near (0, -1) and must reach a goal near (0, +1); a disc obstacle of
  radius 0.35 sits at the origin, right between them. Touching it ends the episode as a failure.
  The scripted expert (`Nav2DExpert`) passes left or right at random, so its demonstrations are
  bimodal: a unimodal MSE regressor averages the two modes and drives into the obstacle, a diffusion
  or flow policy does not.
- `reach2d`: the same without the obstacle (unimodal; a sanity check).

Units: positions in metres (arbitrary 2-D plane), actions are velocities in [-1, 1]^2 scaled by
`MAX_STEP` metres per step. Thousands of envs step in one call (>100k env steps/s on CPU at B=1024).

With `image_size > 0` the envs also observe `rgb/top`, a top-down camera image of the plane (agent red,
goal green, obstacle blue) drawn as Gaussian blobs (a few tensor ops per step): a camera task for distilling the
state policy into an image policy (robotft.distill) in seconds.
"""

from __future__ import annotations

import torch

from robotft.envs.base import MILESTONE_PREFIX, BatchedEnv, Obs
from robotft.specs import ActionSpec, EnvSpec, FeatureSpec

MAX_STEP = 0.1
"""Displacement per step (metres) of a unit action along each axis."""
GOAL_RADIUS = 0.1
"""Success when the agent is within this distance (metres) of the goal."""
START = (0.0, -1.0)
GOAL = (0.0, 1.0)
JITTER = 0.05
"""Half-width (metres) of the uniform jitter added to the start and goal positions."""
COLLISION_PENALTY = 1.0
SUCCESS_BONUS = 1.0

VIEW_HALF_WIDTH = 1.6
"""The `rgb/top` image shows the square [-VIEW_HALF_WIDTH, VIEW_HALF_WIDTH]^2 (metres), +y up."""
BLOB_SIGMA = 0.1
"""Std (metres) of the Gaussian blobs drawn for the agent and the goal in `rgb/top`."""

TASKS = {"nav2d": 0.35, "reach2d": 0.0}
"""Task id -> obstacle radius (metres; 0 = no obstacle)."""

REWARD_MODES = ("dense", "normalized_dense", "sparse")


class ToyNavEnv(BatchedEnv):
    """`num_envs` point agents in 2-D; observation `state` = [agent x, y, goal x, y] float32 `[B, 4]`,
    plus `rgb/top` uint8 `[B, image_size, image_size, 3]` when `image_size > 0`.

    Dense reward per step: progress toward the goal (metres, previous minus new distance),
    `- COLLISION_PENALTY` on collision, `+ SUCCESS_BONUS` on success. Normalized dense (as ManiSkill's: measured
    on the state reached, in [0, 1], 1 at success): `1 - tanh(distance to the goal)` scaled by one half, 0 on
    collision, 1 on success. Sparse: 1 on success, else 0.
    Collision and success terminate; `max_episode_steps` truncates. Milestone (BatchedEnv's `milestone/<name>`):
    `halfway`, the agent past the line midway between start and goal (y > 0) without a collision.
    """

    def __init__(
        self,
        num_envs: int,
        task: str = "nav2d",
        max_episode_steps: int = 40,
        reward_mode: str = "dense",
        device: str | torch.device = "cpu",
        image_size: int = 0,
        jitter: float = JITTER,
    ) -> None:
        """`image_size`: side (pixels) of the `rgb/top` image, 0 for none. `jitter`: half-width (metres)
        of the uniform jitter of the start and goal positions (larger makes the goal matter)."""
        if image_size < 0 or jitter < 0:
            raise ValueError(f"toy image_size and jitter must be >= 0, got {image_size}, {jitter}")
        if task not in TASKS:
            raise ValueError(f"toy task {task!r} is unknown; expected one of {sorted(TASKS)}")
        if reward_mode not in REWARD_MODES:
            raise ValueError(f"toy reward_mode {reward_mode!r}: expected one of {REWARD_MODES}")
        if num_envs < 1 or max_episode_steps < 1:
            raise ValueError(
                f"num_envs and max_episode_steps must be >= 1, got {num_envs}, {max_episode_steps}"
            )
        self.num_envs = num_envs
        self.task = task
        self.max_episode_steps = max_episode_steps
        self.reward_mode = reward_mode
        self.device = torch.device(device)
        self.obstacle_radius = TASKS[task]
        self.image_size = image_size
        self.jitter = jitter
        observations = {
            "state": FeatureSpec("state", (4,), "float32", unit="m", frame="world", names=("x", "y", "goal_x", "goal_y"))
        }
        if image_size:
            observations["rgb/top"] = FeatureSpec("rgb/top", (image_size, image_size, 3), "uint8", unit="rgb8",
                                                  frame="camera")
            # Pixel centres in metres: column -> x, row -> y (row 0 at the top, +y up).
            centres = (torch.arange(image_size, device=self.device) + 0.5) / image_size * 2 - 1
            self._pixel_x = centres * VIEW_HALF_WIDTH
            self._pixel_y = -centres * VIEW_HALF_WIDTH
        self.spec = EnvSpec(
            observations=observations,
            action=ActionSpec("velocity_2d", 2, (-1.0, -1.0), (1.0, 1.0), control_hz=10.0, frame="world"),
        )
        self._pos = torch.zeros(num_envs, 2, device=self.device)
        self._goal = torch.zeros(num_envs, 2, device=self.device)
        self._elapsed = torch.zeros(num_envs, dtype=torch.long, device=self.device)
        # Draws per-env seeds when reset(seed=None); reseeded by every seeded reset so a seeded reset
        # followed by unseeded ones is still reproducible.
        self._seed_rng = torch.Generator().manual_seed(0)

    def reset(self, seed: int | None = None, env_ids: torch.Tensor | None = None) -> Obs:
        ids = torch.arange(self.num_envs) if env_ids is None else env_ids.to("cpu", torch.long)
        if seed is None:
            seeds = torch.randint(0, 2**62, (len(ids),), generator=self._seed_rng)
        else:
            self._seed_rng.manual_seed(seed)
            seeds = seed + ids
        jitter = torch.stack([_uniform(int(s), 4) for s in seeds]) if len(ids) else torch.zeros(0, 4)
        jitter = (jitter * 2 - 1).mul(self.jitter).to(self.device)
        dev_ids = ids.to(self.device)
        self._pos[dev_ids] = torch.tensor(START, device=self.device) + jitter[:, :2]
        self._goal[dev_ids] = torch.tensor(GOAL, device=self.device) + jitter[:, 2:]
        self._elapsed[dev_ids] = 0
        return self._obs()

    def step(self, action: torch.Tensor) -> tuple[Obs, torch.Tensor, torch.Tensor, torch.Tensor, dict]:
        if action.shape != (self.num_envs, 2):
            raise ValueError(f"toy env: action must be [{self.num_envs}, 2], got {list(action.shape)}")
        prev_dist = (self._goal - self._pos).norm(dim=-1)
        self._pos = self._pos + action.to(self.device, torch.float32).clamp(-1, 1) * MAX_STEP
        self._elapsed += 1
        dist = (self._goal - self._pos).norm(dim=-1)
        # A step is at most 0.14 m, less than the obstacle's diameter, so checking the end point
        # cannot miss a crossing.
        collided = self._pos.norm(dim=-1) < self.obstacle_radius
        success = (dist < GOAL_RADIUS) & ~collided
        if self.reward_mode == "dense":
            reward = (prev_dist - dist) - COLLISION_PENALTY * collided + SUCCESS_BONUS * success
        elif self.reward_mode == "normalized_dense":
            reward = torch.where(success, 1.0, torch.where(collided, 0.0, 0.5 * (1 - torch.tanh(dist))))
        else:
            reward = success.float()
        terminated = collided | success
        truncated = self._elapsed >= self.max_episode_steps
        halfway = (self._pos[:, 1] > 0) & ~collided
        info = {"success": success, "collision": collided, f"{MILESTONE_PREFIX}halfway": halfway}
        return self._obs(), reward.float(), terminated, truncated, info

    def _obs(self) -> Obs:
        obs = {"state": torch.cat([self._pos, self._goal], dim=-1).clone()}
        if self.image_size:
            obs["rgb/top"] = self._render()
        return obs

    def _render(self) -> torch.Tensor:
        """`[B, S, S, 3]` uint8: agent and goal as Gaussian blobs (red, green), the obstacle as a blue disc."""
        def blob(points: torch.Tensor) -> torch.Tensor:
            dx = self._pixel_x[None, None, :] - points[:, 0, None, None]
            dy = self._pixel_y[None, :, None] - points[:, 1, None, None]
            return torch.exp(-(dx**2 + dy**2) / (2 * BLOB_SIGMA**2))

        r = torch.hypot(self._pixel_x[None, :], self._pixel_y[:, None])
        obstacle = (r < self.obstacle_radius).float().expand(self.num_envs, -1, -1)
        image = torch.stack([blob(self._pos), blob(self._goal), obstacle], dim=-1)
        return (image * 255).round().to(torch.uint8)


def _uniform(seed: int, n: int) -> torch.Tensor:
    """`n` uniform [0, 1) numbers determined by `seed` alone (independent of batch layout)."""
    return torch.rand(n, generator=torch.Generator().manual_seed(seed))


class Nav2DExpert:
    """Scripted waypoint follower for the toy tasks; picks a side (left/right) per episode.

    Each episode it heads for a waypoint beside the obstacle (x = side * U(0.5, 0.65) m,
    y = U(-0.15, 0.15) m), then for the goal, at full speed. Succeeds on >= 95% of `nav2d` episodes.
    On `reach2d` (no obstacle) it goes straight to the goal.
    """

    def __init__(
        self,
        num_envs: int,
        obstacle_radius: float = TASKS["nav2d"],
        seed: int = 0,
        device: str | torch.device = "cpu",
    ) -> None:
        self.device = torch.device(device)
        self.obstacle_radius = obstacle_radius
        self._gen = torch.Generator().manual_seed(seed)
        self.side = torch.ones(num_envs, device=self.device)
        """`[B]` +1 (pass right, x > 0) or -1 (pass left) of the current episode."""
        self.waypoint = torch.zeros(num_envs, 2, device=self.device)
        self._passed = torch.zeros(num_envs, dtype=torch.bool, device=self.device)

    def reset(self, env_ids: torch.Tensor, obs: Obs, side: torch.Tensor | None = None) -> None:
        """Pick a side and a waypoint for the envs `env_ids` (they just started a new episode).

        `side` `[len(env_ids)]` of +1/-1 forces the sides (e.g. to script one mode); random by default.
        `obs` (the new episodes' first observations) is part of the scripted-policy interface; the
        waypoints here do not depend on it.
        """
        ids = env_ids.to(self.device, torch.long)
        n = len(ids)
        random_side = torch.randint(0, 2, (n,), generator=self._gen).float().mul(2).sub(1)
        side = random_side if side is None else side.to("cpu", torch.float32)
        x = 0.5 + 0.15 * torch.rand(n, generator=self._gen)
        y = 0.3 * torch.rand(n, generator=self._gen) - 0.15
        self.side[ids] = side.to(self.device)
        self.waypoint[ids] = torch.stack([side * x, y], dim=-1).to(self.device)
        # Without an obstacle there is nothing to go around.
        self._passed[ids] = self.obstacle_radius <= 0

    def __call__(self, obs: Obs) -> torch.Tensor:
        """Action `[B, 2]` in [-1, 1] from `obs["state"]` `[B, 4]`."""
        state = obs["state"].to(self.device)
        pos, goal = state[:, :2], state[:, 2:4]
        self._passed |= (self.waypoint - pos).norm(dim=-1) < 0.05
        target = torch.where(self._passed[:, None], goal, self.waypoint)
        velocity = (target - pos) / MAX_STEP
        # Scale (not clip per axis) so the agent moves along the straight line to its target.
        scale = velocity.abs().amax(dim=-1, keepdim=True).clamp(min=1.0)
        return velocity / scale
