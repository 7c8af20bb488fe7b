"""robotft's RL on LeRobot policies, one fine-tuning iteration each on the toy nav2d suite: residual PPO over a
frozen LeRobot DiffusionPolicy, ReinFlow (Flow-Noise) and Flow-SDE on a SmolVLA's action expert. Gradients must
reach exactly the parts that train."""

import dataclasses

import lerobot_fixtures
import pytest
import torch
import toy_fixtures
from lerobot_fixtures import TASK

from robotft.checkpoint import load_policy, read_checkpoint
from robotft.envs.chunked import ChunkedEnv
from robotft.envs.factory import make_env
from robotft.finetune import FinetuneConfig, make_algorithm, make_critic
from robotft.lerobot.policy import LeRobotDiffusion, LeRobotSmolVLA, import_lerobot_policy
from robotft.policies.residual import ResidualPolicy
from robotft.rl.ppo import PPO, PPOConfig

TOY_NAV2D = dataclasses.replace(toy_fixtures.TOY_NAV2D, num_envs=50)
tiny_vlm = lerobot_fixtures.tiny_vlm
lerobot_diffusion_dir = lerobot_fixtures.lerobot_diffusion_dir
lerobot_smolvla_dir = lerobot_fixtures.lerobot_smolvla_dir
# Two epochs of one minibatch: a zero-initialised output layer (the residual's) passes no gradient to the layers
# below it until its first step.
ONE_ITERATION = PPOConfig(
    iterations=1,
    steps_per_iter=3,
    minibatch_size=12,
    update_epochs=2,
    critic_warmup_iters=0,
    target_kl=0.0,
    actor_lr=1e-4,
    critic_hidden=(16,),
)


def _one_update(policy, algo_name: str) -> tuple[dict, object]:
    """One PPO iteration (collect + update) of `algo_name` over `policy` on 4 nav2d envs; returns the update's
    metrics and the algorithm (gradients of the last minibatch are left on the parameters)."""
    cfg = FinetuneConfig(algo=algo_name, rl=ONE_ITERATION)
    algo = make_algorithm(algo_name, policy, cfg)
    env = make_env(dataclasses.replace(TOY_NAV2D, num_envs=4, max_episode_steps=12))
    critic = make_critic(policy, env.spec, policy.normalizer, cfg, algo)
    ppo = PPO(algo, critic, ChunkedEnv.for_policy(env, policy.config), ONE_ITERATION)
    buf, next_value, _ = ppo.collect()
    metrics = ppo.update(buf, next_value)
    assert metrics["actor_trained"] == 1.0
    return metrics, algo


def _assert_only_trainable_parts_get_gradients(frozen, trained):
    frozen, trained = list(frozen), list(trained)
    assert frozen and trained
    assert all(p.grad is None or not p.grad.any() for p in frozen), "a frozen parameter received a gradient"
    with_grad = [p for p in trained if p.grad is not None and p.grad.abs().sum() > 0]
    assert len(with_grad) == len(trained), (
        f"{len(trained) - len(with_grad)} trainable tensors got no gradient"
    )


def test_residual_ppo_over_a_lerobot_diffusion_base(
    lerobot_diffusion_dir, tmp_path, toy_pretrain, toy_finetune
):
    """LeRobot diffusion → robotft checkpoint → a zero-initialised residual on it (BC with lr 0) → residual PPO:
    one iteration trains the residual only; the fine-tuned checkpoint still carries LeRobot's weights."""
    base = import_lerobot_policy(
        lerobot_diffusion_dir,
        tmp_path / "base",
        TOY_NAV2D,
        key_map={"observation.environment_state": "state"},
    )
    preset = tmp_path / "residual.yaml"
    preset.write_text(
        f"type: residual\nbase_checkpoint: {base}\nobs_steps: 1\nhorizon_steps: 4\nact_steps: 4\n"
        "hidden_dims: [32]\n"
    )
    res = toy_pretrain(tmp_path / "res", preset, 1, "--train.lr", "0", "--train.batch_size", "16")
    policy, _ = load_policy(res)
    assert isinstance(policy, ResidualPolicy) and isinstance(policy.base, LeRobotDiffusion)

    _, algo = _one_update(policy, "residual_ppo")
    _assert_only_trainable_parts_get_gradients(
        policy.base.parameters(), [*policy.residual_net.parameters(), *policy.log_std.parameters()]
    )
    assert {id(p) for p in algo.actor_parameters()}.isdisjoint(id(p) for p in policy.base.parameters())

    ft = toy_finetune(
        res, tmp_path / "ft", "residual_ppo", dataclasses.replace(ONE_ITERATION, minibatch_size=50)
    )
    tuned, _ = load_policy(ft)
    lerobot_weights = read_checkpoint(base).model_state
    for name, tensor in tuned.base.state_dict().items():
        assert torch.equal(tensor, lerobot_weights[name]), f"the frozen base changed: {name}"


@pytest.mark.parametrize("algo_name", ["reinflow", "flow_sde"])
def test_flow_rl_trains_only_smolvlas_action_expert(lerobot_smolvla_dir, tmp_path, toy_finetune, algo_name):
    ckpt = import_lerobot_policy(lerobot_smolvla_dir, tmp_path / "smolvla", TOY_NAV2D, task=TASK)
    policy, _ = load_policy(ckpt)
    assert isinstance(policy, LeRobotSmolVLA)
    model = policy.lerobot.model
    expert = [
        *model.vlm_with_expert.lm_expert.parameters(),
        *model.action_in_proj.parameters(),
        *model.action_out_proj.parameters(),
        *model.action_time_mlp_in.parameters(),
        *model.action_time_mlp_out.parameters(),
    ]
    vlm = [*model.vlm_with_expert.vlm.parameters(), *model.state_proj.parameters()]

    _, algo = _one_update(policy, algo_name)
    _assert_only_trainable_parts_get_gradients(vlm, expert)
    assert {id(p) for p in algo.actor_parameters()} >= {id(p) for p in expert}
    if algo_name == "reinflow":
        assert all(p.grad is not None for p in algo.noise_net.parameters())

    before = load_policy(ckpt)[0].lerobot.state_dict()
    ft = toy_finetune(
        ckpt, tmp_path / algo_name, algo_name, dataclasses.replace(ONE_ITERATION, minibatch_size=50)
    )
    tuned, _ = load_policy(ft)
    after = tuned.lerobot.state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all(
        k.startswith(("model.vlm_with_expert.lm_expert.", "model.action_")) for k in changed
    )
