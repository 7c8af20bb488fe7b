import sys

import pytest
import torch

from robotft.config import EnvConfig
from robotft.envs.chunked import ChunkedEnv
from robotft.envs.factory import make_env
from robotft.envs.toy import Nav2DExpert
from robotft.evaluation import evaluate, paired_comparison


def _env(n):
    return ChunkedEnv(make_env(EnvConfig(type="toy", task="nav2d", num_envs=n, max_episode_steps=40)), 1, 1)


def test_counts_exactly_the_requested_episodes_and_reports_ci():
    env = _env(8)
    still = evaluate(lambda o: torch.zeros(o["state"].shape[0], 1, 2), env, 20, seed=3)
    assert still.episodes == 20 and still.success_rate == 0.0
    assert still.mean_length == 40  # standing still times out at the episode limit
    assert still.ci95[0] == 0.0 and 0.0 < still.ci95[1] < 0.25


def test_expert_success_rate_and_determinism():
    def run():
        env = _env(16)
        expert = Nav2DExpert(16, seed=0)
        obs = env.reset(seed=5)
        expert.reset(torch.arange(16), {"state": obs["state"][:, -1]})
        last = {"state": obs["state"][:, -1]}

        def act(o):
            nonlocal last
            cur = {"state": o["state"][:, -1]}
            # a new episode started where the position jumped back to the start region
            restarted = (cur["state"][:, :2] - last["state"][:, :2]).norm(dim=-1) > 0.5
            if restarted.any():
                expert.reset(torch.nonzero(restarted).flatten(), cur)
            last = cur
            return expert(cur)[:, None]

        return evaluate(act, env, 64, seed=5)

    a, b = run(), run()
    assert a.success_rate >= 0.9
    assert a.milestones == ("halfway",)  # every success passed the obstacle's line on its way
    assert all("halfway" in reached for ok, reached in zip(a.episode_success, a.episode_milestones, strict=True)
               if ok)
    assert a.success_rate == b.success_rate and a.mean_return == b.mean_return


def test_a_policy_that_draws_noise_evaluates_the_same_twice_and_leaves_the_callers_generator_alone():
    """A sampler that draws from torch's global generator (DDPM's own, `model_std`) gives the same numbers for the
    same seed, different ones for another seed, and an evaluation inside a training run does not move that run's
    random stream."""

    def jitter(o):
        return 0.3 * torch.randn(o["state"].shape[0], 1, 2)

    torch.manual_seed(123)
    before = torch.get_rng_state()
    a, b = evaluate(jitter, _env(4), 12, seed=3), evaluate(jitter, _env(4), 12, seed=3)
    assert torch.equal(torch.get_rng_state(), before)
    assert (a.mean_return, a.episode_length) == (b.mean_return, b.episode_length)
    assert evaluate(jitter, _env(4), 12, seed=4).mean_return != a.mean_return


def test_start_states_do_not_depend_on_the_number_of_envs():
    """Episode r starts from the state of seed + r on 1, 3 or 8 envs alike, so that pretrain's, finetune's and
    `robotft eval`'s numbers compare whatever number of envs each ran on."""

    def episode_starts(n, episodes=6, limit=40):
        seen = []

        def stand_still(o):
            seen.append(o["state"][:, -1, :4].clone())  # position and goal: the randomized start
            return torch.zeros(o["state"].shape[0], 1, 2)

        evaluate(stand_still, _env(n), episodes, seed=11)
        # standing still, every episode lasts `limit` chunks; episode r is env r % n's (r // n)-th
        return torch.stack([seen[(r // min(n, episodes)) * limit][r % min(n, episodes)] for r in range(episodes)])

    one = episode_starts(1)
    assert len({tuple(s.tolist()) for s in one}) == 6  # six different start states
    assert torch.equal(one, episode_starts(3)) and torch.equal(one, episode_starts(8))


def test_a_missing_video_writer_is_named_before_any_episode_runs(monkeypatch, tmp_path):
    """Without imageio's ffmpeg plugin, imageio falls back to another writer that fails after the first episode
    with an unrelated TypeError; the evaluation refuses up front, naming the video path and the package."""
    monkeypatch.setitem(sys.modules, "imageio_ffmpeg", None)  # what an environment without the package gives
    steps = []

    def policy(obs):
        steps.append(1)
        return torch.zeros(obs["state"].shape[0], 1, 2)

    with pytest.raises(ImportError, match=r"eval\.mp4.*imageio-ffmpeg.*pip install imageio-ffmpeg"):
        evaluate(policy, _env(2), 2, seed=0, video_path=tmp_path / "eval.mp4")
    assert not steps


def test_per_episode_outcomes_name_the_start_states_that_failed():
    """`episode_success` is in episode order whatever the number of envs, and a failed episode r replays alone from
    seed `seed + r` (what `robotft eval --seed S --episodes 1 --video` does to show a user one failure)."""

    def reach_if_started_right(o):
        # straight to the goal when the start is right of x = 0, else stand still: fails on about half the starts
        state = o["state"][:, -1]
        to_goal = (state[:, 2:4] - state[:, :2]).clamp(-1, 1)
        return (to_goal * (state[:, :1] > 0))[:, None]

    def run(n, episodes, seed):
        env = ChunkedEnv(make_env(EnvConfig(type="toy", task="reach2d", num_envs=n, max_episode_steps=40)), 1, 1)
        return evaluate(reach_if_started_right, env, episodes, seed=seed)

    result = run(4, 12, seed=30)
    assert len(result.episode_success) == len(result.episode_length) == 12
    assert sum(result.episode_success) / 12 == result.success_rate
    assert 0 < len(result.failed_seeds) < 12, result.episode_success
    assert run(1, 12, seed=30).episode_success == result.episode_success
    for r, ok in enumerate(result.episode_success):
        alone = run(1, 1, seed=30 + r)
        assert alone.episode_success == (ok,) and alone.episode_length == (result.episode_length[r],)
        assert alone.failed_seeds == ([] if ok else [30 + r])


def detour_or_crash(o):
    """Starts whose goal lies right of x = 0 detour left of the obstacle and stop short of the goal (y = 0.5), past
    the `halfway` milestone; the others drive straight into the obstacle before it. No episode succeeds."""
    state = o["state"][:, -1]
    x, y, detour = state[:, 0], state[:, 1], state[:, 2] > 0
    left = (x > -0.5) & (y < 0.3)
    velocity = torch.stack([-left.float(), (~left & (y < 0.5)).float()], dim=-1)
    return torch.where(detour[:, None], velocity, torch.tensor([0.0, 1.0]))[:, None]


def test_failures_are_counted_by_the_furthest_milestone_they_reached():
    """A failure that got past the obstacle and one that crashed into it are told apart: `failure_stages` is what
    `robotft eval` reports, so a user sees where a policy's failures stop."""
    result = evaluate(detour_or_crash, _env(4), 12, seed=40)
    assert result.success_rate == 0.0 and result.milestones == ("halfway",)
    stages = result.failure_stages
    assert set(stages) == {"none", "halfway"} and sum(stages.values()) == 12
    assert 0 < stages["halfway"] < 12, stages  # both kinds of start occur
    assert result.milestone_rates == {"halfway": stages["halfway"] / 12}
    assert result.to_dict()["failure_stages"] == stages
    for r, reached in enumerate(result.episode_milestones):  # in episode order: each start replays alone alike
        assert evaluate(detour_or_crash, _env(1), 1, seed=40 + r).episode_milestones == (reached,)


def _outcomes(both, only_this, only_baseline, neither):
    """Per-start-state outcomes (this policy, baseline) of a paired 2x2 table."""
    this = [True] * both + [True] * only_this + [False] * only_baseline + [False] * neither
    base = [True] * both + [False] * only_this + [True] * only_baseline + [False] * neither
    return this, base


def test_paired_interval_matches_newcombes_square_and_add_reference():
    # Fagerland, Lydersen & Laake, "Statistical Analysis of Contingency Tables" (2017), ch. 8 example: the
    # table [[59, 6], [16, 80]] gives -0.0621 (95% CI -0.1186 to -0.0046) by Newcombe's square-and-add method.
    cmp = paired_comparison(*_outcomes(59, 6, 16, 80))
    assert cmp.episodes == 161 and (cmp.only_this, cmp.only_baseline) == (6, 16)
    assert cmp.difference == pytest.approx(-0.0621, abs=5e-5)
    assert cmp.ci95 == pytest.approx((-0.1186, -0.0046), abs=5e-5)


def test_exact_mcnemar_counts_only_the_discordant_start_states():
    # 9 start states only this policy solves, 2 only the baseline: P(X >= 9 | X ~ Bin(11, 1/2)) = 67 / 2048.
    cmp = paired_comparison(*_outcomes(5, 9, 2, 4))
    assert cmp.p_value_greater == pytest.approx(67 / 2048)
    assert cmp.p_value == pytest.approx(2 * 67 / 2048)
    # Start states both solve or both fail leave the test unchanged; they narrow the interval of the difference.
    more = paired_comparison(*_outcomes(50, 9, 2, 40))
    assert more.p_value == pytest.approx(cmp.p_value)
    assert more.ci95[1] - more.ci95[0] < cmp.ci95[1] - cmp.ci95[0]


def test_paired_comparison_is_antisymmetric_and_checks_the_pairing():
    this, base = _outcomes(30, 12, 5, 53)
    forward, backward = paired_comparison(this, base), paired_comparison(base, this)
    assert backward.difference == pytest.approx(-forward.difference)
    assert backward.ci95 == pytest.approx((-forward.ci95[1], -forward.ci95[0]))
    assert forward.ci95[0] < forward.difference < forward.ci95[1]
    assert forward.p_value == backward.p_value and forward.p_value_greater < 0.5 < backward.p_value_greater
    same = paired_comparison(this, this)
    assert same.difference == 0.0 and same.p_value == 1.0 and same.ci95[0] < 0.0 < same.ci95[1]
    with pytest.raises(ValueError, match="same start states"):
        paired_comparison(this, base[:-1])
