"""Image observations: a ResNet-18 keypoint encoder per camera (or one shared by all cameras).

The encoder follows diffusion_policy's robomimic-style vision encoder (Chi et al. 2023, arXiv 2303.04137,
Sec. 3.2): a torchvision ResNet-18 trunk (He et al. 2016) without its global average pool and classifier,
every BatchNorm replaced by GroupNorm (Wu & He 2018; BatchNorm's running statistics interact badly with
the EMA of the weights and with small batches), and a spatial softmax that turns the last feature map into
K expected 2-D keypoint positions in [-1, 1] (Levine et al. 2016, arXiv 1504.00702, Sec. 4.1). Images
come in as uint8 `[..., H, W, 3]` and are cropped, scaled and normalized here, inside the policy: a random
crop while training (augmentation), the center crop in eval mode.

Weights are random or read from a local file (a torchvision ResNet-18 state dict, `.safetensors` or a torch
file loaded with `weights_only=True`); nothing is downloaded. torchvision is imported only when an image
encoder is built (`pip install robotft[vision]`).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import torch
from torch import nn

from robotft.optional import require

BACKBONES = ("resnet18",)
GN_CHANNELS_PER_GROUP = 16
"""GroupNorm groups = channels / 16, as diffusion_policy's `replace_bn_with_gn`."""
# ImageNet statistics (torchvision's pretrained ResNets expect them; harmless for random init).
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
_STAGE_CHANNELS = (64, 128, 256, 512)


@dataclasses.dataclass
class ImageEncoderConfig:
    """How `rgb/<camera>` observations are encoded (used only when `obs_keys` has image keys)."""

    backbone: str = "resnet18"
    """Trunk architecture; `resnet18` (torchvision) is the one implemented."""
    stages: int = 4
    """ResNet stages kept (1-4). The feature map has stride 2 ** (stages + 1): 4 stages turn a 76x76 crop into
    3x3; fewer stages keep a finer map (and fewer weights) for small camera images."""
    crop: float = 0.9
    """Crop side as a fraction of the image's height and width: a random crop per image in training, the
    center crop in eval mode; 1.0 turns cropping off."""
    num_keypoints: int = 32
    """K keypoints of the spatial softmax; each camera and history step gives 2K features (x, y in [-1, 1])."""
    shared: bool = False
    """One encoder for all cameras (True) or one per camera (False, diffusion_policy's default)."""
    weights: str | None = None
    """Local file with torchvision ResNet-18 weights (`.safetensors`, or a torch state dict read with
    `weights_only=True`) to start from; None = random init. Read once, when the policy is first built: the
    built policy's config moves the path to `init_from` and clears this, since the checkpoint then holds the
    weights and must rebuild without the file."""
    init_from: str | None = None
    """Where the trunk's initial weights were read from (filled in when `weights` was used; provenance only)."""

    def __post_init__(self) -> None:
        if self.backbone not in BACKBONES:
            raise ValueError(f"policy.image_encoder.backbone must be one of {BACKBONES}, got {self.backbone!r}")
        if not 1 <= self.stages <= 4:
            raise ValueError(f"policy.image_encoder.stages must be in [1, 4], got {self.stages}")
        if not 0 < self.crop <= 1:
            raise ValueError(f"policy.image_encoder.crop must be in (0, 1], got {self.crop}")
        if self.num_keypoints < 1:
            raise ValueError(f"policy.image_encoder.num_keypoints must be >= 1, got {self.num_keypoints}")


def _import_torchvision():
    return require("torchvision", "vision", "image observations")


def read_resnet_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """A torchvision ResNet state dict from `.safetensors` or a torch file (no pickle: `weights_only=True`)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"policy.image_encoder.weights: {path} is not a file")
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    state = torch.load(path, map_location="cpu", weights_only=True)
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(f"policy.image_encoder.weights: {path} does not hold a flat state dict of tensors")
    return state


def replace_batchnorm_with_groupnorm(module: nn.Module) -> nn.Module:
    """Swap every BatchNorm2d(C) for GroupNorm(C / 16, C) in place, keeping its affine weight and bias."""
    for name, child in module.named_children():
        if isinstance(child, nn.BatchNorm2d):
            norm = nn.GroupNorm(max(1, child.num_features // GN_CHANNELS_PER_GROUP), child.num_features)
            with torch.no_grad():
                norm.weight.copy_(child.weight)
                norm.bias.copy_(child.bias)
            setattr(module, name, norm)
        else:
            replace_batchnorm_with_groupnorm(child)
    return module


def resnet18_trunk(stages: int, weights: str | None) -> nn.Sequential:
    """ResNet-18 up to `layer<stages>` (no pool, no classifier), GroupNorm throughout: `[N, 3, H, W]` →
    `[N, C, H / s, W / s]`, C = 64·2^(stages-1), s = 2^(stages+1). `weights` is loaded (strictly, with its
    BatchNorm affine parameters carried into the GroupNorms) before the swap."""
    torchvision = _import_torchvision()
    net = torchvision.models.resnet18(weights=None)
    if weights is not None:
        state = read_resnet_weights(weights)
        try:
            net.load_state_dict(state)
        except RuntimeError as e:
            raise ValueError(
                f"policy.image_encoder.weights: {weights} is not a torchvision ResNet-18 state dict ({e})"
            ) from None
    layers = [net.conv1, net.bn1, net.relu, net.maxpool, *(getattr(net, f"layer{i}") for i in range(1, stages + 1))]
    return replace_batchnorm_with_groupnorm(nn.Sequential(*layers))


class SpatialSoftmax(nn.Module):
    """Feature map `[N, C, h, w]` → K keypoints `[N, K, 2]` (x, y) in [-1, 1] (Levine et al. 2016, Sec. 4.1).

    A 1x1 convolution makes K attention maps; each is a softmax over the h·w positions (with a learned
    temperature), and the keypoint is the expected position under it, on a grid from -1 to 1 along each axis.
    """

    def __init__(self, channels: int, num_keypoints: int):
        super().__init__()
        self.to_maps = nn.Conv2d(channels, num_keypoints, kernel_size=1)
        self.log_temperature = nn.Parameter(torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, _, h, w = x.shape
        logits = self.to_maps(x).flatten(2) / self.log_temperature.exp()  # [N, K, h*w]
        attention = logits.softmax(dim=-1)
        ys, xs = torch.meshgrid(
            torch.linspace(-1, 1, h, device=x.device), torch.linspace(-1, 1, w, device=x.device), indexing="ij"
        )
        grid = torch.stack([xs.flatten(), ys.flatten()], dim=-1)  # [h*w, 2]
        return attention @ grid


class ResNetKeypointEncoder(nn.Module):
    """One camera's images: normalized float `[N, 3, H, W]` → `[N, 2K]` keypoint features."""

    def __init__(self, config: ImageEncoderConfig):
        super().__init__()
        self.trunk = resnet18_trunk(config.stages, config.weights)
        self.keypoints = SpatialSoftmax(_STAGE_CHANNELS[config.stages - 1], config.num_keypoints)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.keypoints(self.trunk(x)).flatten(1)


def crop_images(images: torch.Tensor, size: tuple[int, int], random: bool) -> torch.Tensor:
    """Crop uint8 `[N, H, W, C]` to `[N, h, w, C]`: an independent random window per image, or the center."""
    n, height, width, _ = images.shape
    h, w = size
    if (h, w) == (height, width):
        return images
    if not random:
        top, left = (height - h) // 2, (width - w) // 2
        return images[:, top : top + h, left : left + w]
    top = torch.randint(0, height - h + 1, (n,), device=images.device)
    left = torch.randint(0, width - w + 1, (n,), device=images.device)
    rows = (top[:, None] + torch.arange(h, device=images.device))[:, :, None]  # [N, h, 1]
    cols = (left[:, None] + torch.arange(w, device=images.device))[:, None, :]  # [N, 1, w]
    return images[torch.arange(n, device=images.device)[:, None, None], rows, cols]


class ImageObsEncoder(nn.Module):
    """`rgb/<camera>` observation histories → one feature vector per (camera, history step).

    `image_shapes[key]` = `(obs_steps, H, W, 3)`. `forward(obs)` reads uint8 `[B, obs_steps, H, W, 3]` per key
    and returns tokens `[B, num_tokens, feature_dim]`, ordered camera by camera (in `image_shapes` order) and
    oldest step first within a camera; num_tokens = cameras × obs_steps, feature_dim = 2K.
    """

    def __init__(self, config: ImageEncoderConfig, image_shapes: dict[str, tuple[int, ...]]):
        super().__init__()
        for key, shape in image_shapes.items():
            if len(shape) != 4 or shape[-1] != 3:
                raise ValueError(
                    f"image observation {key!r}: expected per-step shape (H, W, 3) uint8, got {shape[1:]}"
                )
        self.config = config
        self.image_shapes = dict(image_shapes)
        self.crop_sizes = {
            key: (max(1, math.floor(s[1] * config.crop)), max(1, math.floor(s[2] * config.crop)))
            for key, s in image_shapes.items()
        }
        if config.shared:
            self.shared = ResNetKeypointEncoder(config)
        else:
            # ModuleDict names may not contain "." or "/": one encoder per camera, named after it.
            self.cameras = nn.ModuleDict({_module_name(k): ResNetKeypointEncoder(config) for k in image_shapes})
        self.register_buffer("mean", torch.tensor(IMAGENET_MEAN)[:, None, None], persistent=False)
        self.register_buffer("std", torch.tensor(IMAGENET_STD)[:, None, None], persistent=False)
        self.feature_dim = 2 * config.num_keypoints
        self.num_tokens = sum(s[0] for s in image_shapes.values())

    def encoder_for(self, key: str) -> ResNetKeypointEncoder:
        return self.shared if self.config.shared else self.cameras[_module_name(key)]

    def preprocess(self, key: str, images: torch.Tensor) -> torch.Tensor:
        """uint8 `[N, H, W, 3]` → cropped (random in training, center in eval), ImageNet-normalized float
        `[N, 3, h, w]`."""
        if images.dtype != torch.uint8:
            raise ValueError(f"image observation {key!r}: expected uint8 pixels (0-255), got {images.dtype}")
        x = crop_images(images, self.crop_sizes[key], random=self.training)
        x = x.permute(0, 3, 1, 2).float() / 255.0
        return (x - self.mean) / self.std

    def forward(self, obs: dict[str, torch.Tensor]) -> torch.Tensor:
        tokens = []
        for key, shape in self.image_shapes.items():
            if key not in obs:
                raise KeyError(f"observation key {key!r} missing: policy reads {list(self.image_shapes)}, got {sorted(obs)}")
            x = obs[key]
            if x.ndim != 5 or tuple(x.shape[1:]) != shape:
                raise ValueError(
                    f"observation {key!r}: expected shape [B, {', '.join(map(str, shape))}] "
                    f"(obs_steps={shape[0]}, image {shape[1:]}), got {tuple(x.shape)}"
                )
            batch = x.shape[0]
            features = self.encoder_for(key)(self.preprocess(key, x.flatten(0, 1)))
            tokens.append(features.view(batch, shape[0], self.feature_dim))
        return torch.cat(tokens, dim=1)


def _module_name(key: str) -> str:
    return key.replace("/", "__").replace(".", "_")


def image_encoder_without_file(config: ImageEncoderConfig) -> ImageEncoderConfig:
    """The config a built policy records: `weights` moved to `init_from` (the checkpoint holds the weights)."""
    if config.weights is None:
        return config
    return dataclasses.replace(config, weights=None, init_from=str(config.weights))

