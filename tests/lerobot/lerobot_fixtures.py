"""Tiny LeRobot checkpoints made offline, for the LeRobot policy and fine-tuning tests (tests/lerobot).

No hub is reachable, so everything is built locally with random weights, the way a user's files look:
a SmolVLM2-style VLM folder (transformers `smolvlm` config, a word-level tokenizer with SmolVLM's special image
tokens, an image processor) and LeRobot `pretrained_model` directories written by LeRobot's own
`save_pretrained` (config.json, model.safetensors, policy_preprocessor/postprocessor with the normalizer state).
Normalization statistics come from toy nav2d rollouts (state [x, y, goal_x, goal_y], 2-D velocity actions).

Test modules import the fixtures they use from here (`from lerobot_fixtures import ...`); pytest puts this
folder on sys.path when it imports the test modules beside it.
"""

import os
from pathlib import Path

import pytest
import torch

pytest.importorskip("lerobot")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

TASK = "go to the goal"
STATE_DIM, ACT_DIM = 4, 2


def nav2d_stats() -> dict[str, dict[str, torch.Tensor]]:
    """LeRobot-style statistics of nav2d states and actions (min, max, mean, std), from 2000 random states."""
    gen = torch.Generator().manual_seed(0)
    state = torch.cat(
        [
            torch.rand(2000, 2, generator=gen) * 2.4 - 1.2,
            torch.rand(2000, 2, generator=gen) * 0.1 + torch.tensor([-0.05, 0.95]),
        ],
        dim=1,
    )
    action = torch.rand(2000, 2, generator=gen) * 2 - 1

    def stats(x):
        return {"min": x.min(0).values, "max": x.max(0).values, "mean": x.mean(0), "std": x.std(0)}

    return {
        "observation.state": stats(state),
        "observation.environment_state": stats(state),
        "action": stats(action),
    }


def make_tiny_vlm(folder: Path) -> Path:
    """A randomly initialised SmolVLM2-style VLM folder: config.json (model_type smolvlm: a 1-layer SigLIP-style
    vision tower on 32x32 images, a 2-layer Llama text model of width 32), a word-level tokenizer carrying
    SmolVLM's special image tokens, and an Idefics3 image processor. (transformers' SmolVLMProcessor also needs
    the num2words package, which is not installed here; SmolVLA uses only the tokenizer.)"""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import Idefics3ImageProcessor, Idefics3Processor, PreTrainedTokenizerFast, SmolVLMConfig

    folder.mkdir(parents=True, exist_ok=True)
    words = ["<pad>", "<unk>", *TASK.split(), "push", "the", "cube", "\n"]
    special = ["<fake_token_around_image>", "<image>", "<global-img>", "<end_of_utterance>"]
    vocab = {w: i for i, w in enumerate(dict.fromkeys(words + special))}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token="<pad>",
        unk_token="<unk>",
        extra_special_tokens={
            "fake_image_token": special[0],
            "image_token": special[1],
            "global_image_token": special[2],
            "end_of_utterance_token": special[3],
        },
    )
    tokenizer.save_pretrained(folder)
    SmolVLMConfig(
        vision_config=dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=32,
            patch_size=8,
        ),
        text_config=dict(
            model_type="llama",
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
            vocab_size=len(vocab),
            max_position_embeddings=256,
        ),
        scale_factor=2,
        image_token_id=vocab["<image>"],
        pad_token_id=0,
    ).save_pretrained(folder)
    image_processor = Idefics3ImageProcessor(
        size={"longest_edge": 32}, max_image_size={"longest_edge": 32}, do_image_splitting=False
    )
    Idefics3Processor(image_processor=image_processor, tokenizer=tokenizer, image_seq_len=4).save_pretrained(
        folder
    )
    return folder


def save_lerobot(policy, folder: Path, stats) -> Path:
    """LeRobot's own save: the policy and its pre/post-processors (with the normalizer statistics)."""
    from lerobot.policies.factory import make_pre_post_processors

    pre, post = make_pre_post_processors(policy.config, dataset_stats=stats)
    policy.save_pretrained(folder)
    pre.save_pretrained(folder)
    post.save_pretrained(folder)
    return folder


def make_diffusion_checkpoint(folder: Path, noise_scheduler_type: str = "DDPM") -> Path:
    """A tiny LeRobot DiffusionPolicy on nav2d: the state is its robot state and its environment state
    (LeRobot's diffusion needs an image or an environment state), 1 observation step, horizon 8, 4 actions;
    sampled by LeRobot's `noise_scheduler_type` (DDIM decodes a given noise deterministically)."""
    from lerobot.configs.types import FeatureType, PolicyFeature
    from lerobot.policies.diffusion.configuration_diffusion import DiffusionConfig
    from lerobot.policies.diffusion.modeling_diffusion import DiffusionPolicy

    torch.manual_seed(0)
    config = DiffusionConfig(
        n_obs_steps=1,
        horizon=8,
        n_action_steps=4,
        down_dims=(16, 32),
        diffusion_step_embed_dim=16,
        kernel_size=3,
        n_groups=4,
        num_train_timesteps=10,
        noise_scheduler_type=noise_scheduler_type,
        device="cpu",
        input_features={
            "observation.state": PolicyFeature(FeatureType.STATE, (STATE_DIM,)),
            "observation.environment_state": PolicyFeature(FeatureType.ENV, (STATE_DIM,)),
        },
        output_features={"action": PolicyFeature(FeatureType.ACTION, (ACT_DIM,))},
    )
    return save_lerobot(DiffusionPolicy(config), folder, nav2d_stats())


def make_smolvla_checkpoint(folder: Path, vlm: Path, image_shape: tuple[int, int, int] | None = None) -> Path:
    """A tiny LeRobot SmolVLA on nav2d over the tiny VLM: chunk 8, 4 executed actions, 3 Euler steps, state and
    action unpadded (max_state_dim 4, max_action_dim 2); optionally one camera `observation.images.front`."""
    from lerobot.configs.types import FeatureType, PolicyFeature
    from lerobot.policies.smolvla.configuration_smolvla import SmolVLAConfig
    from lerobot.policies.smolvla.modeling_smolvla import SmolVLAPolicy

    torch.manual_seed(0)
    inputs = {"observation.state": PolicyFeature(FeatureType.STATE, (STATE_DIM,))}
    if image_shape is not None:
        inputs["observation.images.front"] = PolicyFeature(FeatureType.VISUAL, image_shape)
    config = SmolVLAConfig(
        vlm_model_name=str(vlm),
        load_vlm_weights=False,
        chunk_size=8,
        n_action_steps=4,
        num_steps=3,
        max_state_dim=STATE_DIM,
        max_action_dim=ACT_DIM,
        num_vlm_layers=2,
        self_attn_every_n_layers=2,
        expert_width_multiplier=0.5,
        resize_imgs_with_padding=(32, 32),
        device="cpu",
        input_features=inputs,
        output_features={"action": PolicyFeature(FeatureType.ACTION, (ACT_DIM,))},
    )
    policy = SmolVLAPolicy(config)
    # LeRobot zero-initialises nothing here, but make the expert's output non-trivial and deterministic.
    torch.nn.init.normal_(policy.model.action_out_proj.weight, std=0.5)
    return save_lerobot(
        policy, folder, {k: v for k, v in nav2d_stats().items() if k != "observation.environment_state"}
    )


@pytest.fixture(scope="session")
def tiny_vlm(tmp_path_factory) -> Path:
    return make_tiny_vlm(tmp_path_factory.mktemp("vlm") / "SmolVLM2-tiny")


@pytest.fixture(scope="session")
def lerobot_diffusion_dir(tmp_path_factory) -> Path:
    return make_diffusion_checkpoint(tmp_path_factory.mktemp("lerobot_diffusion") / "pretrained_model")


@pytest.fixture(scope="session")
def lerobot_smolvla_dir(tmp_path_factory, tiny_vlm) -> Path:
    return make_smolvla_checkpoint(tmp_path_factory.mktemp("lerobot_smolvla") / "pretrained_model", tiny_vlm)
