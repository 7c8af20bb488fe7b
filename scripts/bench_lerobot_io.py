"""LeRobot interoperability throughput: LeRobotDataset.create → robotft import → robotft export → reload.

Builds a LeRobot v3.0 dataset (episodes x steps, one camera as H.264 video, a 7-D state and action) in a
temporary directory, then times `import_lerobot` (video decoding included) and `export_lerobot` (video encoding
included) and prints frames per second and the mean absolute image error after each video generation.

    python scripts/bench_lerobot_io.py --episodes 5 --steps 100 --size 96
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--episodes", type=int, default=5)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--size", type=int, default=96, help="square camera image side (pixels)")
    p.add_argument("--vcodec", default="h264")
    args = p.parse_args()

    from lerobot.datasets.lerobot_dataset import LeRobotDataset

    from robotft.datasets.store import ReplayBuffer
    from robotft.lerobot.dataset import export_lerobot, import_lerobot

    size, n = args.size, args.episodes * args.steps
    features = {
        "observation.state": {"dtype": "float32", "shape": (7,), "names": None},
        "action": {"dtype": "float32", "shape": (7,), "names": None},
        "observation.images.cam": {
            "dtype": "video",
            "shape": (size, size, 3),
            "names": ["height", "width", "channels"],
        },
    }
    yy, xx = np.mgrid[0:size, 0:size]
    rng = np.random.default_rng(0)

    def image(ep: int, t: int) -> np.ndarray:
        return np.stack([(xx + 3 * t) % 256, (yy + 7 * ep) % 256, (xx + yy + t) % 256], -1).astype(np.uint8)

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        t0 = time.perf_counter()
        ds = LeRobotDataset.create(
            "bench/src", fps=30, features=features, root=tmp / "src", vcodec=args.vcodec
        )
        for ep in range(args.episodes):
            for t in range(args.steps):
                ds.add_frame(
                    {
                        "observation.state": rng.normal(size=7).astype(np.float32),
                        "action": rng.normal(size=7).astype(np.float32),
                        "observation.images.cam": image(ep, t),
                        "task": "bench",
                    }
                )
            ds.save_episode()
        ds.finalize()
        t1 = time.perf_counter()
        import_lerobot(tmp / "src", tmp / "store.zarr")
        t2 = time.perf_counter()
        export_lerobot(tmp / "store.zarr", tmp / "out", "bench/out", vcodec=args.vcodec)
        t3 = time.perf_counter()
        originals = np.stack([image(ep, t) for ep in range(args.episodes) for t in range(args.steps)]).astype(
            float
        )
        imported = ReplayBuffer.open(tmp / "store.zarr").array("rgb/cam", in_memory=False)[:]
        back = LeRobotDataset("bench/out", root=tmp / "out")
        reloaded = np.stack([back[i]["observation.images.cam"].numpy() for i in range(back.num_frames)])
        reloaded = np.rint(reloaded * 255).transpose(0, 2, 3, 1)
    print(f"frames {n} ({args.episodes} episodes x {args.steps} steps, {size}x{size} RGB, {args.vcodec})")
    print(f"LeRobotDataset.create (LeRobot's own writer): {t1 - t0:6.2f} s  {n / (t1 - t0):7.1f} frames/s")
    print(f"robotft import (decode + zarr):               {t2 - t1:6.2f} s  {n / (t2 - t1):7.1f} frames/s")
    print(f"robotft export (LeRobot writer + encode):     {t3 - t2:6.2f} s  {n / (t3 - t2):7.1f} frames/s")
    print(f"mean abs image error after import:  {np.abs(imported - originals).mean():.2f} / 255")
    print(f"mean abs image error after re-encode: {np.abs(reloaded - originals).mean():.2f} / 255")


if __name__ == "__main__":
    main()
