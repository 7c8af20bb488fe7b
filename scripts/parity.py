"""Step ManiSkill and the simulated rig side by side and print the per-segment observation error.

    python scripts/parity.py --env maniskill/push_cube --rig sim_franka --steps 60 [--actions random|pick]
        [--control-mode pd_ee_delta_pos] [--seeds 0 1 2] [--json out.json]

See robotft.real_robot.parity for what is compared and how.
"""

from __future__ import annotations

import argparse
import json
import logging

import numpy as np

from robotft.real_robot.parity import ACTION_SOURCES, parity


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--env", default="maniskill/push_cube", help="env preset (ManiSkill, state observations)")
    p.add_argument("--rig", default="sim_franka", help="simulated rig preset")
    p.add_argument("--steps", type=int, default=60, help="control steps per run")
    p.add_argument("--seeds", type=int, nargs="+", default=[0], help="ManiSkill reset seeds, one run each")
    p.add_argument("--actions", choices=sorted(ACTION_SOURCES), default="scripted")
    p.add_argument("--control-mode", default=None, help="override the env preset's control mode")
    p.add_argument("--every", type=int, default=10, help="print every N-th step")
    p.add_argument("--json", default=None, help="also write the per-step errors here")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    report = {}
    for seed in args.seeds:
        result = parity(args.env, args.rig, args.steps, seed, args.actions, args.control_mode)
        print(
            f"seed {seed}: success ManiSkill={result.success[0]} rig={result.success[1]}; "
            f"safety {result.safety_counters or 'none'}"
        )
        print(result.table(args.every))
        report[seed] = {k: v.tolist() for k, v in result.errors.items()}
    if len(args.seeds) > 1:
        print(
            "max over seeds:",
            json.dumps(
                {
                    k: round(max(float(np.max(report[s][k])) for s in report), 4)
                    for k in next(iter(report.values()))
                }
            ),
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f)


if __name__ == "__main__":
    main()
