"""The conservative term of the off-policy core's critic loss: CQL, calibrated as in Cal-QL.

CQL (Kumar et al. 2020, arXiv 2006.04779, eq. 4, the CQL(H) variant without importance sampling) adds to each
critic's Bellman error

    α · E_s [ log Σ_{a ∈ A(s)} exp Q(s, a) - Q(s, a_data) ],

where A(s) holds `num_random` uniform actions, a sample of the current policy at s, one at s' (evaluated at s, as
in the authors' code: a second draw from the policy's neighbourhood of actions, not a value of s') and the data's
own action: Q is pushed down where the policy or chance would go and up where the data went, so a critic fitted
to demonstrations alone (all successes) no longer rates every action it never saw as a success. Importance
weights are left out because PA-RL's and the diffusion policies' samples have no tractable density.

Cal-QL (Nakamoto et al. 2023, arXiv 2303.05479, eq. 5.1) bounds the policy actions' values from below by the
reference policy's value, estimated by the data's Monte-Carlo return-to-go G(s):

    Q(s, a_π) → max(Q(s, a_π), G(s)),

so the penalty stops at the value of what the data did and the pre-trained Q stays on the scale of real returns:
online fine-tuning then starts from a critic that neither overestimates (the actor follows its errors) nor
underestimates (the first online returns look like improvements and the policy unlearns). Where G is unknown
(an episode still running) the bound is -inf, plain CQL.
"""

from __future__ import annotations

import torch

from robotft.envs.base import Obs, repeat_obs
from robotft.rl.q_ensemble import QEnsemble


def conservative_penalty(critic: QEnsemble, obs: Obs, q_data: torch.Tensor, policy_action: torch.Tensor,
                         random_action: torch.Tensor, return_to_go: torch.Tensor | None) -> torch.Tensor:
    """`[E]` per-critic mean over the batch of log Σ_{a ∈ A(s)} exp Q_j(s, a) - Q_j(s, a_data) (module docstring).

    `q_data` `[E, B]` the critics at the data's actions (with gradients); `policy_action` `[B, m, D]` the current
    policy's samples (drawn at s and at s'), all valued at s; `random_action` `[B, n, D]`; `return_to_go` `[B]`
    Cal-QL's lower bound for the policy actions' values (None: plain CQL)."""
    batch, n = random_action.shape[:2]
    actions = torch.cat([random_action, policy_action], dim=1)
    q = critic(repeat_obs(obs, actions.shape[1]), actions.flatten(0, 1)).view(-1, batch, actions.shape[1])
    q_random, q_policy = q[..., :n], q[..., n:]
    if return_to_go is not None:
        q_policy = torch.maximum(q_policy, return_to_go[None, :, None])
    candidates = torch.cat([q_random, q_policy, q_data[..., None]], dim=-1)
    return (torch.logsumexp(candidates, dim=-1) - q_data).mean(dim=1)
