"""Where fine-tuning rollouts are collected: in the learner's process, or on Ray env workers.

`robotft finetune --rollout.backend ray [--rollout.address HOST:PORT]` runs `rollout.num_workers` Ray actors
(on any node of the cluster; a local Ray instance when no address is given), each owning a slice of
`rollout.envs_per_worker` envs built by robotft's `make_env` (ManiSkill CPU, the toy suite, any backend) and
a copy of the policy, the algorithm and the critic. Every iteration the learner puts its weights into the
object store once (`ray.put`), every worker loads them and runs the PPO core's own `collect` on its slice
(sampling, values, truncation bootstrapping, exactly as in-process), and the learner concatenates the slices
along the env axis into one RolloutBuffer. Worker w's envs have the global ids `w * envs_per_worker + i` and
are seeded as those envs would be in one process; its sampling noise is seeded by (seed, worker, iteration),
so a slice is reproducible.

A worker that dies (its process or node lost: RayActorError) is detected when its slice is collected; it
is replaced by a fresh actor and its slice of this iteration is collected again, so the run continues
(`rollout.max_restarts` replacements of one worker within one iteration before the run gives up).

Weights and rollouts cross the object store as safetensors bytes and JSON, not as pickled tensors.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from robotft.checkpoint import flatten_state, unflatten_state
from robotft.optional import require
from robotft.rl.buffer import RolloutBuffer

if TYPE_CHECKING:
    from robotft.datasets.normalizer import Normalizer
    from robotft.finetune import FinetuneConfig
    from robotft.policies.base import PolicyConfig
    from robotft.rl.ppo import PPO, RolloutStats
    from robotft.specs import EnvSpec

BACKENDS = ("inprocess", "ray")


@dataclasses.dataclass
class RolloutConfig:
    """Where the fine-tuning rollouts run (`--rollout.backend ray --rollout.address ADDR`)."""

    backend: str = "inprocess"
    """`inprocess`: the learner steps `env.num_envs` envs itself (ManiSkill GPU, or CPU worker processes on this
    machine). `ray`: Ray actors step `num_workers × envs_per_worker` envs, on any node of a Ray cluster."""
    address: str = ""
    """Ray cluster to join (`HOST:6379`, `ray://HOST:10001` or `auto`); empty starts a local Ray instance
    (dashboard off) for this run. Ignored by `inprocess`."""
    num_workers: int = 2
    """Ray env workers (actors)."""
    envs_per_worker: int = 1
    """Envs each worker steps; with ManiSkill on CPU, more than 1 starts that many processes per worker."""
    cpus_per_worker: float = 1.0
    """CPUs Ray reserves for each worker (fractions pack several workers on one CPU)."""
    max_restarts: int = 3
    """Replacements of one worker within one iteration before the run stops with an error."""

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"rollout.backend {self.backend!r}: expected one of {BACKENDS}")
        for name in ("num_workers", "envs_per_worker"):
            if getattr(self, name) < 1:
                raise ValueError(f"rollout.{name} must be >= 1, got {getattr(self, name)}")
        if self.cpus_per_worker <= 0 or self.max_restarts < 0:
            raise ValueError(f"rollout.cpus_per_worker must be > 0 and rollout.max_restarts >= 0, got "
                             f"{self.cpus_per_worker} and {self.max_restarts}")

    @property
    def num_envs(self) -> int:
        """Envs stepped per iteration by the Ray workers together."""
        return self.num_workers * self.envs_per_worker


# -- (de)serialisation: nested tensor state <-> safetensors bytes + JSON skeleton ---------------------


def pack_state(state: dict[str, Any]) -> tuple[bytes, str]:
    """A nested dict of tensors (and plain values) as safetensors bytes plus a JSON skeleton."""
    tensors: dict[str, torch.Tensor] = {}
    skeleton = flatten_state(state, "s", tensors)
    return st_save(tensors), json.dumps(skeleton)


def unpack_state(packed: tuple[bytes, str]) -> dict[str, Any]:
    """Inverse of `pack_state`."""
    data, skeleton = packed
    return unflatten_state(json.loads(skeleton), st_load(data))


def learner_weights(ppo: PPO) -> dict[str, Any]:
    """Everything a worker needs to act and evaluate values like the learner: policy, critic, algorithm state."""
    return {"policy": ppo.algo.policy.state_dict(), "critic": ppo.critic.state_dict(), "algo": ppo.algo.state_dict()}


def worker_setup(cfg: FinetuneConfig, policy_cfg: PolicyConfig, spec: EnvSpec,
                 normalizer: Normalizer) -> dict[str, Any]:
    """What every RolloutWorker is built from (JSON-able configs and the packed normalizer): the finetune
    config `cfg` with its env sized to one worker's slice on CPU, the policy config, the env spec."""
    from robotft.config import to_dict

    worker_cfg = dataclasses.replace(cfg, env=dataclasses.replace(cfg.env, num_envs=cfg.rollout.envs_per_worker),
                                     device="cpu")
    return {"finetune": to_dict(worker_cfg), "policy": to_dict(policy_cfg), "spec": spec.to_dict(),
            "normalizer": (st_save(normalizer.to_tensors()), normalizer.metadata())}


# -- the worker: one slice of envs and a copy of the actor-critic -------------------------------------


def worker_seed(seed: int, worker: int, envs_per_worker: int) -> int:
    """The PPO seed of worker `worker`: its envs then get the seeds of global env ids
    `worker * envs_per_worker + i`, as in one process with all the envs."""
    return seed + worker * envs_per_worker


def sampling_seed(seed: int, worker: int, iteration: int) -> int:
    """The torch seed a worker samples actions with in `iteration` (the same after a replacement)."""
    return (seed * 1_000_003 + worker * 10_007 + iteration) % (2**63)


class RolloutWorker:
    """Holds `envs_per_worker` envs and a copy of policy, algorithm and critic; collects one slice per call.

    `setup` is what `RayCollector` sends: the finetune config (its `env` already sized to the slice), the
    policy config, the env spec, the packed normalizer and this worker's index and seed. Runs as a Ray actor;
    a plain object in tests that need no Ray."""

    def __init__(self, setup: dict[str, Any]) -> None:
        from robotft.config import from_dict
        from robotft.datasets.normalizer import Normalizer
        from robotft.envs.chunked import ChunkedEnv
        from robotft.envs.factory import make_env
        from robotft.finetune import FinetuneConfig, make_algorithm, make_critic
        from robotft.policies.base import build_policy, policy_config_class
        from robotft.rl.ppo import PPO
        from robotft.specs import EnvSpec

        torch.set_num_threads(1)  # one core per worker; several torch threads per worker oversubscribe
        cfg = from_dict(FinetuneConfig, setup["finetune"])
        spec = EnvSpec.from_dict(setup["spec"])
        tensors, metadata = setup["normalizer"]
        normalizer = Normalizer.from_tensors(st_load(tensors), metadata)
        policy_cfg = from_dict(policy_config_class(setup["policy"]["type"]), setup["policy"])
        policy = build_policy(policy_cfg, spec, normalizer)
        algo = make_algorithm(cfg.algo, policy, cfg)
        critic = make_critic(policy, spec, normalizer, cfg, algo)
        self.worker, self.seed = int(setup["worker"]), int(setup["seed"])
        self.env = make_env(cfg.env, device="cpu")
        chunked = ChunkedEnv.for_policy(self.env, policy.config)
        self.ppo = PPO(algo, critic, chunked, cfg.rl, seed=self.seed)

    def collect(self, iteration: int, weights: tuple[bytes, str]) -> tuple[bytes, str]:
        """Load the learner's weights and collect this slice's rollout of `iteration`, packed."""
        state = unpack_state(weights)
        ppo = self.ppo
        ppo.algo.policy.load_state_dict(state["policy"])
        ppo.critic.load_state_dict(state["critic"])
        ppo.algo.load_state_dict(state["algo"])
        ppo.iteration = iteration
        torch.manual_seed(sampling_seed(self.seed, self.worker, iteration))
        buf, next_value, stats = ppo.collect()
        return pack_state({
            "obs": buf.obs, "samples": buf.samples, "logprobs": buf.logprobs, "values": buf.values,
            "rewards": buf.rewards, "dones": buf.dones, "next_value": next_value,
            "stats": dataclasses.asdict(stats),
        })

    def close(self) -> None:
        """Release the simulator (worker processes, renderers)."""
        self.env.close()


def merge_slices(slices: list[dict[str, Any]], device: torch.device) -> tuple[RolloutBuffer, torch.Tensor,
                                                                               RolloutStats]:
    """Workers' unpacked rollouts, in worker order, as one buffer over all their envs (env axis 1)."""
    from robotft.rl.ppo import RolloutStats

    def cat(key: str) -> torch.Tensor:
        return torch.cat([s[key] for s in slices], dim=1).to(device)

    num_steps = slices[0]["rewards"].shape[0]
    buf = RolloutBuffer(num_steps, sum(s["rewards"].shape[1] for s in slices), device)
    buf.obs = {k: torch.cat([s["obs"][k] for s in slices], dim=1).to(device) for k in slices[0]["obs"]}
    buf.samples = {k: torch.cat([s["samples"][k] for s in slices], dim=1).to(device) for k in slices[0]["samples"]}
    buf.logprobs, buf.values, buf.rewards, buf.dones = cat("logprobs"), cat("values"), cat("rewards"), cat("dones")
    buf.step = num_steps
    next_value = torch.cat([s["next_value"] for s in slices]).to(device)
    stats = [s["stats"] for s in slices]
    merged = RolloutStats(
        env_steps=sum(s["env_steps"] for s in stats),
        episodes=sum(s["episodes"] for s in stats),
        successes=sum(s["successes"] for s in stats),
        episode_returns=[r for s in stats for r in s["episode_returns"]],
        seconds=max(s["seconds"] for s in stats),
        signal=any(s["signal"] for s in stats),
    )
    return buf, next_value, merged


# -- the learner's side -------------------------------------------------------------------------------


class RayCollector:
    """Ray env workers behind the PPO core's `collect`: `collect(ppo)` returns what `ppo.collect()` would for
    the workers' envs together. Joins (or starts) Ray on construction; `close()` ends the workers."""

    def __init__(self, rollout: RolloutConfig, setup: dict[str, Any], seed: int) -> None:
        """`setup`: the worker setup without `worker` and `seed` (see RolloutWorker); `seed`: the run's seed
        (this rank's under torchrun)."""
        ray = _import_ray()
        self.cfg = rollout
        self._started_ray = False
        if not ray.is_initialized():
            if rollout.address:
                ray.init(address=rollout.address, log_to_driver=True)
            else:
                # A private local instance: no dashboard; what Ray must serve it serves to this machine's jobs.
                ray.init(include_dashboard=False, dashboard_host="127.0.0.1", log_to_driver=True)
            self._started_ray = True
        self._actor_cls = ray.remote(num_cpus=rollout.cpus_per_worker, max_restarts=0)(RolloutWorker)
        self._setup, self._seed = setup, seed
        self.workers = [self._spawn(w) for w in range(rollout.num_workers)]
        self.replacements = 0
        """Workers replaced after a failure since the start of the run."""
        self._pending: list[Any] = []
        self._iteration = -1
        self._weights = None

    def _spawn(self, worker: int):
        setup = {**self._setup, "worker": worker, "seed": worker_seed(self._seed, worker, self.cfg.envs_per_worker)}
        return self._actor_cls.remote(setup)

    def collect(self, ppo: PPO) -> tuple[RolloutBuffer, torch.Tensor, RolloutStats]:
        """One iteration's rollout over all workers' envs; counts its env steps into `ppo.env_steps`.

        Under torchrun every rank owns its own workers; the stats are then summed over ranks as
        `PPO.collect` does."""
        t0 = time.perf_counter()
        self.submit(ppo.iteration, learner_weights(ppo))
        buf, next_value, stats = merge_slices(self.gather(), ppo.device)
        steps, episodes, successes = (int(v) for v in ppo.dist.sum([stats.env_steps, stats.episodes,
                                                                      stats.successes]))
        stats = dataclasses.replace(stats, env_steps=steps, episodes=episodes, successes=successes,
                                    episode_returns=ppo.dist.gather_lists(stats.episode_returns),
                                    seconds=time.perf_counter() - t0)
        ppo.env_steps += steps
        return buf, next_value, stats

    def submit(self, iteration: int, weights: dict[str, Any]) -> None:
        """Start every worker on its slice of `iteration` with `weights` (put into the object store once)."""
        ray = _import_ray()
        self._iteration = iteration
        self._weights = ray.put(pack_state(weights))
        self._pending = [w.collect.remote(iteration, self._weights) for w in self.workers]

    def gather(self) -> list[dict[str, Any]]:
        """The slices of the submitted iteration in worker order, replacing and re-running failed workers."""
        ray = _import_ray()
        from ray.exceptions import ActorUnavailableError, RayActorError

        slices = []
        for w, ref in enumerate(self._pending):
            for attempt in range(self.cfg.max_restarts + 1):
                try:
                    slices.append(unpack_state(ray.get(ref)))
                    break
                except (RayActorError, ActorUnavailableError) as e:
                    if attempt == self.cfg.max_restarts:
                        raise RuntimeError(f"rollout worker {w} failed {attempt + 1} times in iteration "
                                           f"{self._iteration} (rollout.max_restarts={self.cfg.max_restarts}); "
                                           f"last error: {e}") from e
                    ray.kill(self.workers[w], no_restart=True)
                    self.workers[w] = self._spawn(w)
                    self.replacements += 1
                    ref = self.workers[w].collect.remote(self._iteration, self._weights)
        self._pending = []
        return slices

    def close(self) -> None:
        """End the workers (and the local Ray instance this collector started)."""
        ray = _import_ray()
        for w in self.workers:
            # A dead or stuck worker cannot close its envs; it is killed below either way.
            with contextlib.suppress(Exception):
                ray.get(w.close.remote(), timeout=60)
            ray.kill(w, no_restart=True)
        self.workers = []
        if self._started_ray:
            ray.shutdown()


def _import_ray():
    return require("ray", "ray", "rollout.backend 'ray'")
