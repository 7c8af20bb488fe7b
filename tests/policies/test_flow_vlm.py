"""Flow policy with a Hugging Face VLM prefix: a tiny randomly initialised SmolVLM (and a tiny text-only
Llama) saved to a local folder and loaded through `from_pretrained`, as a real checkpoint is; training steps,
the frozen / trainable split, the prefix computed once per chunk, and the robotft checkpoint round trip."""

import numpy as np
import pytest
import torch

from robotft.config import REPO_ROOT, from_dict, load_yaml
from robotft.datasets.normalizer import Normalizer
from robotft.policies.base import build_policy
from robotft.policies.flow_vlm import BackboneConfig, VLMFlowPolicy, VLMFlowPolicyConfig
from robotft.specs import ActionSpec, EnvSpec, FeatureSpec

OBS_DIM, ACT_DIM, H, T_O, IMG = 3, 2, 4, 2, 20
WORDS = ["<unk>", "<pad>", "push", "the", "cube", "to", "goal", "reach", "avoid", "obstacle"]
TEXT = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 3,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128, "pad_token_id": 1}


def save_tokenizer(folder):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>").save_pretrained(folder)


@pytest.fixture(scope="module")
def smolvlm_dir(tmp_path_factory):
    """A tiny SmolVLM (SigLIP-style vision tower, pixel-shuffle connector, 3-layer Llama) and a word tokenizer."""
    from transformers import AutoModel, SmolVLMConfig

    folder = tmp_path_factory.mktemp("tiny_smolvlm")
    save_tokenizer(folder)
    config = SmolVLMConfig(
        text_config={"model_type": "llama", **TEXT},
        vision_config={"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2,
                       "image_size": 32, "patch_size": 8},
        scale_factor=2, image_token_id=63, vocab_size=64,
    )
    torch.manual_seed(0)
    AutoModel.from_config(config).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    """A tiny text-only Llama with the same tokenizer."""
    from transformers import AutoModel, LlamaConfig

    folder = tmp_path_factory.mktemp("tiny_llama")
    save_tokenizer(folder)
    torch.manual_seed(0)
    AutoModel.from_config(LlamaConfig(**TEXT)).save_pretrained(folder)
    return folder


def make_policy(path, obs_keys=("state", "rgb/front"), freeze=True, layers=2, num_steps=5) -> VLMFlowPolicy:
    torch.manual_seed(0)
    spec = EnvSpec({"state": FeatureSpec("state", (OBS_DIM,), "float32"),
                    "rgb/front": FeatureSpec("rgb/front", (IMG, IMG, 3), "uint8")},
                   ActionSpec("test", ACT_DIM, (-3.0,) * ACT_DIM, (3.0,) * ACT_DIM))
    rng = np.random.default_rng(0)
    normalizer = Normalizer.fit(
        {"state": rng.normal(size=(64, OBS_DIM)), "action": rng.uniform(-2, 3, size=(64, ACT_DIM))},
        {"state": "minmax", "action": "minmax"},
    )
    config = VLMFlowPolicyConfig(
        obs_keys=list(obs_keys), obs_steps=T_O, horizon_steps=H, act_steps=2, width=32, num_heads=4,
        time_embed_dim=16, num_steps=num_steps,
        backbone=BackboneConfig(path=str(path), freeze=freeze, layers=layers, prompt="push the cube to the goal"),
    )
    policy = build_policy(config, spec, normalizer)
    assert isinstance(policy, VLMFlowPolicy)
    return policy


def make_batch(batch=6, seed=1):
    g = torch.Generator().manual_seed(seed)
    obs = {"state": torch.randn(batch, T_O, OBS_DIM, generator=g),
           "rgb/front": torch.randint(0, 256, (batch, T_O, IMG, IMG, 3), generator=g, dtype=torch.uint8)}
    return {"obs": obs, "action": torch.rand(batch, H, ACT_DIM, generator=g) * 4 - 2}


def train(policy, batch, steps=40):
    optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=3e-3)
    policy.train()
    losses = []
    for step in range(steps):
        torch.manual_seed(step % 4)  # a few fixed (noise, τ) draws, so the loss can only drop by fitting them
        loss, _ = policy.loss(batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def test_prefix_tokens_come_from_the_vlm_once_per_chunk(smolvlm_dir, monkeypatch):
    policy = make_policy(smolvlm_dir).eval()
    lm = policy.prefix_encoder.vlm.text_model
    assert len(lm.layers) == 2 and lm.config.num_hidden_layers == 2  # layers: 2 of the folder's 3
    assert policy.prefix_encoder.prompt_ids.tolist() == [2, 3, 4, 5, 3, 6]
    obs = make_batch()["obs"]
    prefix = policy.encode_prefix(obs)
    # 2 history steps x 4 image tokens (32x32 / patch 8 = 16 patches, pixel shuffle 2) + 6 prompt + 1 state
    assert prefix.shape == (6, 2 * 4 + 6 + 1, 32)
    seen = []
    handle = lm.register_forward_hook(lambda module, args, out: seen.append(1))
    policy.predict_chunk(obs)
    policy.sample_chain(obs, noise_std=0.1)
    handle.remove()
    assert len(seen) == 2  # one VLM pass per chunk, reused by the 5 Euler steps
    # Images matter: another frame changes the prefix.
    other = dict(obs, **{"rgb/front": 255 - obs["rgb/front"]})
    assert not torch.allclose(policy.encode_prefix(other), prefix)


def test_frozen_vlm_trains_the_rest(smolvlm_dir):
    policy = make_policy(smolvlm_dir, freeze=True)
    vlm_before = {k: v.clone() for k, v in policy.prefix_encoder.vlm.state_dict().items()}
    expert_before = {k: v.clone() for k, v in policy.expert.state_dict().items()}
    losses = train(policy, make_batch())
    assert np.mean(losses[-4:]) < 0.7 * np.mean(losses[:4]), losses
    assert not policy.prefix_encoder.vlm.training  # dropout stays off under policy.train()
    for k, v in policy.prefix_encoder.vlm.state_dict().items():
        torch.testing.assert_close(v, vlm_before[k], rtol=0, atol=0)
    assert any(not torch.equal(v, expert_before[k]) for k, v in policy.expert.state_dict().items())
    assert policy.prefix_encoder.state_proj.weight.grad is not None  # gradients pass through the frozen LM


def test_trainable_vlm_gets_gradients(smolvlm_dir):
    policy = make_policy(smolvlm_dir, freeze=False)
    policy.train()
    policy.loss(make_batch())[0].backward()
    vlm = policy.prefix_encoder.vlm
    assert vlm.text_model.layers[0].self_attn.q_proj.weight.grad is not None
    assert vlm.vision_model.embeddings.patch_embedding.weight.grad is not None


def test_reinflow_fine_tunes_the_expert_on_the_vlm_prefix(smolvlm_dir):
    from robotft.rl.reinflow import ReinFlow, ReinFlowConfig

    policy = make_policy(smolvlm_dir, num_steps=3).eval()
    algo = ReinFlow(policy, ReinFlowConfig())
    obs = make_batch(4)["obs"]
    out = algo.act(obs)
    assert out.actions.shape == (4, H, ACT_DIM)
    rescored = algo.logprob(obs, out.sample)
    torch.testing.assert_close(rescored, out.logprob)
    rescored.sum().backward()
    assert policy.expert.out.weight.grad is not None
    assert all(p.grad is None for p in policy.prefix_encoder.vlm.parameters())  # frozen


def test_checkpoint_round_trip(smolvlm_dir, tmp_path):
    from robotft.checkpoint import load_policy, write_checkpoint
    from robotft.config import to_dict

    policy = make_policy(smolvlm_dir)
    train(policy, make_batch(), steps=3)
    write_checkpoint(tmp_path / "ckpt", model_state=policy.export_state_dict(),
                     config={"policy": to_dict(policy.config), "spec": policy.spec.to_dict()},
                     normalizer=policy.normalizer, meta={"stage": "test"})
    from safetensors import safe_open

    with safe_open(tmp_path / "ckpt" / "model.safetensors", framework="pt") as f:
        keys = set(f.keys())
    assert "prefix_encoder.vlm.text_model.layers.1.mlp.up_proj.weight" in keys  # VLM weights are in the checkpoint
    assert not any(".layers.2." in k for k in keys)  # truncated layers are not
    again, _ = load_policy(tmp_path / "ckpt")
    policy.eval()
    obs = make_batch(3, seed=5)["obs"]
    out = [p.predict_chunk(obs, generator=torch.Generator().manual_seed(2)) for p in (policy, again)]
    torch.testing.assert_close(out[0], out[1], rtol=0, atol=0)


def test_text_only_model(llama_dir):
    policy = make_policy(llama_dir, obs_keys=("state",), layers=0).eval()
    assert policy.encode_prefix(make_batch()["obs"]).shape == (6, 6 + 1, 32)
    with pytest.raises(ValueError, match="no vision tower"):
        make_policy(llama_dir)


def test_config_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a Hugging Face model folder"):
        make_policy(tmp_path / "missing")
    with pytest.raises(ValueError, match="backbone.kind"):
        BackboneConfig(kind="openpi")
    cfg = from_dict(VLMFlowPolicyConfig, load_yaml(REPO_ROOT / "policies" / "flow_vlm.yaml"))
    assert (cfg.backbone.kind, cfg.backbone.freeze, cfg.backbone.layers) == ("transformers", True, 16)


def test_pretrain_cli_and_load(smolvlm_dir, tmp_path):
    """`robotft pretrain --policy flow_vlm` on the toy suite (state + prompt), then `load_policy` twice."""
    from robotft.checkpoint import load_policy
    from robotft.cli import main

    demos, run = tmp_path / "demos.zarr", tmp_path / "bc"
    assert main(["data", "generate", "--env", "toy/nav2d", "--episodes", "5", "--out", str(demos)]) == 0
    assert main(["pretrain", "--env", "toy/nav2d", "--policy", "flow_vlm", "--data", str(demos), "--steps", "6",
                 "--out", str(run), "--train.batch_size", "16", "--train.eval_episodes", "0",
                 "--policy.width", "32", "--policy.num_layers", "1", "--policy.num_steps", "3",
                 "--policy.backbone.path", str(smolvlm_dir), "--policy.backbone.layers", "1",
                 "--policy.backbone.prompt", "reach the goal"]) == 0
    first, ckpt = load_policy(run)
    assert ckpt.config["policy"]["backbone"]["path"] == str(smolvlm_dir)
    second, _ = load_policy(run)
    obs = {"state": torch.randn(4, 1, 4)}
    out = [p.predict_chunk(obs, generator=torch.Generator().manual_seed(0)) for p in (first, second)]
    assert out[0].shape == (4, 8, 2)
    torch.testing.assert_close(out[0], out[1], rtol=0, atol=0)
