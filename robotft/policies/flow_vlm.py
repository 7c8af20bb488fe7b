"""Flow policy whose observation prefix is encoded by a Hugging Face vision-language model (π0's layout,
Black et al. 2024, arXiv 2410.24164; SmolVLA, Shukor et al. 2025, arXiv 2506.01844).

The prefix is the VLM's hidden states over the sequence

    [image tokens of every `rgb/<camera>` key and history step] [task-text tokens] [state token],

where image tokens come from the VLM's own vision tower and connector (`get_image_features`), text tokens
from its embedding table (the tokenizer in the same folder; the prompt is tokenized once), and the state
token is a learned linear map of the normalized low-dim observation history into the LM's width (SmolVLA's
state projection). The language model runs causally over this sequence, truncated to its first `layers`
decoder layers (SmolVLA keeps the first half of its VLM; GR00T N1, arXiv 2503.14734, reads a middle
layer), and a linear map takes its hidden states to the action expert's width. The action expert of
robotft.policies.flow cross-attends to them, so the VLM runs once per chunk and the K Euler steps reuse it;
the Euler chain, `sample_chain` and the RL chain interface are FlowPolicy's.

The VLM is loaded with `AutoModel.from_pretrained(path, local_files_only=True)` (no hub): any model with
`get_input_embeddings()` and a decoder stack (`text_model`, `language_model`, or the model itself for a
text-only LM); image keys need `get_image_features` (SmolVLM / Idefics3, PaliGemma, LLaVA-style models).
Frozen by default (`freeze: true`: no gradients, kept in eval mode, run under no_grad).

Checkpoints store the VLM's weights (the kept layers) inside the policy's `model.safetensors` like any
other module, frozen or not: a checkpoint's weights are what it was trained and evaluated with, even if the
folder's weights change, and unfrozen weights change in training anyway. The folder (`path`) is still read
when a checkpoint is loaded, for the architecture config and the tokenizer; a folder whose architecture
differs fails the weight load with the mismatching keys named.

Example (policies/flow_vlm.yaml):
    backbone: {kind: transformers, path: /models/SmolVLM2-500M-Video-Instruct, freeze: true, layers: 16,
               prompt: "push the cube to the goal"}
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from robotft.datasets.normalizer import Normalizer
from robotft.optional import require
from robotft.policies.base import Obs, Policy, register_policy
from robotft.policies.encoders import flatten_obs, image_obs_shapes, low_dim_obs_shapes
from robotft.policies.flow import ActionExpert, FlowPolicy, FlowPolicyConfig
from robotft.specs import EnvSpec

BACKBONE_KINDS = ("transformers",)
# SmolVLM/Idefics3 take images as [batch, images per sample, C, H, W]; the others as [N, C, H, W].
_MULTI_IMAGE_MODEL_TYPES = ("idefics3", "smolvlm")


@dataclasses.dataclass
class BackboneConfig:
    """The pretrained model that encodes the observation prefix."""

    kind: str = "transformers"
    """Model source: `transformers` (a Hugging Face model folder loaded with AutoModel)."""
    path: str = ""
    """Local folder with the model's config.json, weights and tokenizer (never downloaded)."""
    freeze: bool = True
    """Keep the VLM's weights fixed (no gradients, eval mode); false fine-tunes it with the policy."""
    layers: int = 0
    """Decoder layers of the language model to keep and run (the first `layers`); 0 keeps all."""
    prompt: str = ""
    """Task instruction, tokenized once and placed in every prefix; empty for no text tokens."""
    image_size: int = 0
    """Side length images are resized to before the vision tower; 0 uses the model's `vision_config`."""

    def __post_init__(self) -> None:
        if self.kind not in BACKBONE_KINDS:
            raise ValueError(f"policy.backbone.kind must be one of {BACKBONE_KINDS}, got {self.kind!r}")
        if self.layers < 0:
            raise ValueError(f"policy.backbone.layers must be >= 0, got {self.layers}")
        if self.image_size < 0:
            raise ValueError(f"policy.backbone.image_size must be >= 0, got {self.image_size}")


@dataclasses.dataclass
class VLMFlowPolicyConfig(FlowPolicyConfig):
    """A flow policy whose prefix is a VLM's hidden states (`image_encoder` and `state_hidden_dims` unused)."""

    type: str = "flow_vlm"
    """Registered policy name."""
    backbone: BackboneConfig = dataclasses.field(default_factory=BackboneConfig)
    """The VLM: where it is, whether it trains, how many of its layers run."""


def load_transformers_model(path: str) -> tuple[nn.Module, object]:
    """`(model, tokenizer)` from a local Hugging Face folder; errors name the folder and the extra."""
    folder = Path(path)
    if not path or not (folder / "config.json").is_file():
        raise FileNotFoundError(
            f"policy.backbone.path: {path!r} is not a Hugging Face model folder (expected {folder / 'config.json'})"
        )
    transformers = require("transformers", "lerobot", "the transformers backbone")
    model = transformers.AutoModel.from_pretrained(folder, local_files_only=True, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
    return model, tokenizer


def language_model(model: nn.Module) -> nn.Module:
    """The decoder stack of a VLM (`text_model`, `language_model`) or the model itself (a text-only LM)."""
    for name in ("text_model", "language_model"):
        if isinstance(getattr(model, name, None), nn.Module):
            return getattr(model, name)
    return model


def truncate_layers(lm: nn.Module, layers: int, path: str) -> None:
    """Keep the first `layers` decoder layers of `lm` (the rest are dropped, with their weights)."""
    stack = getattr(lm, "layers", None)
    if not isinstance(stack, nn.ModuleList):
        raise ValueError(f"policy.backbone.layers: the language model of {path} has no `layers` list to truncate")
    if layers > len(stack):
        raise ValueError(f"policy.backbone.layers={layers} but the language model of {path} has {len(stack)}")
    lm.layers = stack[:layers]
    lm.config.num_hidden_layers = layers  # the decoder loops over layers[: num_hidden_layers]
    if getattr(lm.config, "layer_types", None):
        lm.config.layer_types = lm.config.layer_types[:layers]


def image_normalization(path: str) -> tuple[list[float], list[float]]:
    """Per-channel mean and std the model's image processor uses (preprocessor_config.json), else SigLIP's
    0.5 / 0.5 (SmolVLM, PaliGemma)."""
    file = Path(path) / "preprocessor_config.json"
    config = json.loads(file.read_text()) if file.is_file() else {}
    return list(config.get("image_mean", [0.5] * 3)), list(config.get("image_std", [0.5] * 3))


class VLMPrefixEncoder(nn.Module):
    """Observation history → prefix tokens `[B, P, width]` through a Hugging Face VLM (module docstring)."""

    def __init__(
        self,
        config: VLMFlowPolicyConfig,
        low_dim_shapes: dict[str, tuple[int, ...]],
        image_shapes: dict[str, tuple[int, ...]],
        normalizer: Normalizer,
    ):
        super().__init__()
        cfg = config.backbone
        self.freeze, self.low_dim_shapes, self.image_shapes = cfg.freeze, low_dim_shapes, image_shapes
        self.normalizer = normalizer
        self.vlm, tokenizer = load_transformers_model(cfg.path)
        self.model_type = self.vlm.config.model_type
        if image_shapes and not hasattr(self.vlm, "get_image_features"):
            raise ValueError(
                f"policy.obs_keys has image keys {sorted(image_shapes)} but the model in {cfg.path} "
                f"({type(self.vlm).__name__}) has no vision tower (get_image_features)"
            )
        if cfg.layers:
            truncate_layers(language_model(self.vlm), cfg.layers, cfg.path)
        hidden = self.vlm.get_input_embeddings().embedding_dim
        vision = getattr(self.vlm.config, "vision_config", None)
        self.image_size = cfg.image_size or (vision.image_size if vision is not None else 0)
        mean, std = image_normalization(cfg.path)
        self.register_buffer("pixel_mean", torch.tensor(mean)[:, None, None], persistent=False)
        self.register_buffer("pixel_std", torch.tensor(std)[:, None, None], persistent=False)
        ids = tokenizer(cfg.prompt, add_special_tokens=False)["input_ids"] if cfg.prompt else []
        self.register_buffer("prompt_ids", torch.tensor(ids, dtype=torch.long), persistent=False)
        low_dim = sum(math.prod(shape) for shape in low_dim_shapes.values())
        self.state_proj = nn.Linear(low_dim, hidden) if low_dim else None
        self.out_proj = nn.Linear(hidden, config.width)
        if self.freeze:
            self.vlm.requires_grad_(False)
            self.vlm.eval()

    def train(self, mode: bool = True) -> VLMPrefixEncoder:
        """Like nn.Module.train, but a frozen VLM stays in eval mode (no dropout)."""
        super().train(mode)
        if self.freeze:
            self.vlm.eval()
        return self

    def pixels(self, images: torch.Tensor) -> torch.Tensor:
        """uint8 `[N, H, W, 3]` → normalized float `[N, 3, S, S]` at the vision tower's image size."""
        x = images.permute(0, 3, 1, 2).float() / 255.0
        if x.shape[-1] != self.image_size or x.shape[-2] != self.image_size:
            x = F.interpolate(x, size=(self.image_size, self.image_size), mode="bilinear", antialias=True)
        return (x - self.pixel_mean) / self.pixel_std

    def image_embeddings(self, obs: Obs) -> list[torch.Tensor]:
        """Per camera, the VLM's image tokens `[B, T · tokens per image, hidden]`."""
        out = []
        for key, shape in self.image_shapes.items():
            if key not in obs:
                raise KeyError(f"observation key {key!r} missing: policy reads {list(self.image_shapes)}")
            x = obs[key]
            if x.ndim != 5 or tuple(x.shape[1:]) != shape:
                raise ValueError(f"observation {key!r}: expected [B, {', '.join(map(str, shape))}], got {tuple(x.shape)}")
            pixels = self.pixels(x.flatten(0, 1))  # [B * T, 3, S, S]
            if self.model_type in _MULTI_IMAGE_MODEL_TYPES:
                # One image per row. SmolVLM drops all-zero images as padding; uint8 normalized by the
                # processor's mean/std (0.5/0.5) is never exactly zero everywhere.
                feats = self.vlm.get_image_features(pixels[:, None])
            else:
                feats = self.vlm.get_image_features(pixels)
            out.append(feats.reshape(x.shape[0], -1, feats.shape[-1]))
        return out

    def forward(self, obs: Obs) -> torch.Tensor:
        """Prefix tokens `[B, P, width]`, P = image tokens + prompt tokens + 1 state token (if low-dim keys)."""
        low_dim = flatten_obs(obs, self.low_dim_shapes, self.normalizer) if self.low_dim_shapes else None
        with torch.set_grad_enabled(torch.is_grad_enabled() and not self.freeze):
            parts = self.image_embeddings(obs)
            batch = parts[0].shape[0] if parts else low_dim.shape[0]
            if self.prompt_ids.numel():
                text = self.vlm.get_input_embeddings()(self.prompt_ids)
                parts.append(text[None].expand(batch, -1, -1))
        if self.state_proj is not None:
            parts.append(self.state_proj(low_dim)[:, None])
        embeds = torch.cat(parts, dim=1)
        # A frozen VLM still passes gradients through to the state projection when it has one.
        with torch.set_grad_enabled(embeds.requires_grad):
            mask = torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device)
            hidden = language_model(self.vlm)(inputs_embeds=embeds, attention_mask=mask).last_hidden_state
        return self.out_proj(hidden)


class VLMFlowPolicy(FlowPolicy):
    """FlowPolicy with a VLM prefix encoder in place of the state-token MLP and image encoders."""

    def __init__(self, config: VLMFlowPolicyConfig, spec: EnvSpec, normalizer: Normalizer):
        # FlowPolicy.__init__ builds the state-token MLP and ResNet image encoders, which the VLM replaces.
        Policy.__init__(self)
        self.config, self.spec, self.normalizer = config, spec, normalizer
        self.obs_shapes = low_dim_obs_shapes(config, spec, normalizer, config.type, images="skip")
        image_shapes = image_obs_shapes(config, spec, config.type)
        if not self.obs_shapes and not image_shapes:
            raise ValueError(f"{config.type}: policy.obs_keys is empty; name at least one observation key")
        self.act_dim = spec.action.dim
        self.prefix_encoder = VLMPrefixEncoder(config, self.obs_shapes, image_shapes, normalizer)
        self.expert = ActionExpert(self.act_dim, config.horizon_steps, config)
        self.register_buffer("beta_params", torch.tensor([config.beta_a, config.beta_b]), persistent=False)

    def encode_prefix(self, obs: Obs) -> torch.Tensor:
        """The VLM's prefix tokens `[B, P, width]`; computed once per chunk and reused by every Euler step."""
        return self.prefix_encoder(obs)


@register_policy("flow_vlm", VLMFlowPolicyConfig)
def build_vlm_flow_policy(config: VLMFlowPolicyConfig, spec: EnvSpec, normalizer: Normalizer) -> VLMFlowPolicy:
    """The registered factory."""
    return VLMFlowPolicy(config, spec, normalizer)
