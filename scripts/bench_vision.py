"""Cost of image observations on CPU: BC samples/s and `predict_chunk` latency (batch 1) of the RGB policies.

Random 64x64 uint8 frames (the size of envs/maniskill/push_cube_rgb.yaml) and a 25-dim state stand in for
data; the policies are the `policies/diffusion_unet_rgb.yaml` preset and, for comparison, the same preset
with every option that changes the cost varied one at a time. Prints one line per variant.

    python scripts/bench_vision.py [--batch 64] [--steps 10] [--side 64]
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import numpy as np
import torch

from robotft.config import from_dict, load_preset
from robotft.datasets.normalizer import Normalizer
from robotft.policies.base import build_policy, policy_config_class
from robotft.specs import ActionSpec, EnvSpec, FeatureSpec

CAMERA = "rgb/base_camera"
STATE_DIM, ACT_DIM = 25, 7


def make(cfg, side: int):
    spec = EnvSpec(
        {"state": FeatureSpec("state", (STATE_DIM,), "float32"), CAMERA: FeatureSpec(CAMERA, (side, side, 3), "uint8")},
        ActionSpec("pd_ee_delta_pose", ACT_DIM, (-1.0,) * ACT_DIM, (1.0,) * ACT_DIM),
    )
    rng = np.random.default_rng(0)
    normalizer = Normalizer.fit(
        {"state": rng.normal(size=(64, STATE_DIM)), "action": rng.uniform(-1, 1, (64, ACT_DIM)),
         CAMERA: np.zeros((1, side, side, 3))},
        {"state": "minmax", "action": "minmax", CAMERA: "identity"},
    )
    return build_policy(cfg, spec, normalizer)


def batch_of(cfg, batch: int, side: int) -> dict:
    obs = {
        "state": torch.randn(batch, cfg.obs_steps, STATE_DIM),
        CAMERA: torch.randint(0, 256, (batch, cfg.obs_steps, side, side, 3), dtype=torch.uint8),
    }
    return {"obs": obs, "action": torch.rand(batch, cfg.horizon_steps, ACT_DIM) * 2 - 1}


def bench(name: str, cfg, args) -> None:
    policy = make(cfg, args.side)
    opt = torch.optim.AdamW(policy.parameters(), lr=1e-4)
    data = batch_of(cfg, args.batch, args.side)
    policy.train()
    for i in range(args.steps + 2):  # two warm-up steps
        if i == 2:
            t0 = time.perf_counter()
        loss, _ = policy.loss(data)
        opt.zero_grad()
        loss.backward()
        opt.step()
        policy.on_train_step_end()
    rate = args.steps * args.batch / (time.perf_counter() - t0)
    policy.eval()
    one = batch_of(cfg, 1, args.side)["obs"]
    policy.predict_chunk(one)
    t0 = time.perf_counter()
    for _ in range(args.steps):
        policy.predict_chunk(one)
    latency = (time.perf_counter() - t0) / args.steps * 1e3
    params = sum(p.numel() for p in policy.parameters() if p.requires_grad) / 1e6
    print(f"{name:<34} BC {rate:8.1f} samples/s   predict_chunk {latency:7.1f} ms   {params:5.1f} M trainable")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--side", type=int, default=64)
    args = p.parse_args()
    torch.manual_seed(0)
    _, data = load_preset("policies", "diffusion_unet_rgb")
    base = from_dict(policy_config_class(data["type"]), data)
    print(f"torch threads {torch.get_num_threads()}, batch {args.batch}, {args.side}x{args.side} frames")
    enc = base.image_encoder
    bench("diffusion_unet_rgb (preset)", base, args)
    bench("  4 ResNet stages", dataclasses.replace(base, image_encoder=dataclasses.replace(enc, stages=4)), args)
    bench("  obs_steps 1", dataclasses.replace(base, obs_steps=1), args)
    bench("  MLP backbone", dataclasses.replace(base, backbone="mlp", hidden_dims=(512, 512, 512)), args)
    state_only = dataclasses.replace(base, obs_keys=["state"])
    bench("  state only (no images)", state_only, args)


if __name__ == "__main__":
    main()
