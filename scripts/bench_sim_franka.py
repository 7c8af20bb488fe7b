"""Measure the simulated Franka rig: physics step cost, real-time factor alone and next to a rendering
camera, render time per frame, IK time per `ee_pose` target.

    .venv/bin/python scripts/bench_sim_franka.py [--seconds 3] [--width 128] [--height 128] [--fps 10]

Prints one line per figure and a JSON object as its last line.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from robotft.real_robot.robot import RobotCommand
from robotft.real_robot.safety import SafetyLayer, SafetyLimits
from robotft.real_robot.sim_camera import SimCamera, SimCameraConfig
from robotft.real_robot.sim_franka import SimFranka, SimFrankaConfig
from robotft.real_robot.sim_scene import SimMarkerConfig, SimObjectConfig, SimSceneConfig


def push_cube_robot() -> SimFranka:
    scene = SimSceneConfig(
        objects=[SimObjectConfig("cube", pos=(0.615, 0.0, 0.02))],
        markers=[SimMarkerConfig("goal", size=(0.1, 0.001), pos=(0.2, 0.0, 0.001), relative_to="cube")],
    )
    return SimFranka(SimFrankaConfig(scene=scene), SafetyLayer(SafetyLimits(), 0.05, cameras=()))


def run_session(robot: SimFranka, seconds: float, camera: SimCamera | None) -> dict:
    """Drive a slow circle with `ee_pose` targets at 20 Hz for `seconds`; return the rig's figures."""
    with robot:
        robot.reset_episode(seed=0)
        home = robot.get_observation()
        if camera is not None:
            camera.connect()
        try:
            start = time.monotonic()
            while (now := time.monotonic()) - start < seconds:
                robot.safety.watchdog.heartbeat("policy", now)
                phase = 2 * np.pi * (now - start) / 2.0
                target = home.ee_pos + 0.05 * np.array([np.cos(phase) - 1, np.sin(phase), 0.0])
                robot.send_action(
                    RobotCommand("ee_pose", now + 0.05, 0.08, ee_pos=target, ee_quat=home.ee_quat)
                )
                time.sleep(0.05)
            out = {"realtime_factor": robot.realtime_factor, "skipped_s": robot.skipped_s}
            if camera is not None:
                out["frames"] = camera.latest().index + 1
                out["render_ms_median"] = 1e3 * float(np.median(camera.render_stats_s))
        finally:
            if camera is not None:
                camera.disconnect()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--height", type=int, default=128)
    parser.add_argument("--fps", type=float, default=10.0)
    args = parser.parse_args()

    t0 = time.perf_counter()
    robot = push_cube_robot()
    results: dict = {"build_s": time.perf_counter() - t0}
    print(f"model build: {results['build_s']:.2f} s")

    with robot._lock:  # the physics thread is not running: time raw steps
        n = 2000
        t0 = time.perf_counter()
        for _ in range(n):
            robot._step()
        results["step_us"] = 1e6 * (time.perf_counter() - t0) / n
    print(f"physics step incl. controller: {results['step_us']:.0f} us (1 kHz needs < 1000)")

    state = robot.get_observation()
    n = 50
    t0 = time.perf_counter()
    for i in range(n):
        robot.inverse_kinematics(state.ee_pos + [0.0, 0.001 * i, 0.0], state.ee_quat)
    results["ik_ms"] = 1e3 * (time.perf_counter() - t0) / n
    print(f"IK per ee_pose target: {results['ik_ms']:.2f} ms")

    results["alone"] = run_session(robot, args.seconds, None)
    print(f"real-time factor, physics alone: {results['alone']['realtime_factor']:.3f}")
    cam_cfg = SimCameraConfig(width=args.width, height=args.height, fps=args.fps)
    results["with_camera"] = run_session(robot, args.seconds, SimCamera("base", cam_cfg, robot))
    wc = results["with_camera"]
    print(
        f"with a {args.width}x{args.height} camera at {args.fps} fps: real-time factor "
        f"{wc['realtime_factor']:.3f}, {wc['frames']} frames in {args.seconds} s, "
        f"render {wc['render_ms_median']:.0f} ms/frame"
    )
    print(json.dumps(results))


if __name__ == "__main__":
    main()
