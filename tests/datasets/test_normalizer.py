import numpy as np
import pytest
import torch

from robotft.datasets.normalizer import Normalizer


def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(100, 3)) * [1.0, 5.0, 0.1] + [0.0, 2.0, -1.0]
    x[:, 2] = 4.0  # a constant dimension
    return {"state": x.astype(np.float32), "action": rng.uniform(-3, 7, size=(100, 2)).astype(np.float32)}


def test_minmax_maps_range_to_minus_one_one():
    d = data()
    norm = Normalizer.fit(d, {"action": "minmax"})
    y = norm.normalize("action", torch.as_tensor(d["action"]))
    torch.testing.assert_close(y.min(0).values, torch.full((2,), -1.0))
    torch.testing.assert_close(y.max(0).values, torch.full((2,), 1.0))
    torch.testing.assert_close(norm.unnormalize("action", y), torch.as_tensor(d["action"]))


def test_meanstd_and_constant_dims():
    d = data()
    norm = Normalizer.fit(d, {"state": "meanstd"})
    y = norm.normalize("state", torch.as_tensor(d["state"]))
    torch.testing.assert_close(y[:, :2].mean(0), torch.zeros(2), atol=1e-5, rtol=0)
    torch.testing.assert_close(y[:, :2].std(0, unbiased=False), torch.ones(2), atol=1e-4, rtol=0)
    assert torch.all(y[:, 2] == 0)  # constant: centred, not divided by ~0
    torch.testing.assert_close(norm.unnormalize("state", y), torch.as_tensor(d["state"]))
    norm = Normalizer.fit(d, {"state": "minmax"})
    assert torch.all(norm.normalize("state", torch.as_tensor(d["state"]))[:, 2] == 0)


def test_round_trip_through_tensors():
    d = data()
    norm = Normalizer.fit(d, {"state": "meanstd", "action": "minmax"})
    again = Normalizer.from_tensors(norm.to_tensors(), norm.metadata())
    x = torch.as_tensor(d["state"][:5])
    torch.testing.assert_close(again.normalize("state", x), norm.normalize("state", x))
    assert again.mode == norm.mode


def test_rejects_bad_input():
    d = data()
    d["state"][3, 1] = np.nan
    with pytest.raises(ValueError, match="'state' contains NaN"):
        Normalizer.fit(d, {"state": "minmax"})
    with pytest.raises(ValueError, match="mode"):
        Normalizer.fit(data(), {"state": "zscore"})
    with pytest.raises(KeyError, match="no statistics for key 'rgb'"):
        Normalizer.fit(data(), {"state": "minmax"}).normalize("rgb", torch.zeros(3))
