"""The Policy contract (docs/design.md) and the registry that builds a policy from its config by name."""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from robotft.datasets.normalizer import Normalizer
from robotft.policies.vision import ImageEncoderConfig
from robotft.specs import EnvSpec

Obs = dict[str, torch.Tensor]
"""Observation history dict: each key `[B, obs_steps, *feature_shape]`, env units (not normalized)."""


@dataclasses.dataclass
class PolicyConfig:
    """Fields every policy has; subclasses add their own and register under `type`."""

    type: str = ""
    """Registered policy name, e.g. `diffusion_mlp`."""
    obs_keys: list[str] = dataclasses.field(default_factory=lambda: ["state"])
    """Observation keys the policy reads (docs/design.md fixed keys)."""
    obs_steps: int = 1
    """Observation history length T_o (the current step and T_o - 1 before it)."""
    horizon_steps: int = 8
    """Predicted chunk length H (env steps)."""
    act_steps: int = 4
    """Steps executed from each predicted chunk before re-planning (receding horizon)."""
    normalizer_mode: str = "minmax"
    """How states and actions are normalized: `minmax` (to [-1, 1]) or `meanstd`."""
    image_encoder: ImageEncoderConfig = dataclasses.field(default_factory=ImageEncoderConfig)
    """Encoder of the `rgb/<camera>` keys in `obs_keys` (robotft.policies.vision); unused without image keys."""

    def __post_init__(self) -> None:
        if not 1 <= self.act_steps <= self.horizon_steps:
            raise ValueError(
                f"policy.act_steps must be in [1, horizon_steps={self.horizon_steps}], got {self.act_steps}"
            )
        if self.obs_steps < 1:
            raise ValueError(f"policy.obs_steps must be >= 1, got {self.obs_steps}")

    @property
    def plan_every(self) -> int:
        """Env steps between the plan anchors the policy reads from its observations (`ChunkedEnv`'s `plan_every`);
        0: it reads none, as every policy that plans the chunks it executes."""
        return 0


class Policy(nn.Module, abc.ABC):
    """A chunked-action policy. Inputs and outputs are in env units; normalization is internal.

    Every policy can be rebuilt from `(config, spec, normalizer)` and its `state_dict`, which is all a
    checkpoint stores (see robotft.checkpoint).
    """

    config: PolicyConfig
    spec: EnvSpec
    normalizer: Normalizer

    @abc.abstractmethod
    def predict_chunk(self, obs: Obs, deterministic: bool = True) -> torch.Tensor:
        """Actions `[B, horizon_steps, act_dim]` in env units. `deterministic=True` turns exploration
        noise off (evaluation and deployment); the generative model's own sampling stays as trained."""

    @abc.abstractmethod
    def loss(self, batch: dict[str, Any]) -> tuple[torch.Tensor, dict[str, float]]:
        """BC loss on a batch `{"obs": Obs, "action": [B, H, act_dim]}` (env units) and scalar metrics."""

    def on_train_step_end(self) -> None:  # noqa: B027 - hook; only policies with EMA need it
        """Called after each optimizer step of BC training (EMA updates)."""

    def export_state_dict(self) -> dict[str, torch.Tensor]:
        """Weights to ship in `model.safetensors` (the EMA weights where EMA is kept)."""
        return self.state_dict()


PolicyFactory = Callable[[Any, EnvSpec, Normalizer], Policy]


@dataclasses.dataclass
class _Registered:
    config_cls: type
    factory: PolicyFactory


_REGISTRY: dict[str, _Registered] = {}


def register_policy(name: str, config_cls: type) -> Callable[[PolicyFactory], PolicyFactory]:
    """Register a policy constructor `(config, spec, normalizer) -> Policy` under `name`."""

    def deco(factory: PolicyFactory) -> PolicyFactory:
        _REGISTRY[name] = _Registered(config_cls, factory)
        return factory

    return deco


def policy_config_class(name: str) -> type:
    _import_builtin_policies()
    if name not in _REGISTRY:
        raise KeyError(f"unknown policy type {name!r}; registered: {sorted(_REGISTRY)}")
    return _REGISTRY[name].config_cls


def build_policy(config: Any, spec: EnvSpec, normalizer: Normalizer) -> Policy:
    """Construct the registered policy for `config.type`."""
    _import_builtin_policies()
    if config.type not in _REGISTRY:
        raise KeyError(f"unknown policy type {config.type!r}; registered: {sorted(_REGISTRY)}")
    return _REGISTRY[config.type].factory(config, spec, normalizer)


_BUILTINS = ("robotft.policies.diffusion", "robotft.policies.gaussian", "robotft.policies.residual", "robotft.policies.flow",
             "robotft.policies.meanflow", "robotft.policies.flow_vlm", "robotft.lerobot.policy",
             "robotft.policies.noise_steered")


def _import_builtin_policies() -> None:
    import importlib

    for module in _BUILTINS:
        importlib.import_module(module)
