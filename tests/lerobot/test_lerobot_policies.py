"""LeRobot policies as robotft policies: imported checkpoints act exactly as LeRobot's own pipeline does
(preprocessor → model → postprocessor), survive a robotft checkpoint round trip, and bad LeRobot directories
give errors naming the file."""

import json
import shutil

import lerobot_fixtures
import pytest
import torch
from lerobot_fixtures import TASK, make_smolvla_checkpoint

from robotft.checkpoint import MODEL_FILE, load_policy
from robotft.cli import main
from robotft.config import EnvConfig
from robotft.lerobot.policy import (
    LeRobotCheckpointError,
    LeRobotDiffusion,
    LeRobotSmolVLA,
    import_lerobot_policy,
    read_lerobot_checkpoint,
)
from robotft.specs import ActionSpec, EnvSpec, FeatureSpec

NAV2D = EnvConfig(
    type="toy", task="nav2d", num_envs=1, max_episode_steps=40, control_mode="velocity_2d", control_hz=10.0
)
DIFFUSION_KEYS = {"observation.environment_state": "state"}
tiny_vlm = lerobot_fixtures.tiny_vlm
lerobot_diffusion_dir = lerobot_fixtures.lerobot_diffusion_dir
lerobot_smolvla_dir = lerobot_fixtures.lerobot_smolvla_dir


def _lerobot_processors(path):
    from lerobot.policies.factory import make_pre_post_processors
    from lerobot.policies.pretrained import PreTrainedConfig

    return make_pre_post_processors(PreTrainedConfig.from_pretrained(path), pretrained_path=str(path))


def _states(batch: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    return torch.rand(batch, 1, 4, generator=gen) * 2 - 1


def test_diffusion_acts_as_lerobots_pipeline(lerobot_diffusion_dir, tmp_path):
    from lerobot.policies.diffusion.modeling_diffusion import DiffusionPolicy

    ckpt = import_lerobot_policy(lerobot_diffusion_dir, tmp_path / "ckpt", NAV2D, key_map=DIFFUSION_KEYS)
    policy, _ = load_policy(ckpt)
    assert isinstance(policy, LeRobotDiffusion)
    assert (policy.config.obs_steps, policy.config.horizon_steps, policy.config.obs_keys) == (1, 4, ["state"])
    state = _states(5)
    torch.manual_seed(3)
    ours = policy.predict_chunk({"state": state})

    reference = DiffusionPolicy.from_pretrained(lerobot_diffusion_dir).eval()
    pre, post = _lerobot_processors(lerobot_diffusion_dir)
    batch = pre({"observation.state": state[:, 0], "observation.environment_state": state[:, 0]})
    torch.manual_seed(3)
    with torch.no_grad():
        theirs = post(
            reference.diffusion.generate_actions(
                {k: v[:, None] for k, v in batch.items() if k.startswith("observation.")}
            )
        )
    assert ours.shape == (5, 4, 2)
    # The robotft normalizer (critic, residual) holds LeRobot's statistics with LeRobot's formula.
    lerobot_state = policy.adapter.batch({"state": state})["observation.state"]
    torch.testing.assert_close(policy.normalizer.normalize("state", state), lerobot_state)
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(ours[0], ours[1]), "different states must give different chunks"


def test_smolvla_euler_chain_is_lerobots_sampler(lerobot_smolvla_dir, tmp_path):
    """The robotft chain (τ = 1 - t, v_τ = -v) from the same x_0 gives SmolVLA's sample_actions output, and the
    policy tokenizes its task as SmolVLA's preprocessor does."""
    from lerobot.policies.smolvla.modeling_smolvla import SmolVLAPolicy, pad_vector

    ckpt = import_lerobot_policy(lerobot_smolvla_dir, tmp_path / "ckpt", NAV2D, task=TASK)
    policy, _ = load_policy(ckpt)
    assert isinstance(policy, LeRobotSmolVLA)
    assert (policy.config.horizon_steps, policy.config.act_steps, policy.config.num_steps) == (8, 4, 3)
    state = _states(3)
    ours = policy.predict_chunk({"state": state}, generator=torch.Generator().manual_seed(5))

    reference = SmolVLAPolicy.from_pretrained(lerobot_smolvla_dir).eval()
    pre, post = _lerobot_processors(lerobot_smolvla_dir)
    batch = pre({"observation.state": state[:, 0], "task": [TASK] * 3})
    assert torch.equal(batch["observation.language.tokens"], policy.lang_tokens.expand(3, -1))
    x0 = torch.randn((3, 8, 2), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        actions = reference.model.sample_actions(
            [],
            [],
            batch["observation.language.tokens"],
            batch["observation.language.attention_mask"],
            pad_vector(batch["observation.state"], 4),
            noise=x0,
        )
    torch.testing.assert_close(ours, post(actions), atol=1e-5, rtol=1e-5)

    # The recorded chain ends where the ODE does, and re-scoring it reproduces its log-densities.
    torch.manual_seed(0)
    chain = policy.sample_chain({"state": state}, noise_std=0.1, deterministic=True)
    assert chain.latents.shape == (3, 4, 8, 2)
    with torch.no_grad():
        rescored = policy.chain_logprob({"state": state}, chain, noise_std=0.1)
    torch.testing.assert_close(rescored, chain.logprob, atol=1e-4, rtol=1e-5)


def test_smolvla_with_a_camera_matches_lerobot(tiny_vlm, tmp_path):
    """Images: robotft's uint8 [H, W, 3] frames reach SmolVLA's vision tower as LeRobot's own image path sends
    them (float [3, H, W], resize with padding, [-1, 1])."""
    from lerobot.policies.smolvla.modeling_smolvla import SmolVLAPolicy, pad_vector

    folder = make_smolvla_checkpoint(tmp_path / "cam", tiny_vlm, image_shape=(3, 24, 40))
    spec = EnvSpec(
        observations={
            "state": FeatureSpec("state", (4,), "float32"),
            "rgb/front": FeatureSpec("rgb/front", (24, 40, 3), "uint8"),
        },
        action=ActionSpec("velocity_2d", 2, (-1.0, -1.0), (1.0, 1.0)),
    )
    ckpt = import_lerobot_policy(folder, tmp_path / "ckpt", NAV2D, task=TASK, spec=spec)
    policy, _ = load_policy(ckpt)
    assert sorted(policy.config.obs_keys) == ["rgb/front", "state"]
    gen = torch.Generator().manual_seed(2)
    obs = {
        "state": _states(2),
        "rgb/front": torch.randint(0, 256, (2, 1, 24, 40, 3), generator=gen, dtype=torch.uint8),
    }
    ours = policy.predict_chunk(obs, generator=torch.Generator().manual_seed(7))

    reference = SmolVLAPolicy.from_pretrained(folder).eval()
    pre, post = _lerobot_processors(folder)
    batch = pre(
        {
            "observation.state": obs["state"][:, 0],
            "task": [TASK] * 2,
            "observation.images.front": obs["rgb/front"][:, 0].permute(0, 3, 1, 2).float() / 255,
        }
    )
    images, masks = reference.prepare_images(batch)
    x0 = torch.randn((2, 8, 2), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        actions = reference.model.sample_actions(
            images,
            masks,
            batch["observation.language.tokens"],
            batch["observation.language.attention_mask"],
            pad_vector(batch["observation.state"], 4),
            noise=x0,
        )
    torch.testing.assert_close(ours, post(actions), atol=1e-5, rtol=1e-5)
    obs["rgb/front"] = 255 - obs["rgb/front"]
    other = policy.predict_chunk(obs, generator=torch.Generator().manual_seed(7))
    assert not torch.allclose(ours, other), "the image must reach the action"


def test_checkpoint_is_self_contained_safetensors(lerobot_diffusion_dir, tmp_path):
    """The robotft checkpoint holds the LeRobot weights itself: it loads after the LeRobot directory is gone,
    with the same weights, and holds no pickle."""
    src = tmp_path / "lerobot"
    shutil.copytree(lerobot_diffusion_dir, src)
    ckpt = import_lerobot_policy(src, tmp_path / "ckpt", NAV2D, key_map=DIFFUSION_KEYS)
    from safetensors.torch import load_file

    lerobot_weights = load_file(src / "model.safetensors")
    shutil.rmtree(src)
    policy, loaded = load_policy(ckpt)
    for name, tensor in lerobot_weights.items():
        torch.testing.assert_close(policy.lerobot.state_dict()[name], tensor, rtol=0, atol=0)
    assert loaded.config["policy"]["lerobot"]["type"] == "diffusion"
    assert sorted(p.name for p in ckpt.iterdir()) == [
        "config.json",
        "meta.json",
        MODEL_FILE,
        "normalizer.safetensors",
    ]


@pytest.mark.parametrize(
    "damage, expected",
    [
        (lambda d: (d / "policy_preprocessor.json").unlink(), "policy_preprocessor.json: missing"),
        (lambda d: (d / "model.safetensors").unlink(), "model.safetensors: missing"),
        (
            lambda d: next(d.glob("policy_preprocessor_step_*_normalizer_processor.safetensors")).unlink(),
            "normalizer_processor.safetensors: missing",
        ),
        (lambda d: (d / "config.json").write_text(json.dumps({"type": "act"})), "policy type 'act'"),
    ],
)
def test_bad_lerobot_checkpoint_names_the_file(lerobot_diffusion_dir, tmp_path, damage, expected):
    broken = tmp_path / "broken"
    shutil.copytree(lerobot_diffusion_dir, broken)
    damage(broken)
    with pytest.raises(LeRobotCheckpointError, match=expected):
        read_lerobot_checkpoint(broken)
    with pytest.raises(LeRobotCheckpointError, match=expected):
        import_lerobot_policy(broken, tmp_path / "ckpt", NAV2D, key_map=DIFFUSION_KEYS)
    assert not (tmp_path / "ckpt").exists()


def test_a_policy_that_does_not_fit_the_env_is_refused(lerobot_diffusion_dir, tmp_path):
    # The env state's default robotft key (env_state) is not in the env: refused, naming the LeRobot feature.
    with pytest.raises(ValueError, match="'observation.environment_state' reads 'env_state', which the env does not"):
        import_lerobot_policy(lerobot_diffusion_dir, tmp_path / "a", NAV2D)
    spec = EnvSpec(
        observations={"state": FeatureSpec("state", (6,), "float32")},
        action=ActionSpec("velocity_2d", 2, (-1.0, -1.0), (1.0, 1.0)),
    )
    with pytest.raises(ValueError, match=r"'observation.state' has shape \(4,\); env key 'state' is \(6,\)"):
        import_lerobot_policy(lerobot_diffusion_dir, tmp_path / "b", NAV2D, key_map=DIFFUSION_KEYS, spec=spec)
    assert list(tmp_path.iterdir()) == []


def test_cli_policy_import(lerobot_smolvla_dir, tmp_path, capsys):
    out = tmp_path / "ckpt"
    argv = ["policy", "import", "--from-lerobot", str(lerobot_smolvla_dir), "--env", "toy/nav2d", "--out", str(out)]
    assert main([*argv, "--task", TASK]) == 0
    policy, ckpt = load_policy(out)
    assert isinstance(policy, LeRobotSmolVLA) and policy.config.task == TASK
    assert ckpt.config["env"]["task"] == "nav2d" and ckpt.meta["stage"] == "import"
    argv[3] = str(tmp_path / "nowhere")
    assert main([*argv[:-1], str(tmp_path / "other")]) == 1
    assert "nowhere: not a directory" in capsys.readouterr().err
