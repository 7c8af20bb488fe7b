"""What a fine-tuning algorithm tells the PPO core: how actions are sampled and scored, and the registry.

The PPO core (robotft.rl.ppo) owns rollouts, GAE, the critic and the clipped objective. An algorithm
file (ppo for Gaussian policies, dppo, reinflow, flow_sde, residual_ppo) only implements this class and
registers it with `@register_algorithm`: adding an algorithm is adding one file to robotft/rl/ (its config
dataclass becomes the `robotft finetune` section named like the algorithm, e.g. `--dppo.clip_eps_base`).
An action may be scored as K transitions (DPPO scores K denoising steps of one chunk); the core then
computes a ratio per transition and weights the chunk's advantage per transition.
"""

from __future__ import annotations

import abc
import dataclasses
import importlib
import pkgutil
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from robotft.envs.base import Obs
from robotft.policies.base import Policy


@dataclass
class ActOutput:
    """One batched action sample."""

    actions: torch.Tensor
    """`[B, horizon_steps, act_dim]` in env units, what the env executes."""
    sample: dict[str, torch.Tensor]
    """Tensors `[B, ...]` that `logprob` needs to re-score this action later (stored in the buffer)."""
    logprob: torch.Tensor
    """`[B, K]` log-probabilities of the K scored transitions, as used in the PPO ratio."""


class Algorithm(abc.ABC):
    """Sampling and scoring rules of one fine-tuning algorithm over a policy.

    `rl_defaults` are the algorithm's own values for the PPO core's `rl.` fields, from its paper or reference
    code; `FinetuneConfig.for_algorithm` applies them under the user's flags, so `--algo X` alone is a sound
    run and the resolved values are saved with it."""

    name: str
    """The `--algo` name, also the name of the config section."""
    config_cls: ClassVar[type]
    """The dataclass of the algorithm's own settings (the FinetuneConfig section named `name`)."""
    policy: Policy
    critic_extra_dim: int = 0
    """Width of `critic_extra`'s output; 0 when the critic sees the observation only."""
    rl_defaults: ClassVar[dict[str, Any]] = {}
    """PPO-core fields (`rl.<field>`) this algorithm sets differently from PPOConfig's defaults."""
    exploration_flags: ClassVar[str] = ""
    """The flags that set this algorithm's exploration noise, named when exploring breaks the starting policy."""
    logprob_reduction: str = "mean"
    """`mean` or `sum` over a transition's entries, or `none`: a class's own is its `rl_defaults`' (`mean`, the PPO
    core's, where they do not say), and `make_algorithm` sets a run's from `rl.logprob_reduction`."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        # So that an algorithm built directly (library use, unit tests) scores as its runs do by default.
        cls.logprob_reduction = cls.rl_defaults.get("logprob_reduction", Algorithm.logprob_reduction)

    def reduce_entries(self, logprob: torch.Tensor) -> torch.Tensor:
        """`[N, K, ...]` per-entry log-densities → `[N, K]`: their mean or sum (`logprob_reduction`); with `none`,
        `[N, K · E]`, every entry kept (transition-major), for the PPO core to clip one by one."""
        if self.logprob_reduction == "none":
            return logprob.flatten(start_dim=1)
        flat = logprob.flatten(start_dim=2)
        return flat.mean(dim=-1) if self.logprob_reduction == "mean" else flat.sum(dim=-1)

    @abc.abstractmethod
    def act(self, obs: Obs, deterministic: bool = False) -> ActOutput:
        """Sample actions for a batch of observation histories (no gradients needed)."""

    @abc.abstractmethod
    def logprob(self, obs: Obs, sample: dict[str, torch.Tensor]) -> torch.Tensor:
        """`[N, K]` log-probabilities of stored samples under the current parameters (with gradients)."""

    def actor_parameters(self) -> list[nn.Parameter]:
        """Exactly the parameters the policy loss trains (frozen parts excluded): by default the policy's
        parameters that require gradients."""
        return [p for p in self.policy.parameters() if p.requires_grad]

    def num_scored(self) -> int:
        """K, the number of scored transitions per action."""
        return 1

    def advantage_weights(self) -> torch.Tensor:
        """`[K]` multipliers on the chunk advantage per transition (DPPO's denoising discount)."""
        return torch.ones(self.num_scored())

    def clip_coefs(self, clip_eps: float) -> torch.Tensor:
        """`[K]` PPO clip ranges per transition."""
        return torch.full((self.num_scored(),), clip_eps)

    def critic_extra(self, obs: Obs, sample: dict[str, torch.Tensor] | None) -> torch.Tensor | None:
        """Extra critic input `[B, critic_extra_dim]` beside the observation (residual PPO: the base action);
        `sample` is None for an observation nothing was sampled at yet (bootstrapping). None by default."""
        return None

    def extra_loss(self, obs: Obs, sample: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
        """Additional actor loss terms (entropy bonus, BC regularizer); zero by default."""
        return torch.zeros((), device=next(iter(obs.values())).device), {}

    def state_dict(self) -> dict[str, Any]:
        """Algorithm state beyond the policy weights (e.g. a learned noise net), for resume."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:  # noqa: B027 - stateless by default
        """Restore `state_dict()`."""


ALGORITHMS: dict[str, type[Algorithm]] = {}
"""`--algo` name → algorithm class, filled by `@register_algorithm`; read it through `registered_algorithms()`."""


def register_algorithm(cls: type[Algorithm]) -> type[Algorithm]:
    """Class decorator: register an Algorithm subclass under its `name`, with its `config_cls` section."""
    if not isinstance(getattr(cls, "name", None), str) or not dataclasses.is_dataclass(getattr(cls, "config_cls", None)):
        raise TypeError(f"{cls.__name__}: a registered algorithm needs a `name` and a dataclass `config_cls`")
    if cls.name in ALGORITHMS and ALGORITHMS[cls.name] is not cls:
        raise ValueError(f"algorithm {cls.name!r} registered twice: {ALGORITHMS[cls.name]} and {cls}")
    ALGORITHMS[cls.name] = cls
    return cls


def registered_algorithms() -> dict[str, type[Algorithm]]:
    """Every registered algorithm, after importing each module of robotft/rl (where they register)."""
    import robotft.rl

    for module in pkgutil.iter_modules(robotft.rl.__path__):
        importlib.import_module(f"robotft.rl.{module.name}")
    return ALGORITHMS
