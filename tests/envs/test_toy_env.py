"""The toy 2-D navigation suite: contract, terminations, seeding, and the bimodal scripted expert."""

import torch

from robotft.envs.toy import MAX_STEP, Nav2DExpert, ToyNavEnv


def run_expert(env: ToyNavEnv, expert: Nav2DExpert, seed: int, side: torch.Tensor | None = None) -> dict:
    """One batched episode per env; returns per-env success, collision and mean x along the path."""
    B = env.num_envs
    obs = env.reset(seed=seed)
    expert.reset(torch.arange(B), obs, side=side)
    done = torch.zeros(B, dtype=torch.bool)
    success = torch.zeros(B, dtype=torch.bool)
    collision = torch.zeros(B, dtype=torch.bool)
    x_sum = torch.zeros(B)
    for _ in range(env.max_episode_steps):
        obs, _, term, trunc, info = env.step(expert(obs))
        x_sum += torch.where(done, 0.0, obs["state"][:, 0])
        new = ~done & (term | trunc)
        success |= new & info["success"]
        collision |= new & info["collision"]
        done |= new
    return {"success": success, "collision": collision, "mean_x": x_sum}


def test_shapes_and_dtypes():
    env = ToyNavEnv(5)
    obs = env.reset(seed=0)
    assert obs["state"].shape == (5, 4) and obs["state"].dtype == torch.float32
    obs, reward, term, trunc, info = env.step(torch.zeros(5, 2))
    assert obs["state"].shape == (5, 4)
    assert reward.shape == (5,) and reward.dtype == torch.float32
    assert term.dtype == trunc.dtype == info["success"].dtype == torch.bool
    assert env.spec.observations["state"].shape == (4,) and env.spec.action.dim == 2


def test_collision_terminates_without_success():
    env = ToyNavEnv(3)
    env.reset(seed=1)
    for _ in range(12):  # straight up from y ~ -1 reaches the obstacle (r = 0.35) within 8 steps
        _, reward, term, _, info = env.step(torch.tensor([[0.0, 1.0]] * 3))
        if term.all():
            break
    assert term.all() and info["collision"].all() and not info["success"].any()
    assert (reward < 0).all()


def test_reaching_goal_terminates_with_success_and_bonus():
    env = ToyNavEnv(4, task="reach2d", reward_mode="sparse")
    obs = env.reset(seed=2)
    for _ in range(30):
        delta = obs["state"][:, 2:] - obs["state"][:, :2]
        obs, reward, term, trunc, info = env.step((delta / MAX_STEP).clamp(-1, 1))
        if term.all():
            break
    assert term.all() and info["success"].all() and not trunc.any()
    assert torch.equal(reward, torch.ones(4))


def test_normalized_dense_reward_is_measured_on_the_state_reached():
    # Straight towards the goal: 0.5 (1 - tanh(distance)) rises on the way and is 1 at success.
    env = ToyNavEnv(2, task="reach2d", reward_mode="normalized_dense")
    obs, rewards = env.reset(seed=3), []
    for _ in range(40):
        delta = obs["state"][:, 2:] - obs["state"][:, :2]
        obs, reward, term, _, info = env.step((delta / MAX_STEP).clamp(-1, 1))
        rewards.append(reward)
        if term.all():
            break
    rewards = torch.stack(rewards)
    assert info["success"].all() and torch.equal(rewards[-1], torch.ones(2))
    assert (rewards[1:-1] > rewards[:-2]).all() and (rewards[:-1] < 0.5).all()
    # On collision: 0 (nav2d's obstacle sits between start and goal).
    env = ToyNavEnv(3, reward_mode="normalized_dense")
    env.reset(seed=1)
    for _ in range(12):
        _, reward, term, _, info = env.step(torch.tensor([[0.0, 1.0]] * 3))
        if term.all():
            break
    assert info["collision"].all() and torch.equal(reward, torch.zeros(3))


def test_truncation_at_max_episode_steps():
    env = ToyNavEnv(2, max_episode_steps=5)
    env.reset(seed=0)
    truncs = [env.step(torch.zeros(2, 2))[3] for _ in range(5)]
    assert not any(t.any() for t in truncs[:4]) and truncs[4].all()
    env.reset(env_ids=torch.tensor([0]))
    assert env.step(torch.zeros(2, 2))[3].tolist() == [False, True]


def test_seeded_reset_is_deterministic_and_per_env():
    env = ToyNavEnv(6)
    a = env.reset(seed=3)["state"]
    assert torch.equal(a, env.reset(seed=3)["state"])
    assert not torch.equal(a, env.reset(seed=4)["state"])
    # Partial reset: env i gets seed + i, whatever the batch layout.
    env.reset(seed=99)
    partial = env.reset(seed=3, env_ids=torch.tensor([2, 4]))["state"]
    assert torch.equal(partial[[2, 4]], a[[2, 4]])
    assert torch.equal(ToyNavEnv(1).reset(seed=3 + 5)["state"][0], a[5])
    # Unseeded resets after a seeded one are reproducible too.
    first = [env.reset(seed=7)["state"], env.reset()["state"]]
    second = [env.reset(seed=7)["state"], env.reset()["state"]]
    assert all(torch.equal(x, y) for x, y in zip(first, second, strict=True))


def test_expert_succeeds_and_is_bimodal():
    env, expert = ToyNavEnv(200), Nav2DExpert(200, seed=0)
    result = run_expert(env, expert, seed=0)
    assert result["success"].float().mean() >= 0.95
    right = result["mean_x"] > 0
    assert torch.equal(right, expert.side > 0)  # the path really passes on the chosen side
    assert 0.4 <= right.float().mean() <= 0.6


def test_averaging_the_two_modes_crashes():
    """What a unimodal MSE regressor learns from bimodal demos: the mean action, straight into the disc."""
    B = 100
    env = ToyNavEnv(B)
    left, right = Nav2DExpert(B, seed=1), Nav2DExpert(B, seed=2)
    obs = env.reset(seed=0)
    left.reset(torch.arange(B), obs, side=-torch.ones(B))
    right.reset(torch.arange(B), obs, side=torch.ones(B))
    crashed = torch.zeros(B, dtype=torch.bool)
    for _ in range(env.max_episode_steps):
        obs, _, term, _, info = env.step((left(obs) + right(obs)) / 2)
        crashed |= info["collision"]
        if term.all():
            break
    assert crashed.float().mean() >= 0.9


def test_rendered_top_image_shows_agent_and_goal_where_the_state_says():
    from robotft.envs.toy import VIEW_HALF_WIDTH, ToyNavEnv

    env = ToyNavEnv(4, task="nav2d", image_size=32, jitter=0.5)
    assert "rgb/top" not in ToyNavEnv(4).reset(seed=0)
    assert env.spec.observations["rgb/top"].shape == (32, 32, 3)
    obs = env.reset(seed=1)
    image, state = obs["rgb/top"], obs["state"]
    assert image.dtype == torch.uint8 and image.shape == (4, 32, 32, 3)
    for b in range(4):
        for channel, (x, y) in ((0, state[b, :2]), (1, state[b, 2:])):  # red agent, green goal
            row, col = divmod(int(image[b, :, :, channel].argmax()), 32)
            expect_col = (x / VIEW_HALF_WIDTH + 1) / 2 * 32
            expect_row = (-y / VIEW_HALF_WIDTH + 1) / 2 * 32
            assert abs(col + 0.5 - expect_col) <= 1 and abs(row + 0.5 - expect_row) <= 1
    assert image[:, 16, 16, 2].eq(255).all()  # the obstacle disc at the origin, in blue
