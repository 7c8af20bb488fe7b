import numpy as np
import pytest
import torch
from diffusers import DDIMScheduler, DDPMScheduler
from safetensors.torch import load_file, save_file
from torch.distributions import Normal

from robotft.config import REPO_ROOT, from_dict, load_yaml
from robotft.datasets.normalizer import Normalizer
from robotft.policies.base import build_policy
from robotft.policies.diffusion import DiffusionPolicy, DiffusionPolicyConfig
from robotft.specs import ActionSpec, EnvSpec, FeatureSpec

OBS_DIM, ACT_DIM, H, T_O = 3, 2, 4, 2
T = 10


def make_policy(sampler: str = "ddpm", seed: int = 0, **overrides) -> DiffusionPolicy:
    torch.manual_seed(seed)
    spec = EnvSpec(
        {"state": FeatureSpec("state", (OBS_DIM,), "float32")},
        ActionSpec("joint_delta_pos", ACT_DIM, (-1.0,) * ACT_DIM, (1.0,) * ACT_DIM),
    )
    rng = np.random.default_rng(0)
    normalizer = Normalizer.fit(
        {"state": rng.normal(size=(64, OBS_DIM)), "action": rng.uniform(-2, 3, size=(64, ACT_DIM))},
        {"state": "minmax", "action": "minmax"},
    )
    kwargs = dict(
        obs_steps=T_O,
        horizon_steps=H,
        act_steps=2,
        hidden_dims=(32, 32),
        num_train_timesteps=T,
        sampler=sampler,
    )
    kwargs.update(overrides)
    policy = build_policy(DiffusionPolicyConfig(**kwargs), spec, normalizer)
    assert isinstance(policy, DiffusionPolicy)
    return policy


def make_obs(batch: int = 5, seed: int = 1) -> dict[str, torch.Tensor]:
    return {"state": torch.randn(batch, T_O, OBS_DIM, generator=torch.Generator().manual_seed(seed))}


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# --- (c) transition means against diffusers' schedulers ---------------------------------------------


def test_ddpm_means_match_diffusers(monkeypatch):
    policy = make_policy("ddpm")
    sched = DDPMScheduler(num_train_timesteps=T, beta_schedule="squaredcos_cap_v2", clip_sample=True)
    monkeypatch.setattr(
        "diffusers.schedulers.scheduling_ddpm.randn_tensor", lambda shape, **kw: torch.zeros(shape)
    )  # zero noise: prev_sample is the posterior mean
    x, eps = 2 * torch.randn(6, H * ACT_DIM, generator=gen(1)), torch.randn(6, H * ACT_DIM, generator=gen(2))
    assert policy.timesteps.tolist() == list(range(T - 1, -1, -1))
    for i, t in enumerate(policy.timesteps.tolist()):
        out = sched.step(eps, t, x)
        index = torch.full((6,), i)
        mean, std = policy._gaussian(x, eps, index, min_std=0.0, deterministic=False)
        torch.testing.assert_close(mean, out.prev_sample, rtol=1e-4, atol=1e-5)
        expected_std = sched._get_variance(t).sqrt() if t > 0 else torch.tensor(0.0)
        torch.testing.assert_close(std[0, 0], expected_std.float(), rtol=1e-4, atol=1e-6)
        # deterministic_sampler posterior_mean: the same mean, no noise
        det = make_policy("ddpm", deterministic_sampler="posterior_mean")
        det_mean, det_std = det._gaussian(x, eps, index, min_std=0.0, deterministic=True)
        torch.testing.assert_close(det_mean, out.prev_sample, rtol=1e-4, atol=1e-5)
        assert float(det_std.abs().max()) == 0.0


def test_deterministic_ddpm_is_ddim_eta0_over_all_timesteps():
    """A DDPM policy's default deterministic sampler is DDIM with η = 0 over its T timesteps (diffusers'
    DDIMScheduler with T trailing steps), and predict_chunk(deterministic=True) is a function of the obs."""
    policy = make_policy("ddpm")
    sched = DDIMScheduler(num_train_timesteps=T, beta_schedule="squaredcos_cap_v2", clip_sample=True,
                          timestep_spacing="trailing")
    sched.set_timesteps(T)
    assert sched.timesteps.tolist() == policy.timesteps.tolist()
    x, eps = 2 * torch.randn(6, H * ACT_DIM, generator=gen(1)), torch.randn(6, H * ACT_DIM, generator=gen(2))
    for i, t in enumerate(sched.timesteps.tolist()):
        out = sched.step(eps, t, x, eta=0.0, use_clipped_model_output=True)
        mean, std = policy._gaussian(x, eps, torch.full((6,), i), min_std=0.0, deterministic=True)
        torch.testing.assert_close(mean, out.prev_sample, rtol=1e-4, atol=1e-5)
        assert float(std.abs().max()) == 0.0
    obs = make_obs()
    first = policy.predict_chunk(obs, deterministic=True)
    torch.manual_seed(123)  # no draw from the global RNG either
    torch.testing.assert_close(policy.predict_chunk(obs, deterministic=True), first, rtol=0, atol=0)
    # one row alone gets the same action as in the batch
    torch.testing.assert_close(policy.predict_chunk({k: v[2:3] for k, v in obs.items()}, deterministic=True),
                               first[2:3], rtol=1e-5, atol=1e-6)
    # the older mode still samples DDPM's posterior noise
    noisy = make_policy("ddpm", deterministic_sampler="model_std")
    noisy.load_state_dict(policy.state_dict())
    assert not torch.allclose(noisy.predict_chunk(obs, deterministic=True), noisy.predict_chunk(obs, deterministic=True))


@pytest.mark.parametrize("deterministic", [False, True])
def test_ddim_means_match_diffusers(deterministic):
    eta = 1.0
    policy = make_policy("ddim", ddim_steps=5, ddim_eta=eta)
    sched = DDIMScheduler(
        num_train_timesteps=T,
        beta_schedule="squaredcos_cap_v2",
        clip_sample=True,
        timestep_spacing="trailing",
    )
    sched.set_timesteps(5)
    assert policy.timesteps.tolist() == sched.timesteps.tolist()
    x, eps = 2 * torch.randn(6, H * ACT_DIM, generator=gen(1)), torch.randn(6, H * ACT_DIM, generator=gen(2))
    for i, t in enumerate(sched.timesteps.tolist()):
        out = sched.step(
            eps,
            t,
            x,
            eta=0.0 if deterministic else eta,
            use_clipped_model_output=True,
            variance_noise=torch.zeros_like(x),
        )
        mean, _ = policy._gaussian(x, eps, torch.full((6,), i), min_std=0.0, deterministic=deterministic)
        torch.testing.assert_close(mean, out.prev_sample, rtol=1e-4, atol=1e-5)


# --- (a), (b) log-probabilities ----------------------------------------------------------------------


def independent_chain_logprob(policy: DiffusionPolicy, obs, chain, min_std: float) -> torch.Tensor:
    """Recompute every recorded transition's log-density from the latents with torch.distributions,
    using the schedule from diffusers and the formulas written out here (Ho et al. eq. 7, Song et al. eq. 12)."""
    cfg = policy.config
    abar = DDPMScheduler(num_train_timesteps=T, beta_schedule=cfg.beta_schedule).alphas_cumprod
    if cfg.sampler == "ddpm":
        timesteps = list(range(T - 1, -1, -1))
    else:
        sched = DDIMScheduler(
            num_train_timesteps=T, beta_schedule=cfg.beta_schedule, timestep_spacing="trailing"
        )
        sched.set_timesteps(cfg.ddim_steps)
        timesteps = sched.timesteps.tolist()
    cond = policy.encode_obs(obs)
    out = []
    for j, i in enumerate(chain.step_indices.tolist()):
        x, x_prev = chain.latents[:, j].flatten(1), chain.latents[:, j + 1].flatten(1)
        a = abar[timesteps[i]]
        ap = abar[timesteps[i + 1]] if i + 1 < len(timesteps) else torch.tensor(1.0)
        eps = policy.ft_net(x, torch.full((x.shape[0],), timesteps[i]), cond)
        x0 = ((x - (1 - a).sqrt() * eps) / a.sqrt()).clamp(-1, 1)
        var = (1 - ap) / (1 - a) * (1 - a / ap)
        if cfg.sampler == "ddpm":
            beta = 1 - a / ap
            mean = ap.sqrt() * beta / (1 - a) * x0 + (1 - beta).sqrt() * (1 - ap) / (1 - a) * x
            std = var.sqrt().clamp(min=min_std)
        else:
            eps = (x - a.sqrt() * x0) / (1 - a).sqrt()
            std = (cfg.ddim_eta * var.sqrt()).clamp(min=min_std)
            mean = ap.sqrt() * x0 + (1 - ap - std**2).clamp(min=0).sqrt() * eps
        out.append(Normal(mean, std).log_prob(x_prev).sum(dim=1))
    return torch.stack(out, dim=1)


@pytest.mark.parametrize("sampler", ["ddpm", "ddim"])
@pytest.mark.parametrize("deterministic", [False, True])
def test_chain_logprob_is_sum_of_gaussian_logdensities(sampler, deterministic):
    policy = make_policy(sampler, ddim_eta=0.5)
    policy.enable_finetuning(3)
    obs, min_std = make_obs(), 0.08
    chain = policy.sample_chain(obs, min_std=min_std, deterministic=deterministic, generator=gen())
    assert chain.latents.shape == (5, 4, H, ACT_DIM)
    assert chain.step_indices.tolist() == list(
        range(policy.num_denoising_steps - 3, policy.num_denoising_steps)
    )
    with torch.no_grad():
        expected = independent_chain_logprob(policy, obs, chain, min_std)
        rescored = policy.chain_logprob(obs, chain, min_std)
    torch.testing.assert_close(chain.logprob, expected, rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(rescored, chain.logprob, rtol=1e-5, atol=1e-4)
    # latents alone (what a rollout buffer stores) default to the last K steps
    with torch.no_grad():
        elementwise = policy.chain_elementwise_logprob(obs, chain.latents, min_std)
    assert elementwise.shape == (5, 3, H, ACT_DIM)
    torch.testing.assert_close(elementwise.sum(dim=(-1, -2)), chain.logprob, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("sampler", ["ddpm", "ddim"])
def test_unfinetuned_chain_records_every_transition(sampler):
    policy = make_policy(sampler)
    obs = make_obs()
    chain = policy.sample_chain(obs, min_std=0.1, generator=gen())
    n = policy.num_denoising_steps
    assert chain.latents.shape == (5, n + 1, H, ACT_DIM) and chain.logprob.shape == (5, n)
    torch.testing.assert_close(policy.chain_logprob(obs, chain, 0.1), chain.logprob, rtol=1e-5, atol=1e-4)
    # the recorded x_0 is the chain's own value; the action is it clipped and unnormalized
    x0 = chain.latents[:, -1].clamp(-1, 1)
    torch.testing.assert_close(chain.actions, policy.normalizer.unnormalize("action", x0))


def test_point_mass_transitions_need_min_std():
    policy = make_policy("ddpm")  # DDPM's last transition has std 0
    with pytest.raises(ValueError, match="min_std"):
        policy.sample_chain(make_obs(), min_std=0.0)


# --- (d) gradients and the frozen network ----------------------------------------------------------


def test_finetuning_gradients_reach_only_ft_net():
    policy = make_policy("ddpm")
    policy.enable_finetuning(3)
    assert policy.config.ft_denoising_steps == 3
    assert not any(p.requires_grad for p in policy.net.parameters())
    obs = make_obs()
    chain = policy.sample_chain(obs, min_std=0.1, generator=gen())
    cond = policy.encode_obs(obs)
    index = torch.tensor([7, 8, 9, 7, 8])
    lp = policy.transition_logprob(cond, chain.latents[:, 0], chain.latents[:, 1], index, min_std=0.1)
    assert lp.shape == (5,)
    lp.sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in policy.ft_net.parameters())
    assert all(p.grad is None for p in policy.net.parameters())
    # transitions before the fine-tuned tail run the frozen net: nothing to differentiate
    early = policy.transition_logprob(cond, chain.latents[:, 0], chain.latents[:, 1], 2, min_std=0.1)
    assert not early.requires_grad


def test_first_transitions_use_frozen_net():
    policy = make_policy("ddpm")
    policy.enable_finetuning(3)
    obs = make_obs()
    before = policy.sample_chain(obs, min_std=0.1, generator=gen())
    with torch.no_grad():
        policy.ft_net.out.bias.add_(0.5)
    after = policy.sample_chain(obs, min_std=0.1, generator=gen())
    torch.testing.assert_close(after.latents[:, 0], before.latents[:, 0])  # output of the frozen N-3 steps
    assert not torch.allclose(after.latents[:, -1], before.latents[:, -1])
    base = policy.sample_chain(obs, min_std=0.1, generator=gen(), use_base=True)  # the pretrained policy
    torch.testing.assert_close(base.latents, before.latents)


# --- (e) BC learns a bimodal distribution ----------------------------------------------------------


def test_bc_learns_both_modes():
    """obs in R^2 (ignored by the data), chunk [4, 1] all +1 or all -1 with probability 1/2 each."""
    torch.manual_seed(0)
    spec = EnvSpec({"state": FeatureSpec("state", (2,), "float32")}, ActionSpec("x", 1, (-1.0,), (1.0,)))
    normalizer = Normalizer.fit(
        {"state": np.random.default_rng(0).normal(size=(256, 2)), "action": np.array([[-1.0], [1.0]])},
        {"state": "meanstd", "action": "minmax"},
    )
    config = DiffusionPolicyConfig(horizon_steps=4, act_steps=2, hidden_dims=(128, 128), ema_decay=0.95)
    policy = build_policy(config, spec, normalizer)
    opt = torch.optim.AdamW(policy.net.parameters(), lr=2e-3)
    losses = []
    for _ in range(300):
        sign = torch.randint(0, 2, (256, 1, 1)) * 2.0 - 1.0
        batch = {"obs": {"state": torch.randn(256, 1, 2)}, "action": sign.expand(256, 4, 1)}
        loss, metrics = policy.loss(batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
        policy.on_train_step_end()
        losses.append(metrics["bc_loss"])
    assert np.mean(losses[-30:]) < 0.6 * np.mean(losses[:30])
    chunks = policy.predict_chunk({"state": torch.randn(1000, 1, 2)}, generator=gen())
    means = chunks.mean(dim=(1, 2))
    plus, minus = (means > 0.5).float().mean().item(), (means < -0.5).float().mean().item()
    assert 0.2 < plus < 0.8 and 0.2 < minus < 0.8
    assert 1 - plus - minus < 0.1  # little mass between the modes
    assert abs(means.mean().item()) < 0.25


# --- (f) checkpoint round trips --------------------------------------------------------------------


@pytest.mark.parametrize("sampler", ["ddpm", "ddim"])
def test_state_dict_and_export_round_trip(tmp_path, sampler):
    policy = make_policy(sampler)
    opt = torch.optim.SGD(policy.net.parameters(), lr=0.1)
    for _ in range(3):
        loss, _ = policy.loss({"obs": make_obs(), "action": torch.rand(5, H, ACT_DIM)})
        opt.zero_grad()
        loss.backward()
        opt.step()
        policy.on_train_step_end()
    obs = make_obs()
    expected = policy.predict_chunk(obs, deterministic=False, generator=gen())

    resumed = make_policy(sampler, seed=1)
    resumed.load_state_dict(policy.state_dict())
    torch.testing.assert_close(resumed.predict_chunk(obs, deterministic=False, generator=gen()), expected)
    torch.testing.assert_close(resumed.net.inp.weight, policy.net.inp.weight)

    exported = policy.export_state_dict()
    assert not any(k.startswith("ema_") for k in exported)
    save_file(exported, tmp_path / "model.safetensors")
    shipped = make_policy(sampler, seed=2)
    shipped.load_state_dict(load_file(tmp_path / "model.safetensors"))
    torch.testing.assert_close(shipped.predict_chunk(obs, deterministic=False, generator=gen()), expected)

    # a fine-tuned checkpoint rebuilds both networks from its config
    shipped.enable_finetuning(2)
    with torch.no_grad():
        shipped.ft_net.out.bias.add_(0.3)
    finetuned = build_policy(shipped.config, shipped.spec, shipped.normalizer)
    finetuned.load_state_dict(shipped.export_state_dict())
    torch.testing.assert_close(
        finetuned.predict_chunk(obs, generator=gen()), shipped.predict_chunk(obs, generator=gen())
    )


# --- (g) errors at the boundary --------------------------------------------------------------------


def test_wrong_obs_key_or_history_is_named():
    policy = make_policy()
    with pytest.raises(KeyError, match="'state'"):
        policy.predict_chunk({"qpos": torch.zeros(2, T_O, OBS_DIM)})
    with pytest.raises(ValueError, match=r"'state'.*\[B, 2, 3\].*\(2, 1, 3\)"):
        policy.predict_chunk({"state": torch.zeros(2, 1, OBS_DIM)})
    with pytest.raises(ValueError, match=r"action.*\[B, 4, 2\]"):
        policy.loss({"obs": make_obs(), "action": torch.zeros(5, H + 1, ACT_DIM)})


def test_config_validation_and_preset():
    with pytest.raises(ValueError, match="ft_denoising_steps"):
        DiffusionPolicyConfig(sampler="ddim", ddim_steps=5, ft_denoising_steps=6)
    with pytest.raises(ValueError, match="sampler"):
        DiffusionPolicyConfig(sampler="euler")
    cfg = from_dict(DiffusionPolicyConfig, load_yaml(REPO_ROOT / "policies" / "diffusion_mlp.yaml"))
    assert cfg.type == "diffusion_mlp" and cfg.num_denoising_steps == 20


@pytest.mark.parametrize("finetuning", [False, True])
def test_decode_noise_is_the_deterministic_ddim_chain_from_that_noise(finetuning):
    """DSRL's decoder: the same noise gives the same chunk, and x_K = 0 gives the deterministic evaluation
    sampler's chunk (DDIM η = 0 from zero noise), also when fine-tuning split the chain over two networks."""
    policy = make_policy("ddim", ddim_steps=4)
    if finetuning:
        policy.enable_finetuning(2)
    obs = {"state": torch.randn(5, T_O, OBS_DIM)}
    noise = torch.randn(5, H, ACT_DIM)
    with torch.no_grad():
        first, second = policy.decode_noise(obs, noise), policy.decode_noise(obs, noise)
        assert torch.equal(first, second)
        assert not torch.allclose(first, policy.decode_noise(obs, torch.zeros_like(noise)))
        assert torch.allclose(policy.decode_noise(obs, torch.zeros_like(noise)),
                              policy.predict_chunk(obs, deterministic=True), atol=1e-5)
