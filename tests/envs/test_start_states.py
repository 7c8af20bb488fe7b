"""FailedStartReplay: failed start states come back up to `retries` times, fresh ones avoid evaluation seeds."""

import pytest

from robotft.envs.start_states import FRESH_SEED_BASE, FailedStartReplay, fresh_start_seed
from robotft.evaluation import EVAL_SEED


def test_a_failed_start_state_is_replayed_up_to_retries_times_then_given_up():
    starts = FailedStartReplay(retries=2, replay_prob=1.0)
    first = starts.next_seed()
    assert not starts.report(first, success=False)  # a fresh episode, not a replay
    for _ in range(2):
        assert starts.waiting == 1 and starts.next_seed() == first
        assert starts.report(first, success=False)  # a replay; after the second, no tries are left
    assert starts.waiting == 0 and starts.next_seed() == first + 1
    assert starts.replayed == 2


def test_a_solved_start_state_leaves_the_queue():
    starts = FailedStartReplay(retries=3, replay_prob=1.0)
    a, b = starts.next_seed(), starts.next_seed()
    starts.report(a, success=False)
    starts.report(b, success=True)  # a fresh success is never replayed
    assert starts.next_seed() == a
    starts.report(a, success=True)
    assert starts.waiting == 0 and starts.next_seed() == b + 1


def test_a_replay_cut_off_by_a_restart_is_requeued_with_its_try_uncounted():
    starts = FailedStartReplay(retries=1, replay_prob=1.0)
    a, b = starts.next_seed(), starts.next_seed()
    starts.report(a, success=False)
    starts.report(b, success=False)
    assert starts.next_seed() == a  # a's one retry starts, then the envs restart before it ends
    starts.abandon_in_progress()
    assert starts.waiting == 2 and starts.next_seed() == a  # back at the front: its retry is still owed
    assert starts.report(a, success=False)
    assert starts.next_seed() == b and starts.waiting == 0


def test_fresh_start_states_are_outside_the_evaluation_seeds_and_differ_between_run_seeds():
    runs = [FailedStartReplay(1, 0.5, seed=s) for s in (0, 1)]
    drawn = [{r.next_seed() for _ in range(100)} for r in runs]
    assert all(min(d) >= FRESH_SEED_BASE for d in drawn)
    assert not drawn[0] & drawn[1] and all(len(d) == 100 for d in drawn)


def test_restarts_never_land_on_evaluation_start_states_however_long_the_run():
    # Env i of a restart takes seed + i; evaluations take EVAL_SEED + r and `robotft eval --seed S` S + r.
    starts = {fresh_start_seed(seed, it) + i for seed in (0, 1, 999, 5000) for it in range(1000) for i in range(1024)}
    assert min(starts) >= FRESH_SEED_BASE > EVAL_SEED + 10**6
    assert max(starts) < 2**31  # a seed every simulator accepts
    assert fresh_start_seed(0, 1) != fresh_start_seed(0, 0) and fresh_start_seed(3, 7) == fresh_start_seed(0, 7) + 3


def test_replay_prob_is_the_share_of_new_episodes_that_replay_a_waiting_state():
    starts = FailedStartReplay(retries=1000, replay_prob=0.3, seed=4)
    seed = starts.next_seed()
    starts.report(seed, success=False)
    replays = 0
    for _ in range(1000):
        drawn = starts.next_seed()
        replays += drawn == seed
        if drawn == seed:
            starts.report(seed, success=False)
    assert 250 < replays < 350, replays


def test_the_state_dict_continues_the_same_sequence():
    starts = FailedStartReplay(retries=2, replay_prob=0.5, seed=7)
    for i in range(10):
        starts.report(starts.next_seed(), success=i % 3 == 0)
    copy = FailedStartReplay(retries=2, replay_prob=0.5, seed=99)
    copy.load_state_dict(starts.state_dict())
    for r in (starts, copy):
        r.sequence = []
        for i in range(20):
            seed = r.next_seed()
            r.sequence.append(seed)
            r.report(seed, success=i % 4 == 0)
    assert starts.sequence == copy.sequence and starts.replayed == copy.replayed
    assert len(set(starts.sequence)) < len(starts.sequence)  # the continued sequence replays some states


@pytest.mark.parametrize("retries, prob", [(0, 0.5), (1, 0.0), (1, 1.5)])
def test_bad_settings_are_refused_naming_them(retries, prob):
    with pytest.raises(ValueError, match="retries must be >= 1|replay_prob must be in"):
        FailedStartReplay(retries, prob)
