"""The off-policy algorithms: each raises success on the toy suite; a killed and resumed run keeps its replay buffer
and counters; DSRL leaves its base bit-identical and decodes deterministically; PA-RL's distillation lowers the BC
loss on the optimized actions; filtered BC learns only from successful episodes; the calibrated conservative critic
ranks the demonstrations first at their true value."""

import dataclasses
import json
import math
import os
import shutil
import types
from pathlib import Path

import numpy as np
import pytest
import torch
from tiny_specs import tiny_spec_and_normalizer

from robotft import checkpoint as ckpt_io
from robotft.cli import main
from robotft.config import EnvConfig
from robotft.datasets.normalizer import Normalizer
from robotft.datasets.store import DatasetWriter
from robotft.envs.chunked import ChunkedEnv
from robotft.envs.factory import make_env
from robotft.finetune import FinetuneConfig, run_finetune
from robotft.finetune_offpolicy import source_demos
from robotft.policies.base import Policy
from robotft.policies.diffusion import DiffusionPolicy, DiffusionPolicyConfig
from robotft.policies.flow import FlowPolicy, FlowPolicyConfig
from robotft.policies.gaussian import GaussianPolicy, GaussianPolicyConfig
from robotft.rl.conservative import conservative_penalty
from robotft.rl.dsrl import DSRL, DSRLConfig
from robotft.rl.filtered_bc import FilteredBC, FilteredBCConfig
from robotft.rl.offpolicy import OffPolicy, OffPolicyConfig
from robotft.rl.pa_rl import PARL, PARLConfig
from robotft.rl.ppo import PPOConfig
from robotft.rl.q_ensemble import QEnsemble
from robotft.rl.replay import ChunkReplayBuffer, ReplayBatch
from robotft.rl.residual_sac import BaseChunkMemo, ResidualSAC, ResidualSACConfig
from robotft.runlog import read_metrics
from robotft.specs import FeatureSpec

TOY_NAV2D = EnvConfig(type="toy", task="nav2d", num_envs=50, max_episode_steps=40, control_mode="velocity_2d",
                      reward_mode="dense", control_hz=10.0)

# Small networks and a CPU-sized update budget: 50 envs × 4 chunks per iteration, 50 critic steps per iteration.
SMALL = dict(utd=0.25, batch_size=128, critic_hidden=(64, 64), critic_warmup_iters=3)


def _offpolicy_cfg(source, out, algo: str, iterations: int, save_every: int | None = None, **sections):
    offpolicy = OffPolicyConfig(**{**SMALL, **sections.pop("offpolicy", {})})
    return FinetuneConfig(source=str(source), out=str(out), algo=algo, env=TOY_NAV2D,
                          rl=PPOConfig(iterations=iterations), offpolicy=offpolicy, eval_episodes=0,
                          save_every=save_every or iterations, seed=0, **sections)


@pytest.fixture(scope="module")
def weak_flow_bc(tmp_path_factory, toy_pretrain):
    """A flow policy after 200 BC steps: some success on nav2d, room to improve."""
    return toy_pretrain(tmp_path_factory.mktemp("flow_bc") / "bc", "flow_transformer", 200, "--policy.width", "64",
                        "--policy.num_layers", "1", "--policy.num_steps", "4", "--policy.state_hidden_dims", "64",
                        "--train.lr", "3e-3", "--train.batch_size", "128")


# -- learning on the toy suite ---------------------------------------------------------------------------------


@pytest.mark.parametrize("algo, margin", [("residual_sac", 0.15), ("pa_rl", 0.2), ("filtered_bc", 0.05)])
def test_offpolicy_algorithm_raises_success_on_toy(tmp_path, weak_gaussian_bc, toy_success, algo, margin):
    """A weak Gaussian BC (about 0.3 success) → 10 iterations (8,000 env steps) must beat it beyond the evaluation
    noise of 400 episodes (std ≈ 0.023)."""
    sections = {"filtered_bc": {"filtered_bc": FilteredBCConfig(lr=1e-3)},
                # The toy's corrections are larger than a small bound allows: the unbounded residual from the start.
                "residual_sac": {"residual_sac": ResidualSACConfig(residual_hidden=(64, 64), residual_bound=0.0,
                                                                   progressive_steps=0),
                                 "offpolicy": {"actor_every": 2}}}.get(algo, {})
    out = run_finetune(_offpolicy_cfg(weak_gaussian_bc, tmp_path / algo, algo, 10, **sections))
    before, after = toy_success(weak_gaussian_bc), toy_success(out)
    assert after > before + margin, f"{algo} should improve on BC: {before:.2f} -> {after:.2f}"


def test_filtered_bc_replaying_failed_start_states_raises_success_on_toy(tmp_path, weak_gaussian_bc, toy_success):
    """Filtered BC with failed start states tried twice more: it still learns, and its rollouts do replay them."""
    out = run_finetune(_offpolicy_cfg(weak_gaussian_bc, tmp_path / "fbc", "filtered_bc", 10,
                                      filtered_bc=FilteredBCConfig(lr=1e-3), offpolicy={"retry_failed_starts": 2}))
    before, after = toy_success(weak_gaussian_bc), toy_success(out)
    assert after > before + 0.05, f"filtered BC with replayed start states should improve on BC: {before:.2f} -> {after:.2f}"
    rows = read_metrics(out)
    replayed = [r["train/replayed_starts"] for r in rows if "train/replayed_starts" in r]
    assert sum(replayed) > 50, f"the rollouts should replay failed start states, replayed {replayed}"
    solved = [r["train/replay_success_rate"] for r in rows if "train/replay_success_rate" in r]
    assert solved and all(0 <= v <= 1 for v in solved) and max(solved) > 0


def test_replaying_start_states_is_refused_for_envs_on_a_gpu():
    """A GPU simulator seeds a batch, not an env, so a seed does not name one start state there."""
    env_on_gpu = types.SimpleNamespace(device=torch.device("cuda"), num_envs=4)
    with pytest.raises(ValueError, match="retry_failed_starts .* only for envs simulated on CPU; these envs are on cuda"):
        OffPolicy(None, None, env_on_gpu, OffPolicyConfig(retry_failed_starts=2))


def test_dsrl_raises_success_on_toy_and_leaves_the_base_bit_identical(tmp_path, weak_flow_bc, toy_success):
    """DSRL on its own entropy defaults (α, target) with only the budget and widths sized for the toy."""
    out = run_finetune(_offpolicy_cfg(weak_flow_bc, tmp_path / "dsrl", "dsrl", 10,
                                      dsrl=DSRLConfig(actor_hidden=(64, 64))))
    before, after = toy_success(weak_flow_bc), toy_success(out)
    assert after > before + 0.1, f"DSRL should improve on BC: {before:.2f} -> {after:.2f}"
    base = ckpt_io.read_checkpoint(weak_flow_bc).model_state
    tuned = ckpt_io.read_checkpoint(out).model_state
    assert {k.removeprefix("base.") for k in tuned if k.startswith("base.")} == set(base)
    for k, v in base.items():
        assert torch.equal(tuned["base." + k], v), f"base weight {k} changed"


# -- resume --------------------------------------------------------------------------------------------------


class _Killed(RuntimeError):
    pass


def test_killed_run_resumes_with_the_same_replay_buffer(tmp_path, weak_gaussian_bc, monkeypatch):
    """... and the same queue of failed start states to replay."""
    out = tmp_path / "run"
    cfg = _offpolicy_cfg(weak_gaussian_bc, out, "residual_sac", 4, save_every=1,
                         offpolicy={"critic_warmup_iters": 0, "retry_failed_starts": 2},
                         residual_sac=ResidualSACConfig(residual_hidden=(32,)))
    original = OffPolicy.collect

    def dies_in_iteration_3(self, *args, **kwargs):
        if self.iteration == 2:
            raise _Killed("killed")
        return original(self, *args, **kwargs)

    monkeypatch.setattr(OffPolicy, "collect", dies_in_iteration_3)
    with pytest.raises(_Killed):
        run_finetune(cfg)
    saved = ckpt_io.read_checkpoint(out)
    assert saved.meta["step"] == 2
    state = saved.training_state()["offpolicy"]
    replay = state["replay"]
    assert replay["size"] == replay["added"] == 2 * 4 * 50 and state["env_steps"] == 2 * 4 * 50 * 4

    seen = {}

    def records_the_restored_buffer(self, *args, **kwargs):
        if self.iteration == 2 and not seen:
            seen.update({k: {n: t.clone() for n, t in v.items()} if isinstance(v, dict) else v
                         for k, v in self.replay.state_dict().items()})
            seen["start_states"] = self.start_states.state_dict()
        return original(self, *args, **kwargs)

    monkeypatch.setattr(OffPolicy, "collect", records_the_restored_buffer)
    run_finetune(cfg, resume=True)
    for group in ("data", "obs", "next_obs"):
        for k, v in replay[group].items():
            assert torch.equal(seen[group][k], v), f"replay {group}/{k} differs after the resume"
    assert (seen["pos"], seen["size"], seen["added"]) == (replay["pos"], replay["size"], replay["added"])
    saved_starts, restored_starts = state["start_states"], seen["start_states"]
    assert saved_starts["waiting"] and saved_starts["fresh_drawn"] > 50  # failures queued, fresh states drawn
    assert torch.equal(restored_starts.pop("rng"), saved_starts.pop("rng")) and restored_starts == saved_starts
    final = ckpt_io.read_checkpoint(out)
    resumed = final.training_state()["offpolicy"]
    assert final.meta["step"] == 4 and final.meta["env_steps"] == 2 * saved.meta["env_steps"]
    assert resumed["replay"]["added"] == 2 * replay["added"] and resumed["updates"] == 2 * state["updates"]
    assert torch.equal(resumed["replay"]["data"]["reward"][: replay["size"]], replay["data"]["reward"])


# -- DSRL ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["diffusion", "flow"])
def test_dsrl_decodes_the_same_noise_to_the_same_chunk_and_never_moves_the_base(family):
    spec, norm = tiny_spec_and_normalizer()
    torch.manual_seed(0)
    if family == "diffusion":
        base = DiffusionPolicy(DiffusionPolicyConfig(horizon_steps=4, act_steps=2, hidden_dims=(16,),
                                                     num_train_timesteps=10, sampler="ddim", ddim_steps=3), spec, norm)
    else:
        base = FlowPolicy(FlowPolicyConfig(horizon_steps=4, act_steps=2, width=16, num_heads=2, num_layers=1,
                                           state_hidden_dims=(16,), num_steps=3), spec, norm)
    before = {k: v.clone() for k, v in base.state_dict().items()}
    algo = DSRL(base, DSRLConfig(actor_hidden=(16,)))
    obs = {"state": torch.randn(6, 1, 3)}
    noise = torch.randn(6, 8)
    first, second = algo.policy.decode(obs, noise), algo.policy.decode(obs, noise)
    assert torch.equal(first, second)
    assert not torch.equal(first, algo.policy.decode(obs, torch.randn(6, 8))), "the noise must steer the chunk"
    critic = QEnsemble(["state"], 3, algo.action_dim, norm, hidden_dims=(16,))
    algo.attach_critic(critic)
    chunk, action = algo.act(obs)
    assert action.shape == (6, 2 * 2), "DSRL-NA's critic sees the executed part of the chunk"
    batch = ReplayBatch(obs=obs, action=action, chunk=chunk, reward=torch.zeros(6), discount=torch.ones(6),
                        next_obs=obs, success=torch.zeros(6, dtype=torch.bool))
    actor_before = [p.clone() for p in algo.policy.actor.parameters()]
    for _ in range(3):
        algo.update_actor(batch, critic)
    assert any(not torch.equal(a, p) for a, p in zip(actor_before, algo.policy.actor.parameters(), strict=True))
    for k, v in algo.policy.base.state_dict().items():
        assert torch.equal(v, before[k]), f"base weight {k} changed"


def test_dsrl_decodes_a_ddpm_policy_through_its_deterministic_evaluation_chain():
    """A DDPM-trained policy is steered through DDIM η = 0 (its evaluation chain): noise 0 decodes to exactly the
    deterministic evaluation chunk, and a DDPM chain that samples at every step is refused."""
    spec, norm = tiny_spec_and_normalizer()
    cfg = DiffusionPolicyConfig(horizon_steps=4, act_steps=2, hidden_dims=(16,), num_train_timesteps=10)
    base = DiffusionPolicy(cfg, spec, norm)
    obs = {"state": torch.randn(2, 1, 3)}
    algo = DSRL(base, DSRLConfig(actor_hidden=(16,)))
    noise, _ = algo.policy.noise(obs, deterministic=True)
    assert torch.equal(noise, torch.zeros_like(noise)), "the noise actor must start at the base's own x_K = 0"
    chunk, _ = algo.act(obs, deterministic=True)
    assert torch.allclose(chunk, base.predict_chunk(obs, deterministic=True), atol=1e-6)
    stochastic = DiffusionPolicy(dataclasses.replace(cfg, deterministic_sampler="model_std"), spec, norm)
    with pytest.raises(ValueError, match="model_std"):
        DSRL(stochastic, DSRLConfig(actor_hidden=(16,))).act(obs)


# -- PA-RL ---------------------------------------------------------------------------------------------------


def test_pa_rl_distillation_lowers_the_bc_loss_on_the_optimized_actions():
    spec, norm = tiny_spec_and_normalizer()
    torch.manual_seed(0)
    policy = GaussianPolicy(GaussianPolicyConfig(horizon_steps=4, act_steps=2, hidden_dims=(32,)), spec, norm)
    algo = PARL(policy, PARLConfig(num_samples=4, local_steps=2, local_lr=0.1, distill_lr=1e-3, distill_steps=20))
    critic = QEnsemble(["state"], 3, algo.action_dim, norm, hidden_dims=(16,))
    obs = {"state": torch.randn(32, 1, 3)}
    targets = algo.improve(obs, critic)
    bc_before = policy.loss({"obs": obs, "action": targets})[0].item()
    algo.distill(obs, targets)
    bc_after = policy.loss({"obs": obs, "action": targets})[0].item()
    assert bc_after < 0.9 * bc_before, f"distillation should fit the optimized actions: {bc_before:.3f} -> {bc_after:.3f}"


def test_pa_rl_local_step_stays_in_the_demonstrations_range_and_never_lowers_q():
    """The ascent is clipped to the actions the policy can produce (a min-max normalizer's [-1, 1], here narrower
    than the env's bounds of ±1) and keeps the best point of its path: with steps that overshoot a concave Q's
    peak, the chunk it returns scores at least as high as the one it started from."""
    spec, _ = tiny_spec_and_normalizer()
    torch.manual_seed(0)
    norm = Normalizer.fit({"state": torch.randn(50, 3).numpy(), "action": (0.4 * torch.rand(50, 2) - 0.2).numpy()},
                          {"state": "meanstd", "action": "minmax"})
    policy = GaussianPolicy(GaussianPolicyConfig(horizon_steps=4, act_steps=2, hidden_dims=(32,)), spec, norm)
    algo = PARL(policy, PARLConfig(local_steps=5, local_lr=100.0))
    obs = {"state": torch.randn(8, 1, 3)}
    chunk = policy.predict_chunk(obs, deterministic=False)

    def uphill(o, a):
        return 1000.0 * a.sum(dim=1)[None]

    out = algo.local_step(obs, chunk, uphill)
    edge = norm.unnormalize("action", torch.ones(2))
    assert edge.max() < 0.2
    torch.testing.assert_close(out[:, :2], edge.expand(8, 2, 2))
    assert torch.equal(out[:, 2:], chunk[:, 2:])

    def peak(o, a):
        return -((a - 0.05) ** 2).sum(dim=1)[None]

    def q(c):
        return peak(obs, norm.normalize("action", c[:, :2]).flatten(1))[0]

    out = algo.local_step(obs, chunk, peak)
    assert (q(out) >= q(chunk) - 1e-6).all()


def test_residual_sac_explores_progressively_around_its_base_within_the_bound():
    """Policy Decorator's controls: at env step 0 of a progressive schedule every chunk is the base's; once the
    schedule has run out every chunk carries the residual, at most `residual_bound` normalized units from the base;
    the schedule's clock counts env steps and survives a resume. With neither, the toy defaults of the learning test
    above reproduce the unbounded residual."""
    spec, norm = tiny_spec_and_normalizer()
    torch.manual_seed(0)
    base = GaussianPolicy(GaussianPolicyConfig(horizon_steps=4, act_steps=2, hidden_dims=(32,)), spec, norm)
    algo = ResidualSAC(base, ResidualSACConfig(residual_hidden=(16,), log_std_init=-0.5, progressive_steps=64))
    obs = {"state": torch.randn(8, 1, 3)}
    base_chunk = algo.policy.base_chunk(obs)
    chunk, _ = algo.act(obs)
    torch.testing.assert_close(chunk, algo.policy.to_actions(base_chunk, torch.zeros_like(base_chunk)), rtol=0, atol=0)
    assert algo.env_steps == 8 * 2 and algo.residual_probability() == 16 / 64
    algo.env_steps = 64
    chunk, _ = algo.act(obs)
    offset = (chunk - base_chunk).abs() / norm.scale["action"]
    assert (offset.flatten(1).amax(dim=1) > 1e-3).all(), "past the schedule every env explores"
    assert (offset <= 0.1 + 1e-5).all(), "the residual stays within its bound"
    restored = ResidualSAC(base, ResidualSACConfig(residual_hidden=(16,)))
    restored.load_state_dict(algo.state_dict())
    assert restored.env_steps == 80
    assert FinetuneConfig.for_algorithm("residual_sac").offpolicy.reward_offset == -1.0
    # The entropy target refers to tanh(u): in r's units it is lower by log b per entry, else unreachable.
    assert algo.temperature.target_entropy == pytest.approx(algo.action_dim * (-1.0 + math.log(0.1)))


def test_the_base_chunk_memo_returns_the_bases_chunks_and_runs_it_only_on_new_histories():
    spec, norm = tiny_spec_and_normalizer()
    torch.manual_seed(0)
    base = DiffusionPolicy(DiffusionPolicyConfig(horizon_steps=4, act_steps=2, hidden_dims=(32,),
                                                 num_train_timesteps=5), spec, norm)
    rows_seen: list[int] = []

    def counted(obs):
        rows_seen.append(next(iter(obs.values())).shape[0])
        return base.predict_chunk(obs, deterministic=True)

    memo = BaseChunkMemo(counted, max_entries=100)
    obs = {"state": torch.randn(6, 1, 3)}
    first = memo(obs)
    torch.testing.assert_close(first, base.predict_chunk(obs), rtol=0, atol=0)
    assert memo.enabled and rows_seen == [6, 6], "the first call checks that the base is deterministic"
    new = torch.randn(2, 1, 3)
    mixed = memo({"state": torch.cat([obs["state"][[4, 1, 1]], new])})
    # Compared with the batches the base actually ran: a matmul over 5 rows may round differently from one
    # over 6 (thread splits), so a fresh 5-row call is not a bit-exact reference.
    torch.testing.assert_close(mixed[:3], first[[4, 1, 1]], rtol=0, atol=0)
    torch.testing.assert_close(mixed[3:], base.predict_chunk({"state": new}), rtol=0, atol=0)
    assert rows_seen[-1] == 2, "only the two new histories run the base"
    # A base whose deterministic mode still samples is never memoised.
    noisy = BaseChunkMemo(lambda o: base.predict_chunk(o, deterministic=False), max_entries=100)
    noisy(obs)
    assert noisy.enabled is False and not noisy.chunks
    assert BaseChunkMemo(counted, max_entries=0).enabled is False


# -- filtered BC ---------------------------------------------------------------------------------------------


def _toy_env_and_normalizer() -> tuple[ChunkedEnv, Normalizer]:
    """4 nav2d envs chunked by 2 actions over a 1-step history, and a normalizer for their state and actions."""
    env = ChunkedEnv(make_env(EnvConfig(type="toy", task="nav2d", num_envs=4, max_episode_steps=40,
                                        control_mode="velocity_2d")), 1, 2)
    norm = Normalizer.fit({"state": torch.randn(50, 4).numpy(), "action": torch.rand(50, 2).numpy() * 2 - 1},
                          {"state": "meanstd", "action": "minmax"})
    return env, norm


def _pretrained_critic_values(conservative_weight: float, calibrated: bool) -> dict[str, float]:
    """Fit a critic to demonstrations alone (64 successful episodes of 4 chunks, every action -0.8 normalized)
    under PA-RL with an untrained policy (actions near 0): mean Q - G at the data's, the policy's and random
    actions, G the Monte-Carlo return-to-go."""
    env, norm = _toy_env_and_normalizer()
    torch.manual_seed(0)
    policy = GaussianPolicy(GaussianPolicyConfig(horizon_steps=4, act_steps=2, hidden_dims=(32,)), env.spec, norm)
    algo = PARL(policy, PARLConfig(num_samples=1, local_steps=0))
    critic = QEnsemble(["state"], 4, algo.action_dim, norm, hidden_dims=(32, 32))
    episodes, length = 64, 4
    demos = ChunkReplayBuffer(episodes * length, 1)
    chunk = norm.unnormalize("action", torch.full((1, 4, 2), -0.8))
    for _ in range(episodes):
        states = torch.randn(length + 1, 1, 1, 4)
        for t in range(length):
            last = torch.tensor([t == length - 1])
            demos.add({"state": states[t]}, algo.critic_action_from_chunk(chunk), chunk, last.float(),
                      {"state": states[t + 1]}, last, last, last)
    cfg = OffPolicyConfig(batch_size=64, gamma=0.9, conservative_weight=conservative_weight, calibrated=calibrated)
    learner = OffPolicy(algo, critic, env, cfg, demos=demos)
    learner.update(num_updates=300, train_actor=False)
    b = demos.batch(torch.arange(len(demos)), 1, 0.9, return_to_go=True)
    with torch.no_grad():
        values = {"data": critic(b.obs, b.action), "policy": critic(b.obs, algo.policy_action(b.obs)),
                  "random": critic(b.obs, torch.rand_like(b.action) * 2 - 1)}
    env.close()
    return {k: (v.mean(0) - b.return_to_go).mean().item() for k, v in values.items()}


def test_calibrated_conservative_critic_ranks_the_demonstrations_first_at_their_true_value():
    """Cal-QL's claim on demonstrations that are all successes: without the conservative term the critic rates the
    policy's actions (far from the data's) like the data's; with it they rank well below, and calibration keeps
    the data's own Q at their Monte-Carlo return where plain CQL drags it far under."""
    plain = _pretrained_critic_values(0.0, calibrated=True)
    assert abs(plain["policy"] - plain["data"]) < 0.5, plain
    calql = _pretrained_critic_values(5.0, calibrated=True)
    assert calql["policy"] < calql["data"] - 1.0 and calql["random"] < calql["data"] - 1.0, calql
    assert calql["data"] > -0.3, f"the data's Q should sit at their return-to-go: {calql}"
    cql = _pretrained_critic_values(5.0, calibrated=False)
    assert cql["data"] < -1.0, f"plain CQL should underestimate the data's return: {cql}"


def test_the_conservative_term_values_every_candidate_action_at_the_transitions_own_state():
    """CQL's log-sum-exp compares actions at one state s: the policy's sample drawn at s' is valued at s too. With a
    critic that ignores the action, the term is log(#candidates) whatever s' is; Cal-QL's bound lifts only the
    policy samples."""
    batch, n_random, dim = 5, 3, 2

    def critic(obs, action):  # Q(s, a) = s: blind to the action
        return obs["state"][:, 0][None].expand(2, -1)

    obs = {"state": torch.randn(batch, 1)}
    q_data = critic(obs, None)
    policy_action, random_action = torch.randn(batch, 2, dim), torch.randn(batch, n_random, dim)
    penalty = conservative_penalty(critic, obs, q_data, policy_action, random_action, None)
    assert torch.allclose(penalty, torch.full((2,), math.log(n_random + 2 + 1)))
    return_to_go = obs["state"][:, 0] + math.log(2.0)  # exp G = 2 exp Q: each policy candidate counts twice
    calibrated = conservative_penalty(critic, obs, q_data, policy_action, random_action, return_to_go)
    assert torch.allclose(calibrated, torch.full((2,), math.log(n_random + 2 * 2 + 1)))


def _add_episodes(buffer: ChunkReplayBuffer, obs: dict, won: torch.Tensor, action_of_winners: float) -> None:
    """Three-chunk episodes, one per stream: winners act `action_of_winners`, the others its negation."""
    chunk = torch.where(won[:, None, None], action_of_winners, -action_of_winners).expand(len(won), 4, 2).clone()
    for t in range(3):
        last = torch.full((len(won),), t == 2)
        buffer.add(obs, chunk[:, :2].flatten(1), chunk, torch.zeros(len(won)), obs, last & won, last, won)


def _filtered_bc_learner(cfg: OffPolicyConfig, demos: ChunkReplayBuffer | None = None) -> tuple[OffPolicy, Policy]:
    env, norm = _toy_env_and_normalizer()
    policy = GaussianPolicy(GaussianPolicyConfig(horizon_steps=4, act_steps=2, hidden_dims=(32,), bc_loss="mse"),
                            env.spec, norm)
    return OffPolicy(FilteredBC(policy, FilteredBCConfig(lr=3e-3)), None, env, cfg, demos=demos), policy


def test_filtered_bc_trains_only_on_successful_episodes():
    """Successful episodes act -1, failed ones +1: filtered BC must pull the policy's mean towards -1 only."""
    learner, policy = _filtered_bc_learner(OffPolicyConfig(batch_size=16, buffer_size=64))
    obs = {"state": torch.zeros(4, 1, 4)}
    _add_episodes(learner.replay, obs, torch.tensor([True, False, True, False]), -1.0)
    assert learner.sample(64, only_successful=True).success.all()
    learner.update(num_updates=100, train_actor=True)
    mean = policy.predict_chunk(obs, deterministic=True)
    assert (mean < -0.8).all(), f"the policy should imitate only the successful chunks, got {mean[0, 0]}"


def test_filtered_bc_with_demo_ratio_one_trains_on_the_demonstrations_alone():
    """The continued-BC control: successful rollouts act +1, the demonstrations -1; with `demo_ratio` 1 every
    minibatch comes from the demonstrations and the policy follows them, not the rollouts."""
    obs = {"state": torch.zeros(4, 1, 4)}
    demos = ChunkReplayBuffer(64, 4)
    _add_episodes(demos, obs, torch.ones(4, dtype=torch.bool), -1.0)
    learner, policy = _filtered_bc_learner(
        OffPolicyConfig(batch_size=16, buffer_size=64, demo_data="demos.zarr", demo_ratio=1.0), demos)
    _add_episodes(learner.replay, obs, torch.ones(4, dtype=torch.bool), 1.0)
    assert (learner.sample(64, only_successful=True).chunk == -1).all()
    learner.update(num_updates=100, train_actor=True)
    mean = policy.predict_chunk(obs, deterministic=True)
    assert (mean < -0.8).all(), f"the policy should imitate the demonstrations alone, got {mean[0, 0]}"
    with pytest.raises(ValueError, match="offpolicy.demo_data"):
        OffPolicyConfig(demo_ratio=1.0)
    with pytest.raises(ValueError, match=r"offpolicy.demo_ratio must be in \[0, 1\], got 1.5"):
        OffPolicyConfig(demo_ratio=1.5, demo_data="demos.zarr")


@pytest.mark.parametrize("backup_entropy", [True, False])
def test_the_critic_target_backs_up_the_entropy_only_when_asked(backup_entropy):
    """SAC's soft target subtracts α log π(a'|s'); with `backup_entropy` off the target is R + γ^m (1 - d) min Q̄
    whatever α is, so a sparse return bounds Q."""
    env, norm = _toy_env_and_normalizer()
    torch.manual_seed(0)
    base = DiffusionPolicy(DiffusionPolicyConfig(horizon_steps=4, act_steps=2, hidden_dims=(16,),
                                                 num_train_timesteps=10), env.spec, norm)
    algo = DSRL(base, DSRLConfig(actor_hidden=(16,), noise_aliasing=False))
    critic = QEnsemble(["state"], 4, algo.action_dim, norm, hidden_dims=(16,))
    learner = OffPolicy(algo, critic, env, OffPolicyConfig(batch_size=8, backup_entropy=backup_entropy))
    learner.collect(steps=2)
    batch = learner.sample(8)

    def target(alpha: float) -> torch.Tensor:
        algo.temperature.log_alpha.data.fill_(math.log(alpha))
        torch.manual_seed(1)  # the same a' ~ π(·|s') for both α
        return learner.td_target(batch)[0]

    small, large = target(1e-6), target(10.0)
    torch.manual_seed(1)
    next_action, logprob = algo.target_action(batch.next_obs)
    assert torch.isfinite(logprob).all() and (batch.discount > 0).any()
    if backup_entropy:
        assert torch.allclose(large - small, -batch.discount * (10.0 - 1e-6) * logprob, rtol=1e-3, atol=1e-4)
    else:
        assert torch.equal(small, large)
        assert torch.allclose(small, batch.reward + batch.discount * learner.target(batch.next_obs, next_action).min(0).values)
    env.close()


# -- the command line ----------------------------------------------------------------------------------------


def test_cli_runs_an_offpolicy_algorithm_and_robotft_eval_loads_its_checkpoint(tmp_path, weak_flow_bc, capsys):
    """`robotft finetune --algo dsrl` with core flags, evaluated before and after, then `robotft eval` (no flags)."""
    out = tmp_path / "dsrl"
    assert main(["finetune", "--from", str(weak_flow_bc), "--algo", "dsrl", "--iterations", "2", "--out", str(out),
                 "--env.num_envs", "8", "--offpolicy.utd", "0.1", "--offpolicy.critic_hidden", "32",
                 "--dsrl.actor_hidden", "32", "--eval_episodes", "4", "--eval_every", "1"]) == 0
    evals = [r for r in read_metrics(out) if "eval/success_rate" in r]
    assert [r["step"] for r in evals] == [0, 8 * 4 * 4, 2 * 8 * 4 * 4]
    run = json.loads((out / "config.json").read_text())["run"]
    assert run["offpolicy"]["critic_warmup_iters"] == 3, "dsrl's own core defaults apply under the user's flags"
    capsys.readouterr()
    assert main(["eval", str(out), "--episodes", "4", "--num-envs", "4", "--json"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["episodes"] == 4


def test_filtered_bc_mixes_in_its_bcs_own_demonstrations_by_default(tmp_path, weak_gaussian_bc, toy_demos, capsys):
    """`--algo filtered_bc` with no flags: the BC's dataset mixed in at 8 BC steps per collected chunk, recorded in the
    run's config; a filtered-BC run from that run finds the same dataset through it; `--offpolicy.demo_data ''` turns
    the mixing off; a source that records no dataset trains on online data only and says so."""
    def finetune(source, out, *flags):
        capsys.readouterr()
        assert main(["finetune", "--from", str(source), "--algo", "filtered_bc", "--iterations", "1", "--out",
                     str(out), "--env.num_envs", "4", "--offpolicy.steps_per_iter", "2", "--eval_episodes", "0",
                     *flags]) == 0
        run = json.loads((out / "config.json").read_text())["run"]["offpolicy"]
        return run, capsys.readouterr().err

    first, err = finetune(weak_gaussian_bc, tmp_path / "fbc")
    assert first["demo_data"] == str(toy_demos) and first["utd"] == 8.0
    assert "demonstrations: 100 episodes" in err and rows_trained(tmp_path / "fbc") == 8 * 4 * 2
    second, _ = finetune(tmp_path / "fbc", tmp_path / "fbc2")
    assert second["demo_data"] == str(toy_demos)
    off, err = finetune(weak_gaussian_bc, tmp_path / "online", "--offpolicy.demo_data", "")
    assert off["demo_data"] == "" and "demonstrations:" not in err
    bare = tmp_path / "bare"
    shutil.copytree(ckpt_io.resolve_checkpoint(weak_gaussian_bc), bare)
    meta = json.loads((bare / "meta.json").read_text())
    (bare / "meta.json").write_text(json.dumps({k: v for k, v in meta.items() if k != "dataset"}))
    none, err = finetune(bare, tmp_path / "none")
    assert none["demo_data"] == "" and "no BC dataset is recorded" in err and str(bare) in err
    # A store without outcomes (neither `reward` nor `success`) cannot feed filtered BC: online data only, said.
    plain = tmp_path / "plain.zarr"
    with DatasetWriter(plain, {"state": FeatureSpec("state", (4,), "float32"),
                               "action": FeatureSpec("action", (2,), "float32")}, fps=10.0) as writer:
        writer.add_episode({"state": np.zeros((5, 4), np.float32), "action": np.zeros((5, 2), np.float32)})
    (bare / "meta.json").write_text(json.dumps({**meta, "dataset": str(plain)}))
    capsys.readouterr()
    assert source_demos(ckpt_io.read_checkpoint(bare)) == ""
    assert "neither a 'reward' nor a 'success' key" in capsys.readouterr().err


def test_filtered_bc_finds_the_bcs_dataset_from_any_directory(tmp_path, toy_demos, monkeypatch, capsys):
    """Pretrain given a relative `--data`, then fine-tuning runs started from other directories (one of them from a
    relative `--from`): each finds the BC's dataset through the recorded chain of runs."""
    lab, elsewhere, third = (tmp_path / name for name in ("lab", "elsewhere", "third"))
    for folder in (lab, elsewhere, third):
        folder.mkdir()
    monkeypatch.chdir(lab)
    assert main(["pretrain", "--env", "toy/nav2d", "--policy", "gaussian_mlp", "--data",
                 os.path.relpath(toy_demos, lab), "--steps", "20", "--out", "bc", "--train.eval_episodes", "0",
                 "--policy.hidden_dims", "16"]) == 0

    def demo_data(source, out):
        assert main(["finetune", "--from", str(source), "--algo", "filtered_bc", "--iterations", "1", "--out", out,
                     "--env.num_envs", "2", "--offpolicy.steps_per_iter", "1", "--eval_episodes", "0"]) == 0
        return json.loads((Path(out) / "config.json").read_text())["run"]["offpolicy"]["demo_data"]

    monkeypatch.chdir(elsewhere)
    assert demo_data(lab / "bc", "fbc") == str(toy_demos.resolve())
    monkeypatch.chdir(third)
    assert demo_data(os.path.relpath(elsewhere / "fbc", third), "fbc2") == str(toy_demos.resolve())
    monkeypatch.chdir(tmp_path)
    assert demo_data(third / "fbc2", "fbc3") == str(toy_demos.resolve())
    assert "no BC dataset" not in capsys.readouterr().err


def rows_trained(run) -> int:
    """BC steps the run took (filtered BC's `train/updates` at its last iteration)."""
    return int([r for r in read_metrics(run) if "train/updates" in r][-1]["train/updates"])


def test_demonstrations_from_a_store_feed_the_update_and_dsrl_sac_refuses_them(tmp_path, weak_gaussian_bc,
                                                                               weak_flow_bc, toy_demos):
    """RLPD mixing: a dataset store's episodes fill half of every minibatch (and pre-train the critic); DSRL-NA's
    action critic takes them, DSRL-SAC's critic acts in noise space, which demonstrations do not record."""
    out = run_finetune(_offpolicy_cfg(weak_gaussian_bc, tmp_path / "rsac", "residual_sac", 1,
                                      offpolicy={"demo_data": str(toy_demos), "critic_pretrain_steps": 5,
                                                 "warmup_steps": 2, "conservative_weight": 5.0}))
    rows = read_metrics(out)
    warm = [r for r in rows if "warmup/critic_loss" in r]
    assert warm and warm[0]["step"] == 0 and warm[0]["warmup/updates"] == 5
    assert warm[0]["warmup/conservative_penalty"] > 0, "Cal-QL's term runs in pre-training"
    assert any(r.get("train/conservative_penalty", 0) > 0 for r in rows), "and online"
    assert any("warmup/env_steps" in r for r in rows)
    final = ckpt_io.read_checkpoint(out)
    assert final.meta["env_steps"] == (2 + 4) * 50 * 4  # the WSRL warm-up's chunks count as env steps
    na = run_finetune(_offpolicy_cfg(weak_flow_bc, tmp_path / "dsrl_na", "dsrl", 1,
                                     offpolicy={"demo_data": str(toy_demos), "critic_pretrain_steps": 5}))
    assert [r for r in read_metrics(na) if "warmup/critic_loss" in r]
    with pytest.raises(ValueError, match="demo_data"):
        run_finetune(_offpolicy_cfg(weak_flow_bc, tmp_path / "dsrl", "dsrl", 1, dsrl=DSRLConfig(noise_aliasing=False),
                                    offpolicy={"demo_data": str(toy_demos)}))


def test_dsrl_na_distils_the_noise_critic_from_the_action_critic():
    """Q^W(o, w) approaches mean_k Q^A(o, decode(o, w)) at noises it was not fitted on (prior samples)."""
    spec, norm = tiny_spec_and_normalizer()
    torch.manual_seed(0)
    base = DiffusionPolicy(DiffusionPolicyConfig(horizon_steps=4, act_steps=2, hidden_dims=(16,),
                                                 num_train_timesteps=10), spec, norm)
    algo = DSRL(base, DSRLConfig(actor_hidden=(16,), noise_critic_lr=3e-3))
    critic = QEnsemble(["state"], 3, algo.action_dim, norm, hidden_dims=(32,))
    algo.attach_critic(critic)
    obs = {"state": torch.randn(64, 1, 3)}

    def gap() -> float:
        noise = algo._prior_noise(64, torch.device("cpu"))
        with torch.no_grad():
            target = critic(obs, algo._critic_action(obs, noise)[1]).mean(dim=0)
            return float((algo.noise_critic(obs, noise).mean(dim=0) - target).abs().mean())

    before = gap()
    for _ in range(300):
        algo.distill_noise_critic(obs, critic)
    assert gap() < 0.5 * before, f"the noise critic should fit the action critic: {before:.3f} -> {gap():.3f}"
