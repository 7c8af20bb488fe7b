"""A state policy keeps its ManiSkill success on the simulated rig (lock-step): the rig's observation
sources, action mapping, scene randomization and success check all have to be right for that."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.maniskill

EPISODES = 8
MAX_STEPS = 60


class ScriptedPushPolicy(torch.nn.Module):
    """A state policy for PushCube (robotft.real_robot.parity.scripted_push) behind the policy interface:
    it reads ManiSkill's named `state` vector, so it depends on every segment's meaning and frame."""

    def __init__(self, names: tuple[str, ...], action_dim: int) -> None:
        super().__init__()
        self.names, self.action_dim = names, action_dim
        self.config = SimpleNamespace(obs_keys=["state"], obs_steps=1, act_steps=1)

    def predict_chunk(self, obs: dict[str, torch.Tensor], deterministic: bool = True) -> torch.Tensor:
        from robotft.real_robot.parity import scripted_push, segments

        state = obs["state"][0, -1].double().numpy()
        action = scripted_push(segments(self.names, state), 0, np.random.default_rng(0))
        if self.action_dim == 4:
            action = np.concatenate([action[:3], action[-1:]])
        return torch.as_tensor(action, dtype=torch.float32)[None, None]


def maniskill_success(env, policy, episodes: int) -> float:
    wins = 0
    for seed in range(episodes):
        obs = env.reset(seed=1000 + seed)
        for _ in range(MAX_STEPS):
            action = policy.predict_chunk({"state": obs["state"][:, None]})[:, 0]
            obs, _, _, _, info = env.step(action)
            if bool(info["success"][0]):
                wins += 1
                break
    return wins / episodes


@pytest.mark.parametrize("control_mode", ["pd_ee_delta_pose", "pd_ee_delta_pos"])
def test_state_policy_keeps_its_maniskill_success_on_the_sim_rig(control_mode):
    from robotft.real_robot.lockstep import make_lockstep_robot, run_lockstep
    from robotft.real_robot.parity import make_env
    from robotft.real_robot.rig import load_rig

    env = make_env("maniskill/push_cube", control_mode)
    try:
        policy = ScriptedPushPolicy(env.spec.observations["state"].names, env.spec.action.dim)
        sim = maniskill_success(env, policy, EPISODES)
        spec = env.spec
    finally:
        env.close()
    rig = load_rig("sim_franka")
    robot = make_lockstep_robot(rig)
    with robot:
        episodes = run_lockstep(policy, spec, rig, robot, EPISODES, MAX_STEPS, seed=0)
    on_rig = sum(e.outcome == "success" for e in episodes) / EPISODES
    # Each episode reports where it started: the cube drawn within the preset's box, a new draw per episode.
    cubes = np.array([e.start_positions["cube"] for e in episodes])
    assert np.all(np.abs(cubes[:, :2] - [0.615, 0.0]) <= 0.1 + 1e-3) and len({tuple(c) for c in cubes}) == EPISODES
    # ... and where it left the cube: within the success radius of the goal (xy, 0.1 m) exactly when it succeeded
    for e in episodes:
        cube, goal = np.array(e.end_positions["cube"]), np.array(e.end_positions["goal"])
        assert e.end_positions["goal"] == e.start_positions["goal"]  # the goal marker does not move
        assert (np.linalg.norm(cube[:2] - goal[:2]) <= 0.1) == (e.outcome == "success"), e
    assert sim >= 0.75, f"the scripted policy should work in ManiSkill, got {sim}"
    assert on_rig >= 0.8 * sim, f"{control_mode}: ManiSkill {sim}, sim rig {on_rig}: {episodes}"
    # A good policy is rarely corrected by the safety layer.
    assert sum(sum(e.safety.values()) for e in episodes) <= EPISODES, [e.safety for e in episodes]


def test_lockstep_renders_the_cameras_a_policy_reads():
    """A camera policy runs in lock-step: each observation is rendered from the state it acts on."""
    from robotft.real_robot.lockstep import make_lockstep_robot, run_lockstep
    from robotft.real_robot.rig import load_rig
    from robotft.specs import ActionSpec, EnvSpec, FeatureSpec

    rig = load_rig("sim_franka")
    rig.cameras[0].config.update(width=32, height=24)
    rig.observations.append(
        type(rig.observations[0])(
            key="rgb/base",
            unit="rgb8",
            sources=[type(rig.observations[0].sources[0])(source="camera", camera=rig.cameras[0].name)],
        )
    )
    spec = EnvSpec(
        {"rgb/base": FeatureSpec("rgb/base", (24, 32, 3), "uint8", unit="rgb8")},
        ActionSpec("pd_ee_delta_pose", 7, (-1.0,) * 7, (1.0,) * 7, 20.0),
    )
    seen = []

    class MoveUp(torch.nn.Module):
        config = SimpleNamespace(obs_keys=["rgb/base"], obs_steps=1, act_steps=1)

        def predict_chunk(self, obs, deterministic=True):
            seen.append(obs["rgb/base"].clone())
            return torch.tensor([[[0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0]]])

    robot = make_lockstep_robot(rig)
    with robot:
        episodes = run_lockstep(MoveUp(), spec, rig, robot, episodes=1, max_steps=15)
    assert episodes[0].steps == 15 and len(seen) == 15
    assert seen[0].dtype == torch.uint8 and tuple(seen[0].shape) == (1, 1, 24, 32, 3)
    # the hand rose for 15 control periods: the image of the last state differs from the first
    assert (seen[-1].float() - seen[0].float()).abs().mean() > 0.5
