"""LeRobot policies behind robotft's Policy contract: a LeRobot `DiffusionPolicy` as the frozen base of a residual
policy (residual PPO), and a LeRobot **SmolVLA** (Shukor et al. 2025, arXiv 2506.01844: a SmolVLM2 backbone and a
flow-matching action expert) whose action expert robotft's Flow-Noise (`reinflow`) and Flow-SDE fine-tune.

Both are loaded from a local LeRobot `pretrained_model` directory with LeRobot's own `from_pretrained` and keep
LeRobot's own normalization: the statistics, feature types and normalization modes of the checkpoint's
`policy_preprocessor.json` normalizer step, applied by LeRobot's `NormalizerProcessorStep` /
`UnnormalizerProcessorStep`, so a policy acts in robotft exactly as it acts in LeRobot.

One robotft checkpoint holds everything (`import_lerobot_policy`): the LeRobot weights in `model.safetensors`
(under `lerobot.`), LeRobot's `config.json` and normalizer statistics as JSON in the robotft `config.json`, and
a robotft `normalizer.safetensors` with the same statistics (for the critic, ReinFlow's noise net and a residual
on top). No pickle, and the LeRobot directory is no longer needed. A SmolVLA checkpoint still names its VLM by
`vlm_model_name` (a local SmolVLM2 folder: LeRobot builds the VLM's config and tokenizer from it, as LeRobot
itself does); the VLM's weights are in the checkpoint.

SmolVLA as a robotft flow policy: SmolVLA integrates from t = 1 (noise) to t = 0 (data) with x_t = t ε + (1 - t) a
and v = ε - a; robotft's chain (robotft.policies.flow) runs τ = 1 - t from 0 to 1, so the robotft velocity is
-v(x, 1 - τ) and each robotft Euler step x + v_τ Δτ is SmolVLA's own step x + dt v (dt = -1/K). The prefix
(images, task tokens, state) goes through the frozen VLM once per chunk into a key-value cache (`KVPrefix`);
each Euler step runs only the action expert against that cache, as SmolVLA's `sample_actions` does. The latent
is SmolVLA's padded action `[B, chunk_size, max_action_dim]`; the env action is its first `act_dim` entries.
Trainable: the action expert (its transformer layers and the action in/out and action-time projections); the
VLM, its vision tower and the state projection (all inside the cached prefix) are frozen.

Example:
    import_lerobot_policy("outputs/train/smolvla/checkpoints/last/pretrained_model", "runs/smolvla_ckpt",
                          load_env_config("maniskill/pick_cube"), task="pick up the cube")
    # robotft finetune --from runs/smolvla_ckpt --algo reinflow ...
    # or a residual on a LeRobot diffusion base: policy preset {type: residual, base_checkpoint: runs/diff_ckpt}
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

from robotft.datasets.lerobot_io import DEFAULT_KEY_MAP, map_key
from robotft.datasets.normalizer import Normalizer
from robotft.policies.base import Obs, Policy, PolicyConfig, register_policy
from robotft.policies.encoders import check_chunk, low_dim_obs_shapes
from robotft.policies.flow import FlowPolicy
from robotft.specs import EnvSpec

SUPPORTED = ("diffusion", "smolvla")
"""LeRobot policy types this module wraps (LeRobot config.json `type`)."""
PREPROCESSOR_FILE = "policy_preprocessor.json"
_HINT = "install the extra: pip install -e .[lerobot] (then lerobot==0.4.4 with --no-deps)"
_EXPERT_PREFIXES = (
    "model.vlm_with_expert.lm_expert.",
    "model.action_in_proj.",
    "model.action_out_proj.",
    "model.action_time_mlp_in.",
    "model.action_time_mlp_out.",
)
"""SmolVLA parameters (names inside `SmolVLAPolicy`) that make up the action expert: the ones RL trains."""


class LeRobotCheckpointError(ValueError):
    """A LeRobot checkpoint directory is missing a file or holds something robotft cannot wrap."""


@dataclasses.dataclass
class LeRobotPolicyConfig(PolicyConfig):
    """A LeRobot policy (DiffusionPolicy or SmolVLA) wrapped as a robotft policy. `obs_keys`, `obs_steps`,
    `horizon_steps`, `act_steps` and `num_steps` are filled from the LeRobot config when it is read."""

    type: str = "lerobot"
    """Registered policy name."""
    pretrained_path: str = ""
    """A LeRobot `pretrained_model` directory (config.json, model.safetensors, policy_preprocessor.json + its
    normalizer state); read once, on the first build, when `lerobot` is empty."""
    lerobot: dict[str, Any] = dataclasses.field(default_factory=dict)
    """The LeRobot config.json of the policy (its `type` is diffusion or smolvla), filled from pretrained_path."""
    normalization: dict[str, Any] = dataclasses.field(default_factory=dict)
    """LeRobot's normalizer step: `{"features", "norm_map", "eps", "stats": {feature: {stat: nested list}}}`."""
    key_map: dict[str, str] = dataclasses.field(default_factory=dict)
    """LeRobot input feature → robotft observation key, on top of the dataset defaults (observation.state →
    state, observation.images.<cam> → rgb/<cam>); several LeRobot features may read one robotft key."""
    task: str = ""
    """Language instruction a VLA (SmolVLA) is given with every observation."""
    num_steps: int = 10
    """Euler steps K of a flow policy (SmolVLA's `num_steps`); unused by diffusion."""


# --- reading a LeRobot checkpoint ------------------------------------------------------------------


def _require_lerobot() -> None:
    try:
        import lerobot  # noqa: F401
    except ImportError as e:
        raise ImportError(f"LeRobot policies need lerobot: {_HINT}") from e


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise LeRobotCheckpointError(f"{path}: missing (expected in a LeRobot pretrained_model directory)")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise LeRobotCheckpointError(f"{path}: not valid JSON: {e}") from e


def read_lerobot_checkpoint(path: str | Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """`(config.json, normalizer step)` of a LeRobot pretrained_model directory; errors name the file."""
    from safetensors.torch import load_file

    path = Path(path)
    if not path.is_dir():
        raise LeRobotCheckpointError(
            f"{path}: not a directory (expected a LeRobot pretrained_model directory)"
        )
    config = _read_json(path / "config.json")
    if config.get("type") not in SUPPORTED:
        raise LeRobotCheckpointError(
            f"{path / 'config.json'}: policy type {config.get('type')!r}; robotft wraps {list(SUPPORTED)}"
        )
    if not (path / "model.safetensors").is_file():
        raise LeRobotCheckpointError(f"{path / 'model.safetensors'}: missing")
    steps = _read_json(path / PREPROCESSOR_FILE).get("steps", [])
    norm = [s for s in steps if s.get("registry_name") == "normalizer_processor"]
    if not norm or "state_file" not in norm[0]:
        raise LeRobotCheckpointError(
            f"{path / PREPROCESSOR_FILE}: no normalizer_processor step with a state_file (LeRobot >= 0.4 saves one)"
        )
    state_file = path / norm[0]["state_file"]
    if not state_file.is_file():
        raise LeRobotCheckpointError(f"{state_file}: missing (named by {PREPROCESSOR_FILE})")
    stats: dict[str, dict[str, Any]] = {}
    for name, tensor in load_file(state_file).items():
        feature, _, stat = name.rpartition(".")
        stats.setdefault(feature, {})[stat] = tensor.tolist()
    cfg = norm[0].get("config", {})
    normalization = {
        "features": cfg.get("features", {}),
        "norm_map": cfg.get("norm_map", {}),
        "eps": float(cfg.get("eps", 1e-8)),
        "stats": stats,
    }
    return config, normalization


def lerobot_config(data: dict[str, Any], **changes: Any) -> Any:
    """A LeRobot `PreTrainedConfig` from its config.json dict, parsed by LeRobot itself; `changes` set fields."""
    _require_lerobot()
    # Importing the modules registers the config classes under their `type`.
    import lerobot.policies.diffusion.configuration_diffusion  # noqa: F401
    import lerobot.policies.smolvla.configuration_smolvla  # noqa: F401
    from lerobot.configs.policies import PreTrainedConfig

    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(data))
        cfg = PreTrainedConfig.from_pretrained(tmp)
    for name, value in changes.items():
        setattr(cfg, name, value)
    return cfg


def _policy_class(kind: str) -> type:
    if kind == "diffusion":
        from lerobot.policies.diffusion.modeling_diffusion import DiffusionPolicy

        return DiffusionPolicy
    from lerobot.policies.smolvla.modeling_smolvla import SmolVLAPolicy

    return SmolVLAPolicy


def input_key_map(config: LeRobotPolicyConfig) -> dict[str, str]:
    """LeRobot input feature → robotft observation key for every input the LeRobot policy reads."""
    features = config.lerobot.get("input_features", {})
    table = {**DEFAULT_KEY_MAP, **config.key_map}
    out = {}
    for name in features:
        key = map_key(name, table)
        if not key:
            raise KeyError(
                f"policy.key_map: LeRobot input {name!r} maps to no robotft observation key; add it to key_map "
                f"(e.g. {{'{name}': 'state'}})"
            )
        out[name] = key
    return out


def fill_from_lerobot(config: LeRobotPolicyConfig) -> None:
    """Read `config.pretrained_path` into `config.lerobot` / `config.normalization` and set the robotft chunk
    fields from LeRobot's (in place, like the residual policy's base record)."""
    lr, normalization = read_lerobot_checkpoint(config.pretrained_path)
    config.lerobot, config.normalization = lr, normalization
    config.obs_keys = sorted(set(input_key_map(config).values()))
    config.obs_steps = int(lr.get("n_obs_steps", 1))
    if lr["type"] == "diffusion":
        # LeRobot returns n_action_steps actions starting at the current step: robotft's whole chunk.
        config.horizon_steps = config.act_steps = int(lr["n_action_steps"])
    else:
        config.horizon_steps, config.act_steps = int(lr["chunk_size"]), int(lr["n_action_steps"])
        config.num_steps = int(lr["num_steps"])
    config.__post_init__()


def robotft_normalizer(config: LeRobotPolicyConfig) -> Normalizer:
    """robotft Normalizer with LeRobot's statistics for the low-dim observation keys and the action (the
    critic, ReinFlow's noise net and a residual read it). Same modes: MEAN_STD → (x - mean) / (std + eps),
    MIN_MAX → [-1, 1] over [min, max]; other modes (and missing statistics) pass the key through."""
    norm = config.normalization
    stats, eps = norm.get("stats", {}), float(norm.get("eps", 1e-8))
    sources = {"action": "action"}
    for name, key in input_key_map(config).items():
        if not key.startswith(("rgb/", "depth/")):
            sources.setdefault(key, name)
    tensors, metadata = {}, {}
    for key, name in sources.items():
        ftype = norm.get("features", {}).get(name, {}).get("type", "ACTION" if key == "action" else "STATE")
        mode = norm.get("norm_map", {}).get(ftype, "IDENTITY")
        s = {k: torch.tensor(v, dtype=torch.float32) for k, v in stats.get(name, {}).items()}
        if mode == "MEAN_STD" and {"mean", "std"} <= set(s):
            offset, scale, robotft_mode = s["mean"], s["std"] + eps, "meanstd"
        elif mode == "MIN_MAX" and {"min", "max"} <= set(s):
            span = s["max"] - s["min"]
            span = torch.where(span == 0, torch.full_like(span, eps), span)
            offset, scale, robotft_mode = s["min"] + span / 2, span / 2, "minmax"
        else:
            shape = config.lerobot.get("input_features", {}).get(name, {}).get("shape")
            shape = shape or config.lerobot.get("output_features", {}).get("action", {}).get("shape", [1])
            offset, scale, robotft_mode = torch.zeros(shape), torch.ones(shape), "identity"
        tensors[f"{key}.offset"], tensors[f"{key}.scale"] = offset, scale
        metadata[f"{key}.mode"] = robotft_mode
    return Normalizer.from_tensors(tensors, metadata)


# --- the common adapter: robotft observations → a normalized LeRobot batch ----------------------------


class _LeRobotAdapter(nn.Module):
    """Maps robotft observation dicts to LeRobot batches (keys, image layout, LeRobot's normalization) and
    LeRobot actions back to env units."""

    def __init__(self, config: LeRobotPolicyConfig) -> None:
        super().__init__()
        from lerobot.processor import NormalizerProcessorStep, UnnormalizerProcessorStep

        norm = config.normalization
        self.inputs = input_key_map(config)
        self.image_inputs = [
            n for n, f in config.lerobot.get("input_features", {}).items() if f["type"] == "VISUAL"
        ]
        features, norm_map, stats = norm.get("features", {}), norm.get("norm_map", {}), norm.get("stats", {})
        eps = float(norm.get("eps", 1e-8))
        self.normalize = NormalizerProcessorStep(features=features, norm_map=norm_map, stats=stats, eps=eps)
        self.unnormalize = UnnormalizerProcessorStep(
            features=features, norm_map=norm_map, stats=stats, eps=eps
        )

    def batch(self, obs: Obs) -> dict[str, torch.Tensor]:
        """`{LeRobot feature: [B, obs_steps, ...]}` normalized as LeRobot does; images float `[.., 3, H, W]` in
        [0, 1] from robotft's uint8 `[.., H, W, 3]`."""
        from lerobot.processor import TransitionKey, create_transition

        raw = {}
        for name, key in self.inputs.items():
            if key not in obs:
                raise KeyError(
                    f"LeRobot input {name!r} reads robotft key {key!r}, not in the observation {sorted(obs)}"
                )
            x = obs[key]
            raw[name] = x.movedim(-1, -3).float() / 255.0 if name in self.image_inputs else x.float()
        return self.normalize(create_transition(observation=raw))[TransitionKey.OBSERVATION]

    def action_to_env(self, action: torch.Tensor) -> torch.Tensor:
        """LeRobot's normalized action `[B, H, A]` → env units (LeRobot's unnormalizer)."""
        from lerobot.processor import TransitionKey, create_transition

        return self.unnormalize(create_transition(action=action))[TransitionKey.ACTION]


# --- DiffusionPolicy as a (frozen) base policy ------------------------------------------------------


class LeRobotDiffusion(Policy):
    """A LeRobot DiffusionPolicy behind the Policy contract: `predict_chunk` returns LeRobot's `n_action_steps`
    actions from the current step (DDPM/DDIM sampling as configured in LeRobot). Meant as a frozen base
    (robotft.policies.residual); it has no robotft BC loss (train it with lerobot-train)."""

    def __init__(
        self, config: LeRobotPolicyConfig, spec: EnvSpec, normalizer: Normalizer, lerobot: nn.Module
    ):
        super().__init__()
        self.config, self.spec, self.normalizer = config, spec, normalizer
        self.act_dim = spec.action.dim
        self.lerobot = lerobot
        self.adapter = _LeRobotAdapter(config)

    @torch.no_grad()
    def predict_chunk(
        self, obs: Obs, deterministic: bool = True, *, generator: torch.Generator | None = None
    ) -> torch.Tensor:
        """Actions `[B, n_action_steps, A]` env units. `generator` seeds the initial noise (the DDPM scheduler
        draws its per-step noise from torch's global generator, as in LeRobot)."""
        from lerobot.utils.constants import OBS_IMAGES

        batch = self.adapter.batch(obs)
        if self.adapter.image_inputs:
            batch[OBS_IMAGES] = torch.stack([batch[k] for k in self.adapter.image_inputs], dim=-4)
        model = self.lerobot.diffusion
        size = next(iter(batch.values())).shape[0]
        shape = (size, model.config.horizon, model.config.action_feature.shape[0])
        device = next(self.lerobot.parameters()).device
        noise = torch.randn(shape, generator=generator, device=device)
        actions = self.adapter.action_to_env(model.generate_actions(batch, noise=noise))
        check_chunk("LeRobot diffusion actions", actions, self.config.horizon_steps, self.act_dim)
        return actions

    @property
    def noise_shape(self) -> tuple[int, int]:
        """Shape `(horizon, action_dim)` of LeRobot's initial noise (LeRobot's horizon, normalized units)."""
        model = self.lerobot.diffusion
        return (model.config.horizon, model.config.action_feature.shape[0])

    @torch.no_grad()
    def decode_noise(self, obs: Obs, noise: torch.Tensor) -> torch.Tensor:
        """Actions `[B, n_action_steps, A]` env units from a given initial noise `[B, *noise_shape]`; deterministic
        only with LeRobot's DDIM scheduler (its step uses η = 0), which DSRL needs."""
        from lerobot.utils.constants import OBS_IMAGES

        model = self.lerobot.diffusion
        if model.config.noise_scheduler_type != "DDIM":
            raise ValueError(f"decoding a given noise needs a LeRobot diffusion policy with noise_scheduler_type DDIM "
                             f"(deterministic); this one uses {model.config.noise_scheduler_type}")
        if tuple(noise.shape[1:]) != self.noise_shape:
            raise ValueError(f"noise: expected [B, {self.noise_shape[0]}, {self.noise_shape[1]}], got {tuple(noise.shape)}")
        batch = self.adapter.batch(obs)
        if self.adapter.image_inputs:
            batch[OBS_IMAGES] = torch.stack([batch[k] for k in self.adapter.image_inputs], dim=-4)
        return self.adapter.action_to_env(model.generate_actions(batch, noise=noise))

    def loss(self, batch: dict[str, Any]) -> tuple[torch.Tensor, dict[str, float]]:
        raise NotImplementedError(
            "a LeRobot DiffusionPolicy is trained by LeRobot (lerobot-train); robotft uses it as a frozen base "
            "(policy type residual with base_checkpoint = the imported checkpoint)"
        )


# --- SmolVLA as a flow policy whose action expert RL fine-tunes -------------------------------------


@dataclasses.dataclass
class KVPrefix:
    """SmolVLA's encoded prefix: the VLM's per-layer key/value cache of [images, task tokens, state] and the
    prefix padding mask. It stands where robotft's flow chain passes a `[B, P, D]` prefix tensor and offers
    what the chain code uses of one: `.shape[0]` (batch), `.device` and `.repeat_interleave(k, dim=0)`."""

    kv: dict[int, dict[str, torch.Tensor]]
    """Layer index → {"key_states", "value_states"} `[B, P, heads, head_dim]` (SmolVLA's cache layout)."""
    pad_masks: torch.Tensor
    """`[B, P]` bool, true on real (not padded) prefix tokens."""

    @property
    def shape(self) -> torch.Size:
        return self.pad_masks.shape

    @property
    def device(self) -> torch.device:
        return self.pad_masks.device

    def repeat_interleave(self, repeats: int, dim: int = 0) -> KVPrefix:
        if dim != 0:
            raise ValueError("KVPrefix repeats along the batch dimension only")
        kv = {
            i: {k: v.repeat_interleave(repeats, dim=0) for k, v in layer.items()}
            for i, layer in self.kv.items()
        }
        return KVPrefix(kv, self.pad_masks.repeat_interleave(repeats, dim=0))


class LeRobotSmolVLA(FlowPolicy):
    """A LeRobot SmolVLA with robotft's flow-chain interface (`encode_prefix`, `velocity`, `initial_noise`,
    `to_actions` and, inherited, `sample_chain` / `chain_elementwise_logprob`), so ReinFlow and Flow-SDE fine-tune
    its action expert. See the module docstring for the time convention and what trains.

    `act_dim` is the latent width (SmolVLA's `max_action_dim`: the chain runs in LeRobot's padded, normalized
    action space); `env_act_dim` is the env's action dimension."""

    def __init__(
        self, config: LeRobotPolicyConfig, spec: EnvSpec, normalizer: Normalizer, lerobot: nn.Module
    ):
        Policy.__init__(
            self
        )  # FlowPolicy.__init__ would build robotft's own flow network; SmolVLA is the network
        self.config, self.spec, self.normalizer = config, spec, normalizer
        self.obs_shapes = low_dim_obs_shapes(config, spec, normalizer, "lerobot smolvla", images="skip")
        self.lerobot = lerobot
        self.adapter = _LeRobotAdapter(config)
        lr = lerobot.config
        self.act_dim = lr.max_action_dim
        self.env_act_dim = spec.action.dim
        if lr.output_features["action"].shape[0] != self.env_act_dim:
            raise ValueError(
                f"SmolVLA predicts {lr.output_features['action'].shape[0]}-dim actions, the env takes {self.env_act_dim}"
            )
        for name, p in lerobot.named_parameters():
            p.requires_grad_(name.startswith(_EXPERT_PREFIXES) and "lm_head" not in name)
        tokenizer = lerobot.model.vlm_with_expert.processor.tokenizer
        # SmolVLA's preprocessor appends a newline to the task and pads on the right (SmolVLANewLineProcessor).
        tok = tokenizer(
            config.task + "\n",
            max_length=lr.tokenizer_max_length,
            truncation=True,
            padding="max_length" if lr.pad_language_to == "max_length" else "longest",
            return_tensors="pt",
        )
        self.register_buffer("lang_tokens", tok["input_ids"], persistent=False)
        self.register_buffer("lang_masks", tok["attention_mask"].bool(), persistent=False)

    def train(self, mode: bool = True) -> LeRobotSmolVLA:
        """Train mode for the action expert; the frozen VLM always stays in eval mode."""
        super().train(mode)
        self.lerobot.model.vlm_with_expert.vlm.eval()
        return self

    def _images(self, batch: dict[str, torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """SmolVLA's image preparation (resize with padding, [0, 1] → [-1, 1]) on the latest frame of each camera."""
        from lerobot.policies.smolvla.modeling_smolvla import resize_with_pad

        lr = self.lerobot.config
        images, masks = [], []
        for key in self.adapter.image_inputs:
            img = batch[key][:, -1] if batch[key].ndim == 5 else batch[key]
            if lr.resize_imgs_with_padding is not None:
                img = resize_with_pad(img, *lr.resize_imgs_with_padding, pad_value=0)
            images.append(img * 2.0 - 1.0)
            masks.append(torch.ones(img.shape[0], dtype=torch.bool, device=img.device))
        return images, masks

    @torch.no_grad()
    def encode_prefix(self, obs: Obs) -> KVPrefix:
        """The frozen VLM over [images, task tokens, state] once per chunk → its key/value cache."""
        from lerobot.policies.smolvla.modeling_smolvla import make_att_2d_masks, pad_vector
        from lerobot.utils.constants import OBS_STATE

        model, lr = self.lerobot.model, self.lerobot.config
        batch = self.adapter.batch(obs)
        state = batch[OBS_STATE]
        state = pad_vector(state[:, -1] if state.ndim > 2 else state, lr.max_state_dim)
        size = state.shape[0]
        images, img_masks = self._images(batch)
        embs, pad_masks, att_masks = model.embed_prefix(
            images,
            img_masks,
            self.lang_tokens.expand(size, -1),
            self.lang_masks.expand(size, -1),
            state=state,
        )
        _, kv = model.vlm_with_expert.forward(
            attention_mask=make_att_2d_masks(pad_masks, att_masks),
            position_ids=torch.cumsum(pad_masks, dim=1) - 1,
            past_key_values=None,
            inputs_embeds=[embs, None],
            use_cache=True,
            fill_kv_cache=True,
        )
        return KVPrefix(kv, pad_masks)

    def velocity(self, prefix: KVPrefix, x: torch.Tensor, tau: torch.Tensor | float) -> torch.Tensor:
        """robotft's v_θ(x, τ) = -v_SmolVLA(x, t = 1 - τ) `[B, H, A]`: the action expert against the cache."""
        tau = torch.as_tensor(tau, dtype=torch.float32, device=x.device).expand(x.shape[0])
        return -self.lerobot.model.denoise_step(
            prefix_pad_masks=prefix.pad_masks, past_key_values=prefix.kv, x_t=x, timestep=1.0 - tau
        )

    def to_actions(self, x: torch.Tensor) -> torch.Tensor:
        """Final latent `[B, H, max_action_dim]` → env actions `[B, H, act_dim]` (unpadded, LeRobot's
        unnormalizer; SmolVLA does not clip)."""
        return self.adapter.action_to_env(x[..., : self.env_act_dim])

    def loss(self, batch: dict[str, Any]) -> tuple[torch.Tensor, dict[str, float]]:
        raise NotImplementedError(
            "SmolVLA's BC training is LeRobot's (lerobot-train); robotft fine-tunes its action expert with RL "
            "(--algo reinflow or flow_sde)"
        )


# --- the registered factory and the importer ---------------------------------------------------------


def _module_config(config: LeRobotPolicyConfig) -> Any:
    """LeRobot's config of the wrapped policy, on CPU (robotft moves the policy). A SmolVLA's VLM weights come
    with the checkpoint's `model.safetensors`, so they are not loaded from the VLM folder first, and the
    cached prefix needs LeRobot's key/value cache on (it does not change the results)."""
    changes: dict[str, Any] = {"device": "cpu"}
    if config.lerobot["type"] == "smolvla":
        changes.update(load_vlm_weights=False, use_cache=True)
    return lerobot_config(config.lerobot, **changes)


@register_policy("lerobot", LeRobotPolicyConfig)
def build_lerobot_policy(config: LeRobotPolicyConfig, spec: EnvSpec, normalizer: Normalizer) -> Policy:
    """The registered factory. With `config.lerobot` empty, reads `config.pretrained_path` (LeRobot's
    `from_pretrained`, its weights included) and fills the config in place; otherwise builds the architecture
    from `config.lerobot` with random weights, which the robotft checkpoint's `lerobot.*` weights replace."""
    _require_lerobot()
    if not config.lerobot:
        fill_from_lerobot(config)
        return _wrap(config, spec, normalizer, _load_pretrained(config))
    return _wrap(config, spec, normalizer, _policy_class(config.lerobot["type"])(_module_config(config)))


def _load_pretrained(config: LeRobotPolicyConfig) -> nn.Module:
    """LeRobot's `from_pretrained` of `config.pretrained_path` (its weights), with `_module_config`'s settings."""
    return _policy_class(config.lerobot["type"]).from_pretrained(
        config.pretrained_path, config=_module_config(config)
    )


def _wrap(config: LeRobotPolicyConfig, spec: EnvSpec, normalizer: Normalizer, module: nn.Module) -> Policy:
    cls = LeRobotDiffusion if config.lerobot["type"] == "diffusion" else LeRobotSmolVLA
    return cls(config, spec, normalizer, module)


def check_fits_env(config: LeRobotPolicyConfig, spec: EnvSpec) -> None:
    """The env provides every key the LeRobot policy reads, with LeRobot's shapes, and takes its actions."""
    problems = []
    for name, key in input_key_map(config).items():
        feat = config.lerobot["input_features"][name]
        if key not in spec.observations:
            problems.append(
                f"{name!r} reads {key!r}, which the env does not provide ({sorted(spec.observations)})"
            )
            continue
        have = spec.observations[key].shape
        want = tuple(feat["shape"])
        if feat["type"] == "VISUAL":
            if (
                len(have) != 3
                or have[-1] != 3
                or (config.lerobot["type"] == "diffusion" and have != (*want[1:], 3))
            ):
                problems.append(f"{name!r} wants images {want} (C, H, W); env key {key!r} is {have}")
        elif have != want:
            problems.append(f"{name!r} has shape {want}; env key {key!r} is {have}")
    act = tuple(config.lerobot["output_features"]["action"]["shape"])
    if spec.action is None or (spec.action.dim,) != act:
        problems.append(f"actions: LeRobot {act}, env {spec.action and spec.action.dim}")
    if problems:
        raise ValueError("LeRobot policy does not fit the env: " + "; ".join(problems))


def import_lerobot_policy(
    pretrained_path: str | Path,
    out: str | Path,
    env: Any,
    *,
    key_map: dict[str, str] | None = None,
    task: str = "",
    spec: EnvSpec | None = None,
) -> Path:
    """Write a robotft checkpoint at `out` holding the LeRobot policy at `pretrained_path` (see the module
    docstring), for env config `env` (a robotft EnvConfig; its spec is read from a one-env instance unless
    `spec` is given). The checkpoint is what `robotft finetune --from` and a residual's `base_checkpoint` take."""
    from robotft.checkpoint import write_checkpoint
    from robotft.config import to_dict

    config = LeRobotPolicyConfig(
        pretrained_path=str(Path(pretrained_path).resolve()), key_map=dict(key_map or {}), task=task
    )
    fill_from_lerobot(config)
    if spec is None:
        from robotft.envs.factory import make_env

        instance = make_env(dataclasses.replace(env, num_envs=1), device="cpu")
        try:
            spec = instance.spec
        finally:
            instance.close()
    check_fits_env(config, spec)
    normalizer = robotft_normalizer(config)
    policy = _wrap(config, spec, normalizer, _load_pretrained(config))
    return write_checkpoint(
        out,
        model_state=policy.state_dict(),
        config={
            "policy": to_dict(config),
            "env": to_dict(env),
            "spec": spec.to_dict(),
            "run": {"stage": "import", "source": config.pretrained_path},
        },
        normalizer=normalizer,
        meta={
            "stage": "import",
            "step": 0,
            "source": config.pretrained_path,
            "lerobot_type": config.lerobot["type"],
        },
    )
