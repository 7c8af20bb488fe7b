"""Low-dim observation features shared by the policies (robotft.policies.encoders)."""

import numpy as np
import torch

from robotft.datasets.normalizer import Normalizer
from robotft.policies.encoders import OBS_CLIP, flatten_obs


def test_normalized_observations_are_clipped_and_identity_keys_pass_through():
    """A feature that barely moves in the demonstrations (range 0.002, as a quaternion component that flips sign
    later) normalizes to about -1000 at -1; the policy sees -OBS_CLIP instead. Values in range are unchanged and
    an identity key is not clipped."""
    rng = np.random.default_rng(0)
    state = np.stack([rng.uniform(-1, 1, 100), 0.999 + 0.001 * rng.uniform(-1, 1, 100)], axis=1)
    norm = Normalizer.fit({"state": state, "raw": rng.normal(size=(100, 1))}, {"state": "minmax", "raw": "identity"})
    shapes = {"state": (1, 2), "raw": (1, 1)}
    obs = {"state": torch.tensor([[[0.5, 0.999]], [[0.5, -1.0]]]), "raw": torch.tensor([[[7.0]], [[-9.0]]])}
    z = flatten_obs(obs, shapes, norm)
    unclipped = norm.normalize("state", obs["state"]).flatten(1)
    assert unclipped[1, 1] < -500
    torch.testing.assert_close(z[0, :2], unclipped[0])
    assert z[1, 1] == -OBS_CLIP and z[1, 0] == unclipped[1, 0]
    torch.testing.assert_close(z[:, 2], torch.tensor([7.0, -9.0]))
