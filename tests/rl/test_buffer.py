import torch

from robotft.evaluation import wilson_interval
from robotft.rl.buffer import RunningRewardScaler, compute_gae


def test_gae_matches_hand_computation():
    gamma, lam = 0.9, 0.8
    rewards = torch.tensor([[1.0], [0.0], [2.0]])
    values = torch.tensor([[0.5], [0.4], [0.3]])
    dones = torch.tensor([[0.0], [1.0], [0.0]])
    next_value = torch.tensor([0.7])
    adv, ret = compute_gae(rewards, values, dones, next_value, gamma, lam)
    d2 = 2.0 + gamma * 0.7 - 0.3
    d1 = 0.0 + 0.0 - 0.4  # episode ended at t=1: no bootstrap
    d0 = 1.0 + gamma * 0.4 - 0.5
    a2, a1 = d2, d1
    a0 = d0 + gamma * lam * a1
    assert torch.allclose(adv.squeeze(1), torch.tensor([a0, a1, a2]))
    assert torch.allclose(ret, adv + values)


def test_reward_scaler_normalizes_return_scale():
    torch.manual_seed(0)
    scaler = RunningRewardScaler(num_envs=16, gamma=0.99, device=torch.device("cpu"))
    outs = []
    for t in range(300):
        done = torch.zeros(16, dtype=torch.bool) if (t + 1) % 50 else torch.ones(16, dtype=torch.bool)
        outs.append(scaler(torch.full((16,), 100.0) + torch.randn(16), done))
    # raw discounted returns reach ~4000; scaled rewards must be O(1/return std)
    assert torch.stack(outs[100:]).abs().max() < 1.0


def test_wilson_interval():
    lo, hi = wilson_interval(0, 10)
    assert lo == 0.0 and 0.2 < hi < 0.35
    lo, hi = wilson_interval(50, 100)
    assert abs((lo + hi) / 2 - 0.5) < 1e-9 and 0.39 < lo < 0.41
