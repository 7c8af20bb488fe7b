"""Chunk executors: receding horizon, ACT temporal ensembling, async inference with latency compensation."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest

from robotft.real_robot.executors import (
    AsyncExecutor,
    RecedingHorizonExecutor,
    TemporalEnsembleExecutor,
    make_executor,
)

DT = 0.05


def indexed_chunk(horizon: int = 16, offset: float = 0.0) -> np.ndarray:
    """Chunk whose action i is `[offset + i, -(offset + i)]`, so an action tells which one it was."""
    i = offset + np.arange(horizon, dtype=np.float64)
    return np.stack([i, -i], axis=1)


def test_receding_horizon_executes_exactly_k_then_asks_for_a_new_chunk():
    ex = RecedingHorizonExecutor(act_steps=3)
    assert ex.needs_chunk(0.0) and ex.action(0.0) is None
    ex.request(lambda obs: indexed_chunk(8, offset=obs), obs=10.0, obs_time=0.0)
    executed = []
    while not ex.needs_chunk(0.0):
        executed.append(ex.action(0.0)[0])
    assert executed == [10.0, 11.0, 12.0]
    assert ex.action(0.0) is None
    with pytest.raises(ValueError, match=r"\[H >= 3, act_dim\]"):
        ex.add_chunk(indexed_chunk(2), 0.0)


def test_temporal_ensemble_is_the_act_weighted_mean():
    m = 0.5
    ex = TemporalEnsembleExecutor(dt=DT, m=m)
    chunks = [indexed_chunk(4, offset=100.0 * c) for c in range(3)]
    for c, chunk in enumerate(chunks):
        assert ex.needs_chunk(c * DT)
        ex.add_chunk(chunk, obs_time=c * DT)
        assert not ex.needs_chunk(c * DT + 0.01)
    # At t = 2 dt: chunk 0 predicts its action 2, chunk 1 its action 1, chunk 2 its action 0.
    preds = np.array([chunks[0][2], chunks[1][1], chunks[2][0]])
    w = np.array([1.0, math.exp(-m), math.exp(-2 * m)])  # w_i = exp(-m i), i = 0 the oldest
    expected = (w[:, None] * preds).sum(0) / w.sum()
    np.testing.assert_allclose(ex.action(2 * DT + 0.01), expected, rtol=1e-12)
    # At t = 4 dt chunk 0 (4 actions) has ended; chunks 1 and 2 give their actions 3 and 2.
    expected = (chunks[1][3] + math.exp(-m) * chunks[2][2]) / (1 + math.exp(-m))
    np.testing.assert_allclose(ex.action(4 * DT), expected, rtol=1e-12)
    assert ex.action(10 * DT) is None


def test_async_skips_exactly_the_actions_whose_time_passed_and_reports_latency():
    delay = 0.12

    def slow_policy(obs):
        time.sleep(delay)
        return indexed_chunk(16)

    with AsyncExecutor(dt=DT, act_steps=8) as ex:
        obs_time = time.monotonic()
        assert ex.needs_chunk(obs_time)
        ex.request(slow_policy, obs=None, obs_time=obs_time)
        assert ex.in_flight and not ex.needs_chunk(obs_time)
        assert ex.action(obs_time) is None  # nothing yet: the runner holds the arm
        deadline = time.monotonic() + 5.0
        while ex.latency.count == 0 and time.monotonic() < deadline:
            time.sleep(0.005)
        latency = ex.latency.last_s
        assert latency >= delay and ex.inference.last_s >= delay
        # Actions 0..n-1 were scheduled (obs_time + i dt) before the chunk arrived at obs_time + latency.
        passed = math.ceil(latency / DT)
        assert ex.skipped == passed >= 3
        arrival = obs_time + latency
        assert ex.action(arrival)[0] == passed
        assert ex.action(obs_time + (passed + 1) * DT)[0] == passed + 1
        # The loop falls 3 periods behind: the two actions now more than dt/2 old are dropped.
        assert ex.action(obs_time + (passed + 4) * DT)[0] == passed + 4
        assert ex.dropped == 2


def test_async_requests_the_next_chunk_in_time_for_act_steps():
    ex = AsyncExecutor(dt=DT, act_steps=8, clock=lambda: 0.0)
    ex.add_chunk(indexed_chunk(16), obs_time=0.0, now=0.1)  # latency 0.1 s
    assert ex.skipped == 2 and ex.latency.mean_s == pytest.approx(0.1)
    # Next chunk must arrive by 0 + 8 dt = 0.4 s, so the request is due from 0.4 - 0.1 s on.
    assert not ex.needs_chunk(0.29)
    assert ex.needs_chunk(0.3)
    # A newer chunk replaces the current one, from its first action not yet due.
    ex.add_chunk(indexed_chunk(16, offset=100.0), obs_time=0.3, now=0.36)
    assert ex.action(0.36)[0] == 102.0
    ex.close()


def test_async_reset_ignores_an_in_flight_result_and_worker_errors_surface():
    ex = AsyncExecutor(dt=DT, act_steps=4)
    ex.request(lambda obs: (time.sleep(0.05), indexed_chunk(8))[1], None, time.monotonic())
    ex.reset()
    time.sleep(0.1)
    assert ex.action(time.monotonic()) is None and ex.latency.count == 0

    def broken(obs):
        raise ValueError("bad obs")

    ex.request(broken, None, time.monotonic())
    time.sleep(0.05)
    with pytest.raises(RuntimeError, match="inference failed") as err:
        ex.action(time.monotonic())
    assert isinstance(err.value.__cause__, ValueError)
    ex.close()


def test_make_executor_by_name():
    assert isinstance(make_executor("receding_horizon", act_steps=4), RecedingHorizonExecutor)
    assert isinstance(make_executor("temporal_ensemble", dt=0.1, m=0.01), TemporalEnsembleExecutor)
    ex = make_executor("async", dt=0.1, act_steps=4)
    assert isinstance(ex, AsyncExecutor)
    ex.close()
    with pytest.raises(ValueError, match=r"'rtc'.*\['async', 'receding_horizon', 'temporal_ensemble'\]"):
        make_executor("rtc")
    with pytest.raises(TypeError, match="'receding_horizon': bad options"):
        make_executor("receding_horizon", act_steps=4, dt=0.1)
