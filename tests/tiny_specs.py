"""The small env spec and fitted normalizer that unit tests build policies on (3-D state, 2-D action)."""

import numpy as np

from robotft.datasets.normalizer import Normalizer
from robotft.specs import ActionSpec, EnvSpec, FeatureSpec


def tiny_spec_and_normalizer() -> tuple[EnvSpec, Normalizer]:
    """A 3-D `state`, a 2-D action in [-1, 1], and a normalizer fitted to 50 seeded samples of them."""
    rng = np.random.default_rng(0)
    spec = EnvSpec(
        observations={"state": FeatureSpec("state", (3,), "float32")},
        action=ActionSpec("test", 2, (-1.0, -1.0), (1.0, 1.0)),
    )
    norm = Normalizer.fit(
        {"state": rng.normal(size=(50, 3)), "action": rng.uniform(-1, 1, (50, 2))},
        {"state": "meanstd", "action": "minmax"},
    )
    return spec, norm
