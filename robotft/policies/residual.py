"""Residual policy: a frozen base policy plus a small Gaussian residual (ResiP, Ankile et al. 2024,
arXiv 2407.16677).

The base (any robotft policy, e.g. a BC diffusion policy) predicts a chunk `[H, A]` as it was trained; a
small MLP, zero-initialised so that the residual policy starts out *equal* to its base, adds a per-step
correction from (normalized observation history, normalized base action of that step):

    a_h = clip(a_h^base + s ⊙ r_h, low, high),   r_h ~ N(r_θ(o, a_h^base), diag(σ²)),

where s is the action scale of the residual's normalizer (r lives in normalized action units) and σ `[A]`
is a learned, bounded log-std. RL (residual PPO, residual SAC) trains only r_θ and σ; the base is frozen.

With `bound` b > 0 the residual is bounded instead (Policy Decorator, Yuan et al. 2024, arXiv 2412.13630, §4.2):
u_h ~ N(r_θ(o, a_h^base), diag(σ²)) and r_h = b · tanh(u_h), so |r| ≤ b whatever the actor learns. Samples,
log-densities and entropies then refer to u (the pre-squash residual); a PPO ratio over u equals the ratio over
r, since the tanh's Jacobian cancels.

One checkpoint holds everything: on the first build, `base_checkpoint` is read once and its policy config,
env spec and normalizer statistics are copied into `config.base` (and its weights into the residual's
`base.*` weights), so `robotft eval` on a residual checkpoint needs no flags and no other file.

Two ways to act. By default (open loop, a deviation from ResiP) the residual of every chunk step sees the
observation history at the chunk's start, plus a one-hot of the step's index h in the chunk so that it can
still correct each step differently, and the whole corrected chunk is executed. With `closed_loop` (ResiP's
design) the policy acts one env step at a time (`horizon_steps = act_steps = 1`): the base plans a chunk every
K = base `act_steps` env steps and executes it open loop as it was trained, while the residual re-observes at
every step and corrects the plan's current action h from the current observation:

    a_t = clip(a^base_h + s ⊙ r_t),   r_t ~ N(r_θ(o_t, h, a^base_h), diag(σ²)),   h = t mod K.

The base's plan is a function of the observation at the step it was made, which the env supplies with every
observation (`ChunkedEnv`'s plan anchors, `plan_every` = K): the policy keeps no per-env state, only a cache of
the last plans it computed (re-planned when an env's anchor changed), so the same policy object serves training
and evaluation envs alike.

Example:
    config = ResidualPolicyConfig(base_checkpoint="runs/bc", obs_steps=1, horizon_steps=8, act_steps=4)
    policy = build_policy(config, spec, normalizer)                 # config.base is now filled
    actions, sample, logprob = policy.sample_with_logprob({"state": s})  # s [B, 1, D]; for residual PPO
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
import torch.nn.functional as F

from robotft.checkpoint import read_checkpoint
from robotft.config import from_dict, to_dict
from robotft.datasets.normalizer import Normalizer
from robotft.envs.chunked import PLAN_PREFIX, PLAN_STEP_KEY
from robotft.policies.base import (
    Obs,
    Policy,
    PolicyConfig,
    build_policy,
    policy_config_class,
    register_policy,
)
from robotft.policies.denoising_chain import gaussian_logprob_elementwise, scaled_tanh_log_det
from robotft.policies.encoders import (
    BoundedLogStd,
    check_chunk,
    diagonal_gaussian_chunk_entropy,
    flatten_obs,
    low_dim_obs_shapes,
    mlp,
)
from robotft.specs import EnvSpec

_SHARED_FIELDS = ("obs_steps", "horizon_steps", "act_steps")


@dataclasses.dataclass
class ResidualPolicyConfig(PolicyConfig):
    """A frozen base policy plus a zero-initialised Gaussian residual MLP (ResiP)."""

    type: str = "residual"
    """Registered policy name."""
    base_checkpoint: str = ""
    """Checkpoint (or run directory) of the base policy; read once, when `base` is empty."""
    base: dict[str, Any] = dataclasses.field(default_factory=dict)
    """The base policy's `{"policy", "spec", "normalizer"}` (its config, env spec and normalizer statistics),
    filled from `base_checkpoint` on the first build; with it a residual checkpoint is self-contained."""
    hidden_dims: tuple[int, ...] = (256, 256)
    """Widths of the residual MLP's hidden layers (its output layer starts at zero)."""
    log_std_init: float = -2.0
    """Initial log σ of the residual (normalized action units)."""
    log_std_min: float = -5.0
    """Lower bound of log σ."""
    log_std_max: float = 0.0
    """Upper bound of log σ."""
    bound: float = 0.0
    """0: a Gaussian residual (ResiP); b > 0: the residual is b · tanh(u), at most b normalized action units
    (Policy Decorator's bounded residual)."""
    closed_loop: bool = False
    """False: the residual corrects a whole chunk from the chunk-start observation (open loop). True: ResiP's
    closed loop: one env step per call (`horizon_steps = act_steps = 1`), the base re-planning every `act_steps`
    of its own and the residual correcting each step from the current observation (module docstring)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.bound < 0:
            raise ValueError(f"policy.bound must be >= 0 (0: unbounded), got {self.bound}")
        if not self.base_checkpoint and not self.base:
            raise ValueError("policy.base_checkpoint must name the base policy's checkpoint")
        if not self.log_std_min < self.log_std_init < self.log_std_max:
            raise ValueError(
                f"policy.log_std_init must lie strictly inside (log_std_min, log_std_max) = "
                f"({self.log_std_min}, {self.log_std_max}), got {self.log_std_init}"
            )
        if not self.hidden_dims:
            raise ValueError("policy.hidden_dims must name at least one hidden layer")
        if self.closed_loop and (self.horizon_steps, self.act_steps) != (1, 1):
            raise ValueError("a closed-loop residual acts one env step per call: policy.horizon_steps and "
                             f"policy.act_steps must be 1, got {self.horizon_steps} and {self.act_steps}")

    @property
    def plan_every(self) -> int:
        """The base's `act_steps` for a closed-loop residual (it re-plans that often), else 0."""
        if not self.closed_loop:
            return 0
        if not self.base:
            raise ValueError("a closed-loop residual's plan length comes from its base; build the policy first")
        return int(self.base["policy"]["act_steps"])


# --- the embedded base -----------------------------------------------------------------------------


def _normalizer_record(normalizer: Normalizer) -> dict[str, Any]:
    """The normalizer statistics as JSON lists (float32 → Python float → JSON round-trips exactly)."""
    return {"tensors": {name: t.tolist() for name, t in normalizer.to_tensors().items()},
            "metadata": normalizer.metadata()}


def base_record(path: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Read a base checkpoint: `(record for config.base, its shipped weights)`."""
    ckpt = read_checkpoint(path)
    record = {"policy": ckpt.config["policy"], "spec": ckpt.config["spec"],
              "normalizer": _normalizer_record(ckpt.normalizer)}
    return record, ckpt.model_state


def policy_record(policy: Policy) -> dict[str, Any]:
    """The `{"policy", "spec", "normalizer"}` record of an in-memory policy, as `build_base` reads it."""
    return {"policy": to_dict(policy.config), "spec": policy.spec.to_dict(),
            "normalizer": _normalizer_record(policy.normalizer)}


def build_base(record: dict[str, Any]) -> Policy:
    """Rebuild the base policy (random weights) from a `config.base` record."""
    missing = [k for k in ("policy", "spec", "normalizer") if k not in record]
    if missing:
        raise KeyError(f"policy.base is missing {missing}; expected the record written from base_checkpoint")
    cfg = from_dict(
        policy_config_class(record["policy"]["type"]), record["policy"], where="policy.base.policy"
    )
    tensors = {
        name: torch.tensor(v, dtype=torch.float32) for name, v in record["normalizer"]["tensors"].items()
    }
    normalizer = Normalizer.from_tensors(tensors, record["normalizer"]["metadata"])
    return build_policy(cfg, EnvSpec.from_dict(record["spec"]), normalizer)


# --- policy ----------------------------------------------------------------------------------------


class ResidualPolicy(Policy):
    """Frozen `base` + Gaussian residual over `[B, H, A]` chunks; see the module docstring."""

    def __init__(self, config: ResidualPolicyConfig, spec: EnvSpec, normalizer: Normalizer, base: Policy):
        super().__init__()
        self.config, self.spec, self.normalizer = config, spec, normalizer
        self.obs_shapes = low_dim_obs_shapes(config, spec, normalizer, "residual")
        self.act_dim = spec.action.dim
        self._check_base(base)
        self.base = base.requires_grad_(False).eval()
        obs_dim = sum(math.prod(shape) for shape in self.obs_shapes.values())
        # The step one-hot: of the chunk step h (open loop) or of the step h in the base's plan (closed loop).
        steps = base.config.act_steps if config.closed_loop else config.horizon_steps
        self.residual_net = mlp(obs_dim + steps + self.act_dim, tuple(config.hidden_dims), self.act_dim)
        torch.nn.init.zeros_(self.residual_net[-1].weight)
        torch.nn.init.zeros_(self.residual_net[-1].bias)
        self.log_std = BoundedLogStd(
            self.act_dim, config.log_std_init, config.log_std_min, config.log_std_max
        )
        self.register_buffer("step_onehot", torch.eye(steps), persistent=False)  # [steps, steps]
        self._plan_cache: tuple[Obs, torch.Tensor] | None = None
        """Closed loop: the anchors and base plans `[B, K, A]` of the last call (re-planned when an anchor changes)."""
        self.register_buffer(
            "action_low", torch.tensor(spec.action.low, dtype=torch.float32), persistent=False
        )
        self.register_buffer(
            "action_high", torch.tensor(spec.action.high, dtype=torch.float32), persistent=False
        )

    def _check_base(self, base: Policy) -> None:
        shared = ("obs_steps",) if self.config.closed_loop else _SHARED_FIELDS
        diff = [
            f"{f}: base {getattr(base.config, f)} vs residual {getattr(self.config, f)}"
            for f in shared
            if getattr(base.config, f) != getattr(self.config, f)
        ]
        if base.spec.action is None or base.spec.action.dim != self.act_dim:
            diff.append(f"action dim: base {base.spec.action and base.spec.action.dim} vs env {self.act_dim}")
        if not set(base.config.obs_keys) <= set(self.config.obs_keys):
            diff.append(f"obs_keys: base reads {base.config.obs_keys}, residual gets {self.config.obs_keys}")
        if diff:
            raise ValueError(f"residual policy does not fit its base ({'; '.join(diff)})")

    def train(self, mode: bool = True) -> ResidualPolicy:
        """Train mode for the residual; the frozen base always stays in eval mode."""
        super().train(mode)
        self.base.eval()
        return self

    # --- the pieces ---

    @torch.no_grad()
    def base_chunk(self, obs: Obs, generator: torch.Generator | None = None) -> torch.Tensor:
        """The base's actions `[B, H, A]` in env units for this call, sampled as the base evaluates
        (deterministic): its chunk (open loop), or the current step of its plan (closed loop, H = 1)."""
        if not self.config.closed_loop:
            return self.base.predict_chunk(obs, deterministic=True, generator=generator)
        plan = self.base_plan(obs, generator)
        return plan[torch.arange(plan.shape[0], device=plan.device), self.plan_step(obs)][:, None]

    @torch.no_grad()
    def base_plan(self, obs: Obs, generator: torch.Generator | None = None) -> torch.Tensor:
        """`[B, K, A]` the base's plans from the observations' plan anchors, recomputed when an anchor differs from
        the last call's (a plan is a function of its anchor; the cache only saves recomputing it). Always for the
        whole batch: a row computed in a batch of another size can differ in the last bits, and contact-rich tasks
        amplify that, so a zero residual then would not replay its base's evaluation exactly."""
        keys = self.base.config.obs_keys
        missing = [PLAN_PREFIX + k for k in keys if PLAN_PREFIX + k not in obs]
        if missing:
            raise KeyError(f"a closed-loop residual reads its base's plan anchors {missing} from the observation; "
                           f"run it on ChunkedEnv.for_policy(env, policy.config) (plan_every = {self.config.plan_every})")
        anchor = {k: obs[PLAN_PREFIX + k] for k in keys}
        cached = self._plan_cache
        if cached is not None and all(
            cached[0][k].shape == anchor[k].shape and cached[0][k].device == anchor[k].device
            and torch.equal(cached[0][k], anchor[k]) for k in keys
        ):
            return cached[1]
        plan = self.base.predict_chunk(anchor, deterministic=True, generator=generator)[:, : self.config.plan_every]
        self._plan_cache = ({k: v.clone() for k, v in anchor.items()}, plan)
        return plan

    def plan_step(self, obs: Obs) -> torch.Tensor:
        """`[B]` long: the index h of the current step in the base's plan (closed loop)."""
        return obs[PLAN_STEP_KEY][:, -1, 0].long()

    def plan_step_onehot(self, obs: Obs) -> torch.Tensor:
        """`[B, K]` a one-hot of the current step h in the base's plan (closed loop)."""
        return self.step_onehot[self.plan_step(obs)]

    def residual_mean(self, obs: Obs, base_action: torch.Tensor) -> torch.Tensor:
        """r_θ(o, h, a^base_h) `[B, H, A]` (normalized action units) for base actions `[B, H, A]` in env units.
        The MLP sees, per step h, the observation history, a one-hot of h and the normalized base action of
        step h: h is the chunk step (open loop, the chunk-start history) or the plan step (closed loop, H = 1,
        the current history)."""
        check_chunk("base_action", base_action, self.config.horizon_steps, self.act_dim)
        batch, horizon = base_action.shape[:2]
        cond = flatten_obs(obs, self.obs_shapes, self.normalizer)[:, None].expand(-1, horizon, -1)
        if self.config.closed_loop:
            step = self.plan_step_onehot(obs)[:, None]
        else:
            step = self.step_onehot[None].expand(batch, -1, -1)
        return self.residual_net(
            torch.cat([cond, step, self.normalizer.normalize("action", base_action)], dim=-1)
        )

    def std(self) -> torch.Tensor:
        """σ `[A]` of the residual, normalized action units."""
        return self.log_std().exp()

    def squash(self, residual: torch.Tensor) -> torch.Tensor:
        """r = b · tanh(u) with `bound` b > 0; the residual itself when unbounded."""
        bound = self.config.bound
        return bound * torch.tanh(residual) if bound > 0 else residual

    def squash_log_det(self, residual: torch.Tensor) -> torch.Tensor:
        """Per-entry log |dr/du| `[B, H, A]` of r = b · tanh(u); 0 when unbounded."""
        bound = self.config.bound
        return scaled_tanh_log_det(residual, bound) if bound > 0 else torch.zeros_like(residual)

    def to_actions(self, base_action: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """a = clip(a^base + s ⊙ squash(r)) `[B, H, A]` env units, clipped to the action spec's [low, high] (in
        env units, so a zero residual returns an in-bounds base chunk bit for bit)."""
        scale = self.normalizer.scale["action"].to(base_action.device)
        return torch.clamp(base_action + scale * self.squash(residual), self.action_low, self.action_high)

    # --- evaluation and RL ---

    @torch.no_grad()
    def predict_chunk(
        self, obs: Obs, deterministic: bool = True, *, generator: torch.Generator | None = None
    ) -> torch.Tensor:
        """Actions `[B, H, A]` env units: base chunk plus the mean residual (`deterministic`) or a sampled one.
        `generator` seeds the base's sampling (and the residual's noise)."""
        if not deterministic:
            return self.sample_with_logprob(obs, generator=generator)[0]
        base_action = self.base_chunk(obs, generator)
        return self.to_actions(base_action, self.residual_mean(obs, base_action))

    @torch.no_grad()
    def sample_with_logprob(
        self, obs: Obs, *, generator: torch.Generator | None = None
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
        """Sample a residual. Returns `(actions [B, H, A] env units, sample, logprob [B])`; `sample` is
        `{"base_action": [B, H, A] env units, "residual": [B, H, A] normalized, unclipped}`, what `logprob`
        needs to re-score the action (the base may itself be stochastic, so its chunk is stored)."""
        base_action = self.base_chunk(obs, generator)
        mean, std = self.residual_mean(obs, base_action), self.std()
        residual = mean + std * torch.randn(mean.shape, generator=generator, device=mean.device)
        logprob = gaussian_logprob_elementwise(residual, mean, std).sum(dim=(1, 2))
        sample = {"base_action": base_action, "residual": residual}
        return self.to_actions(base_action, residual), sample, logprob

    def elementwise_logprob(self, obs: Obs, sample: dict[str, torch.Tensor]) -> torch.Tensor:
        """Per-entry log N(r; r_θ(o, a^base), σ²) `[B, H, A]` with gradients into the residual only."""
        check_chunk("sample['residual']", sample["residual"], self.config.horizon_steps, self.act_dim)
        mean = self.residual_mean(obs, sample["base_action"])
        return gaussian_logprob_elementwise(sample["residual"], mean, self.std())

    def logprob(self, obs: Obs, sample: dict[str, torch.Tensor]) -> torch.Tensor:
        """log π(r | o, a^base) `[B]`: the diagonal Gaussian's log-density summed over H × A (Bishop 2006,
        PRML eq. 2.43). `sample` as returned by `sample_with_logprob`."""
        return self.elementwise_logprob(obs, sample).sum(dim=(1, 2))

    def entropy(self, obs: Obs) -> torch.Tensor:
        """Entropy of the residual's Gaussian `[B]`: H · Σ_a (log σ_a + ½ log 2πe)."""
        batch = next(iter(obs.values())).shape[0]
        return diagonal_gaussian_chunk_entropy(self.log_std(), self.config.horizon_steps, batch)

    # --- BC ---

    def loss(self, batch: dict[str, Any]) -> tuple[torch.Tensor, dict[str, float]]:
        """BC of the residual mean to the demonstrations' offset from the base: MSE of r_θ(o, a^base) against
        (a^demo - a^base) / s (normalized units). `batch`: `{"obs": Obs, "action": [B, H, A]}` env units.
        Residual policies usually start at zero and are trained by RL instead."""
        if self.config.closed_loop:
            raise ValueError("BC of a closed-loop residual needs each sample's base plan, which demonstrations do not "
                             "carry; train it with RL (residual_ppo_step) or use an open-loop residual")
        check_chunk("batch['action']", batch["action"], self.config.horizon_steps, self.act_dim)
        base_action = self.base_chunk(batch["obs"])
        target = (batch["action"] - base_action) / self.normalizer.scale["action"].to(base_action.device)
        loss = F.mse_loss(self.squash(self.residual_mean(batch["obs"], base_action)), target)
        return loss, {"bc_loss": loss.item()}


@register_policy("residual", ResidualPolicyConfig)
def build_residual_policy(
    config: ResidualPolicyConfig, spec: EnvSpec, normalizer: Normalizer
) -> ResidualPolicy:
    """The registered factory.

    With `config.base` empty, reads `config.base_checkpoint`, loads the base's weights and writes the base's
    record into `config.base` *in place*, so that whoever saves this config object (`robotft pretrain`
    saves the one it built from) saves a self-contained one. With `config.base` filled, the base is rebuilt
    from it and its weights come with the residual's (`base.*`), as `robotft.checkpoint.load_policy` does.
    """
    if config.base:
        return ResidualPolicy(config, spec, normalizer, build_base(config.base))
    record, weights = base_record(config.base_checkpoint)
    base = build_base(record)
    base.load_state_dict(weights)
    config.base = record
    return ResidualPolicy(config, spec, normalizer, base)


def wrap_residual(base: Policy, hidden_dims: tuple[int, ...], log_std_init: float,
                  bound: float = 0.0, closed_loop: bool = False) -> ResidualPolicy:
    """A zero-initialised residual (bounded by `bound` when > 0; ResiP's per-step closed loop with `closed_loop`)
    over an in-memory base (its weights kept, frozen): fine-tuning a plain BC checkpoint with a residual algorithm
    starts exactly at the base."""
    c = base.config
    steps = (1, 1) if closed_loop else (c.horizon_steps, c.act_steps)
    cfg = ResidualPolicyConfig(base=policy_record(base), obs_keys=[k for k in c.obs_keys if not k.startswith(
        ("rgb/", "depth/"))], obs_steps=c.obs_steps, horizon_steps=steps[0], act_steps=steps[1],
        normalizer_mode=c.normalizer_mode, hidden_dims=tuple(hidden_dims), log_std_init=log_std_init, bound=bound,
        closed_loop=closed_loop)
    return ResidualPolicy(cfg, base.spec, base.normalizer, base)
