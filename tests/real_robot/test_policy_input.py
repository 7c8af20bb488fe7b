"""A closed-loop residual's plan anchors on the rig: the same observations ChunkedEnv gives it in simulation, and
a zero residual replays its base on the simulated rig exactly."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from test_deploy import closed_loop_checkpoint, make_checkpoint

from robotft.checkpoint import load_policy
from robotft.config import ConfigError
from robotft.envs.chunked import ChunkedEnv
from robotft.envs.toy import ToyNavEnv
from robotft.real_robot.policy_input import PolicyInput
from robotft.real_robot.rig import load_rig
from robotft.real_robot.runner import executor_for


def rig_history(obs: dict[str, torch.Tensor]) -> list[dict[str, np.ndarray]]:
    """ChunkedEnv's history of env 0 as the rig keeps it: one dict per step, oldest first."""
    steps = obs["state"].shape[1]
    return [{"state": obs["state"][0, i].numpy()} for i in range(steps)]


def test_plan_anchors_on_the_rig_are_chunked_envs():
    """Fed the same histories, PolicyInput gives every key ChunkedEnv gives a `plan_every` policy, step by step
    across three plans; after a reset (a new episode, or control handed back) the next query starts a new plan."""
    env = ChunkedEnv(ToyNavEnv(1), obs_steps=2, act_steps=1, plan_every=4)
    inputs = PolicyInput(["state"], obs_steps=2, plan_every=4, device="cpu")
    obs = env.reset(seed=0)
    generator = torch.Generator().manual_seed(0)
    for _ in range(11):
        ours = inputs(rig_history(obs))
        assert ours.keys() == obs.keys()
        for key in obs:
            torch.testing.assert_close(ours[key], obs[key], rtol=0, atol=0, msg=key)
        obs, _, _, _, info = env.step(0.2 * torch.randn(1, 1, 2, generator=generator))
        assert not info["done"].any()
    assert obs["plan_step"][0, -1, 0] == 3  # 11 steps: the third plan, at its fourth step
    inputs.reset()
    again = inputs(rig_history(obs))
    assert again["plan_step"].eq(0).all() and torch.equal(again["plan/state"], obs["state"])
    assert PolicyInput(["state"], 2, 0, "cpu")(rig_history(obs)).keys() == {"state"}
    with pytest.raises(ValueError, match="history of 2 observations"):
        inputs(rig_history(obs)[:1])


def test_a_closed_loop_policy_runs_receding_horizon_one_action_per_query(tmp_path):
    rig = load_rig("real_robot/franka_d435.yaml")
    assert rig.executor.type == "async"
    closed = load_policy(closed_loop_checkpoint(make_checkpoint(tmp_path / "base"), tmp_path / "closed"))[0]
    assert executor_for(rig, closed.config) == "receding_horizon"
    assert executor_for(rig, load_policy(tmp_path / "base")[0].config) == "async"
    with pytest.raises(ConfigError, match="--executor temporal_ensemble"):
        executor_for(rig, closed.config, "temporal_ensemble")
    fixed = dataclasses.replace(rig, executor=dataclasses.replace(rig.executor, act_steps=4))
    with pytest.raises(ConfigError, match="act_steps 4"):
        executor_for(fixed, closed.config)


def test_a_zero_closed_loop_residual_replays_its_base_on_the_sim_rig(tmp_path):
    """Lock-step on the simulated rig: the base executing 4 of each 8-step chunk, and a zero-initialised closed-loop
    residual over it (the base re-planning every 4 steps from the anchors, the residual queried every step), send the
    arm the same targets bit for bit and end every episode in the same state."""
    from robotft.real_robot.lockstep import make_lockstep_robot, run_lockstep

    torch.manual_seed(0)  # the tiny BC's initial weights, whatever ran before in this process
    base, ckpt = load_policy(make_checkpoint(tmp_path / "base"))
    closed, _ = load_policy(closed_loop_checkpoint(tmp_path / "base", tmp_path / "closed"))
    assert closed.config.plan_every == base.config.act_steps == 4 and closed.config.act_steps == 1
    rig = load_rig("sim_franka")
    robot = make_lockstep_robot(rig)
    sent, send = [], robot.send_action
    robot.send_action = lambda command: sent.append(command) or send(command)
    targets = []
    with robot:
        for policy in (base, closed):
            sent.clear()
            episodes = run_lockstep(policy, ckpt.spec, rig, robot, episodes=2, max_steps=24, seed=3)
            targets.append([(c.ee_pos, c.ee_quat, c.gripper_width) for c in sent])
            if policy is base:
                first = episodes
    assert [dataclasses.asdict(e) for e in first] == [dataclasses.asdict(e) for e in episodes]
    steps = [e.steps for e in first]
    assert max(steps) > 8, steps  # at least one episode re-planned twice
    assert len(targets[0]) == len(targets[1]) == sum(steps)
    for ours, theirs in zip(*targets, strict=True):
        assert np.array_equal(ours[0], theirs[0]) and np.array_equal(ours[1], theirs[1]) and ours[2] == theirs[2]
    # The arm moved: the base re-plans from what it observes.
    assert np.abs(targets[0][-1][0] - targets[0][0][0]).max() > 1e-3
