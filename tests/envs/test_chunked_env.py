"""ChunkedEnv: reward summing up to done, masking after done, partial resets, history, chunk checks."""

import pytest
import torch

from robotft.envs.base import BatchedEnv
from robotft.envs.chunked import ChunkedEnv
from robotft.envs.toy import ToyNavEnv
from robotft.specs import ActionSpec, EnvSpec, FeatureSpec


class CountingEnv(BatchedEnv):
    """Env i terminates after `lengths[i]` steps (success) unless truncated first; reward at step k is k.

    Observation `state` = [elapsed steps, episodes started]; it keeps counting after done, like a
    batched simulator that steps finished envs, so masking mistakes show up in the sums.
    """

    def __init__(self, lengths: list[int], max_episode_steps: int = 100) -> None:
        self.num_envs = len(lengths)
        self.device = torch.device("cpu")
        self.max_episode_steps = max_episode_steps
        self.spec = EnvSpec(
            observations={"state": FeatureSpec("state", (2,), "float32")},
            action=ActionSpec("test", 1, (-1.0,), (1.0,)),
        )
        self.lengths = torch.tensor(lengths)
        self.elapsed = torch.zeros(self.num_envs)
        self.episodes = torch.zeros(self.num_envs)
        self.reset_calls: list[tuple[int | None, list[int]]] = []

    def reset(self, seed=None, env_ids=None):
        ids = torch.arange(self.num_envs) if env_ids is None else env_ids
        self.reset_calls.append((seed, ids.tolist()))
        self.elapsed[ids] = 0
        self.episodes[ids] += 1
        return self._obs()

    def step(self, action):
        self.elapsed += 1
        terminated = self.elapsed == self.lengths
        truncated = self.elapsed == self.max_episode_steps
        return self._obs(), self.elapsed.clone(), terminated, truncated, {"success": terminated.clone()}

    def _obs(self):
        return {"state": torch.stack([self.elapsed, self.episodes], dim=-1).clone()}


def test_reset_pads_history_with_first_frame():
    env = ChunkedEnv(ToyNavEnv(3), obs_steps=3, act_steps=2)
    obs = env.reset(seed=0)
    assert obs["state"].shape == (3, 3, 4)
    assert torch.equal(obs["state"][:, 0], obs["state"][:, 2])
    assert env.num_envs == 3 and env.act_dim == 2 and env.max_episode_steps == 40


def test_history_holds_the_last_frames():
    env = ChunkedEnv(CountingEnv([100]), obs_steps=3, act_steps=2)
    env.reset(seed=0)
    obs, *_ = env.step(torch.zeros(1, 2, 1))
    assert obs["state"][0, :, 0].tolist() == [0, 1, 2]
    obs, *_ = env.step(torch.zeros(1, 4, 1))  # a longer horizon: only act_steps actions run
    assert obs["state"][0, :, 0].tolist() == [2, 3, 4]


def test_rewards_sum_up_to_done_and_finished_envs_reset():
    base = CountingEnv([2, 5, 100])
    env = ChunkedEnv(base, obs_steps=2, act_steps=4)
    env.reset(seed=10)
    obs, reward, term, trunc, info = env.step(torch.zeros(3, 4, 1))
    # Env 0 finished at step 2 (rewards 1 + 2); steps 3 and 4 were masked. The others ran 4 steps.
    assert reward.tolist() == [3, 10, 10]
    assert term.tolist() == [True, False, False] and not trunc.any()
    assert info["done"].tolist() == [True, False, False]
    assert info["success"].tolist() == [True, False, False]
    assert info["episode_return"][0] == 3 and info["episode_length"][0] == 2
    assert info["steps"] == 12
    # final_obs: env 0's history when it finished; the others' equals the returned obs.
    assert info["final_obs"]["state"][0, :, 0].tolist() == [1, 2]
    assert torch.equal(info["final_obs"]["state"][1:], obs["state"][1:])
    # Env 0 was reset: its history is the new episode's first frame, repeated.
    assert obs["state"][0].tolist() == [[0, 2], [0, 2]]
    # Partial resets are not re-seeded (BatchedEnv.reset's seeding rule): only the full reset got the seed.
    assert base.reset_calls[-2][0] == 10 and base.reset_calls[-1] == (None, [0])

    obs, reward, term, trunc, info = env.step(torch.zeros(3, 4, 1))
    assert reward.tolist() == [3, 5, 5 + 6 + 7 + 8]
    assert info["done"].tolist() == [True, True, False]
    assert info["episode_length"][:2].tolist() == [2, 5]
    assert info["episode_return"][:2].tolist() == [3, 15]
    assert info["episode_return"][2] == 36  # running return of the unfinished episode
    assert base.reset_calls[-1] == (None, [0, 1])


def test_truncation_mid_chunk():
    env = ChunkedEnv(CountingEnv([100, 100], max_episode_steps=3), obs_steps=1, act_steps=4)
    env.reset()
    _, reward, term, trunc, info = env.step(torch.zeros(2, 4, 1))
    assert trunc.all() and not term.any() and not info["success"].any()
    assert reward.tolist() == [6, 6]
    assert info["final_obs"]["state"][:, 0, 0].tolist() == [3, 3]
    assert info["episode_length"].tolist() == [3, 3]


def test_seeded_runs_are_reproducible():
    def rollout():
        env = ChunkedEnv(ToyNavEnv(8, max_episode_steps=6), obs_steps=2, act_steps=4)
        gen = torch.Generator().manual_seed(0)
        out = [env.reset(seed=5)["state"]]
        for _ in range(5):
            obs, reward, *_ = env.step(torch.rand(8, 4, 2, generator=gen) * 2 - 1)
            out += [obs["state"], reward]
        return out

    assert all(torch.equal(a, b) for a, b in zip(rollout(), rollout(), strict=True))


@pytest.mark.parametrize("shape", [(3, 1, 2), (3, 4, 3), (2, 4, 2), (3, 4)])
def test_wrong_chunk_shape_is_an_error_naming_the_shapes(shape):
    env = ChunkedEnv(ToyNavEnv(3), obs_steps=1, act_steps=2)
    env.reset(seed=0)
    with pytest.raises(ValueError, match=r"action chunk has shape .*act_steps.*act_dim=2"):
        env.step(torch.zeros(shape))


def test_seeded_episodes_report_the_seed_they_started_from():
    base = CountingEnv([2, 100])
    env = ChunkedEnv(base, obs_steps=1, act_steps=2)
    env.reset(seed=10, seed_every_episode=True)
    _, _, _, _, info = env.step(torch.zeros(2, 2, 1))
    assert info["done"].tolist() == [True, False] and info["start_seed"].tolist() == [10, 11]
    _, _, _, _, info = env.step(torch.zeros(2, 2, 1))
    assert info["start_seed"].tolist() == [12, 11]  # env 0's second episode: seed + 0 + 1 · num_envs
    env.reset()
    _, _, _, _, info = env.step(torch.zeros(2, 2, 1))
    assert info["start_seed"].tolist() == [-1, -1]


def test_start_states_replay_a_failed_start_state_exactly():
    """With start_states every episode starts from the seed it draws; a failed one comes back identical."""
    from robotft.envs.start_states import FailedStartReplay

    env = ChunkedEnv(ToyNavEnv(3, max_episode_steps=4), obs_steps=1, act_steps=4)
    starts = FailedStartReplay(retries=1, replay_prob=1.0)
    obs = env.reset(start_states=starts)
    first_frames = {s: obs["state"][i, 0].clone() for i, s in enumerate(env._start_seed.tolist())}
    assert len(first_frames) == 3
    obs, _, _, _, info = env.step(torch.zeros(3, 4, 2))  # standing still for the whole episode fails it
    assert info["done"].all() and not info["success"].any()
    for i in range(3):
        starts.report(int(info["start_seed"][i]), False)
    # The failures were queued after the finished envs reset, so the next episodes are fresh ones ...
    obs, _, _, _, info = env.step(torch.zeros(3, 4, 2))
    assert not set(info["start_seed"].tolist()) & set(first_frames)
    for i in range(3):
        starts.report(int(info["start_seed"][i]), False)
    # ... and the ones after them replay the failed start states, from the same first frame.
    for i, s in enumerate(first_frames):
        assert torch.equal(obs["state"][i, 0], first_frames[s])
    _, _, _, _, info = env.step(torch.zeros(3, 4, 2))
    assert info["start_seed"].tolist() == list(first_frames)
    with pytest.raises(ValueError, match="a seed or start_states"):
        env.reset(seed=0, start_states=starts)


def test_grouped_envs_run_their_episodes_from_the_same_start_states():
    """group_size 2: envs (0, 1) and (2, 3) start each episode from one start state per group, and episode k of
    a group is seeded seed + group + k · groups."""
    env = ChunkedEnv(ToyNavEnv(4, max_episode_steps=4), obs_steps=1, act_steps=4)
    obs = env.reset(seed=50, seed_every_episode=True, group_size=2)
    first = obs["state"][:, 0]
    assert torch.equal(first[0], first[1]) and torch.equal(first[2], first[3])
    assert not torch.equal(first[0], first[2])
    obs, _, _, _, info = env.step(torch.zeros(4, 4, 2))  # every env ends its episode
    assert info["done"].all() and info["start_seed"].tolist() == [50, 50, 51, 51]
    second = obs["state"][:, 0]
    assert torch.equal(second[0], second[1]) and torch.equal(second[2], second[3])
    _, _, _, _, info = env.step(torch.zeros(4, 4, 2))
    assert info["start_seed"].tolist() == [52, 52, 53, 53]
    with pytest.raises(ValueError, match="group_size 3 .*divide num_envs"):
        env.reset(seed=0, seed_every_episode=True, group_size=3)
    with pytest.raises(ValueError, match="group_size 2 needs seed_every_episode"):
        env.reset(seed=0, group_size=2)



def test_milestones_accumulate_over_an_episode_and_restart_with_the_next():
    """`info["milestones"]` says which stages each episode reached at any step so far (valid where done); an
    auto-reset starts the next episode's flags over."""
    env = ChunkedEnv(ToyNavEnv(2, "nav2d", max_episode_steps=24), obs_steps=1, act_steps=4)
    env.reset(seed=0)
    # env 0: 6 steps left of the obstacle, 12 up (past y = 0 at step 17), 6 back down; env 1 stays put
    plan = torch.tensor([(-1.0, 0.0)] * 6 + [(0.0, 1.0)] * 12 + [(0.0, -1.0)] * 6 + [(-1.0, 0.0)] * 4)
    reached, done = [], []
    for k in range(7):
        chunk = torch.zeros(2, 4, 2)
        chunk[0] = plan[4 * k: 4 * k + 4]
        _, _, _, _, info = env.step(chunk)
        reached.append(info["milestones"]["halfway"].tolist())
        done.append(info["done"].tolist())
    assert reached[:3] == [[False, False]] * 3
    assert reached[4] == [True, False]
    assert reached[5] == [True, False] and done[5] == [True, True]  # kept back below y = 0, at the time limit
    assert reached[6] == [False, False]  # the next episode starts over


def test_plan_anchors_hold_the_history_of_the_last_plan_and_restart_with_each_episode():
    """`plan_every` K: `plan/<key>` is the history at the episode's start and every K steps after; `plan_step`
    counts the steps since; a finished env's new episode starts a new plan at once."""
    env = ChunkedEnv(CountingEnv([7, 100]), obs_steps=2, act_steps=1, plan_every=3)
    obs = env.reset(seed=0)
    steps, anchors = [obs["plan_step"][:, -1, 0].tolist()], [obs["plan/state"][:, -1, 0].tolist()]
    assert torch.equal(obs["plan/state"], obs["state"]) and obs["plan_step"].shape == (2, 2, 1)
    for _ in range(8):
        obs, _, _, _, info = env.step(torch.zeros(2, 1, 1))
        steps.append(obs["plan_step"][:, -1, 0].tolist())
        anchors.append(obs["plan/state"][:, -1, 0].tolist())
    # Env 0 finishes after 7 steps and restarts at 0; env 1 runs on. The anchor's last frame is the elapsed count.
    assert [s[1] for s in steps] == [0, 1, 2, 0, 1, 2, 0, 1, 2]
    assert [a[1] for a in anchors] == [0, 0, 0, 3, 3, 3, 6, 6, 6]
    assert [s[0] for s in steps] == [0, 1, 2, 0, 1, 2, 0, 0, 1]
    assert [a[0] for a in anchors] == [0, 0, 0, 3, 3, 3, 6, 0, 0]
    assert obs["plan/state"][0, :, 1].tolist() == [2, 2]  # the second episode's padded first history
    # The anchor is the whole history as it was then: at step 6 env 1's history was elapsed [5, 6].
    assert obs["plan/state"][1, :, 0].tolist() == [5, 6]


def test_plan_anchors_with_chunks_and_their_checks():
    env = ChunkedEnv(CountingEnv([100]), obs_steps=1, act_steps=2, plan_every=4)
    env.reset(seed=0)
    seen = [env.step(torch.zeros(1, 2, 1))[0]["plan_step"][0, -1, 0].item() for _ in range(4)]
    assert seen == [2, 0, 2, 0]
    assert "plan_step" not in ChunkedEnv(CountingEnv([5]), obs_steps=1, act_steps=2).reset(seed=0)
    with pytest.raises(ValueError, match="multiple of act_steps"):
        ChunkedEnv(CountingEnv([5]), obs_steps=1, act_steps=2, plan_every=3)
