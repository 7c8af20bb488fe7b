"""The warning when exploration noise breaks the starting policy: its exploring rollouts (before the first actor
update) succeed in less than half as many episodes as the same policy with noise off."""

from robotft.cli import main
from robotft.finetune import StartingRollouts
from robotft.rl.dppo import DPPO
from robotft.rl.gaussian_ppo import GaussianPPO


def test_warns_once_at_the_last_rollout_before_the_first_actor_update():
    check = StartingRollouts(noise_off_success=0.46, last_iteration=3)
    assert [check.observe(i, int(i == 1), 5, DPPO) for i in range(3)] == [None, None, None]
    warning = check.observe(3, 0, 5, DPPO)
    assert warning is not None and "5% of 20 episodes" in warning and "46%" in warning
    assert "--dppo.min_sampling_std" in warning
    assert check.observe(4, 0, 5, DPPO) is None, "later rollouts come from an updated policy"


def test_no_warning_when_the_rollouts_keep_half_the_noise_off_success():
    check = StartingRollouts(noise_off_success=0.78, last_iteration=3)
    assert all(check.observe(i, 3, 6, DPPO) is None for i in range(4))  # 50% against 78%


def test_no_warning_without_a_comparison_or_with_too_little_evidence():
    assert StartingRollouts(None, 0).observe(0, 0, 50, DPPO) is None, "no evaluation before fine-tuning"
    assert StartingRollouts(0.1, 0).observe(0, 0, 50, DPPO) is None, "a policy at 10% has little to break"
    assert StartingRollouts(0.9, 0).observe(0, 0, 5, DPPO) is None, "5 episodes are too few"


def test_the_warning_names_no_flag_for_an_algorithm_without_one():
    warning = StartingRollouts(0.9, 0).observe(0, 0, 20, GaussianPPO)
    assert warning is not None and "less noise" not in warning and "residual_ppo" in warning


def test_finetune_warns_when_its_noise_breaks_the_policy(tmp_path, toy_pretrain, capsys):
    """A diffusion BC that reaches the goal with noise off, fine-tuned by DPPO with a noise floor of 2
    (normalized units: actions drawn nearly at random)."""
    bc = toy_pretrain(tmp_path / "bc", "diffusion_mlp", 1000, "--policy.hidden_dims", "128,128,128",
                      "--train.lr", "3e-3", "--train.batch_size", "128")
    capsys.readouterr()
    assert main(["finetune", "--from", str(bc), "--algo", "dppo", "--out", str(tmp_path / "ft"), "--iterations", "1",
                 "--rl.critic_warmup_iters", "0", "--env.num_envs", "20", "--eval_episodes", "40",
                 "--dppo.min_sampling_std", "2.0"]) == 0
    err = capsys.readouterr().err
    assert "exploration noise breaks this policy" in err and "--dppo.min_sampling_std" in err
