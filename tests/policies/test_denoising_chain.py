import pytest
import torch
from torch.distributions import Normal

from robotft.policies.denoising_chain import Chain, gaussian_logprob


def test_gaussian_logprob_matches_torch_normal():
    g = torch.Generator().manual_seed(0)
    x, mean = torch.randn(4, 3, 2, generator=g), torch.randn(4, 3, 2, generator=g)
    std = torch.rand(4, 1, 1, generator=g) + 0.1
    expected = Normal(mean, std.expand_as(x)).log_prob(x).sum(dim=(1, 2))
    torch.testing.assert_close(gaussian_logprob(x, mean, std), expected)


def test_chain_transitions_flatten_row_major():
    latents = torch.arange(2 * 3 * 1 * 1, dtype=torch.float32).view(2, 3, 1, 1)
    chain = Chain(latents, torch.tensor([5, 6]), torch.zeros(2, 2), torch.zeros(2, 1, 1))
    x_k, x_prev, index = chain.transitions()
    assert x_k.flatten().tolist() == [0, 1, 3, 4]
    assert x_prev.flatten().tolist() == [1, 2, 4, 5]
    assert index.tolist() == [5, 6, 5, 6]


def test_chain_rejects_inconsistent_shapes():
    with pytest.raises(ValueError, match="logprob"):
        Chain(torch.zeros(2, 3, 4, 1), torch.tensor([0, 1]), torch.zeros(2, 3), torch.zeros(2, 4, 1))
