"""On-policy distillation as pure functions: per-token divergences between the student (the policy
being trained, on its own samples) and one or more teachers, and the two roles they play in the loss.

Divergences are reverse, student || teacher (the student's samples weight them), except the forward
`*_fkl` ones, teacher || student (the positions are still the student's own; per position it is
cross-entropy to the teacher's distribution: mode-covering, so a student far from its teacher is
pulled onto tokens it hardly samples yet, where reverse KL's gradient is as small as their mass). Tensors are
[B, T] over response positions, with a teacher axis M: teacher logprobs of the sampled token
[B, T, M], and for support-based signals the teacher's top-k ids and logprobs [B, T, M, K] with the
student's logprobs gathered at the same ids.

    sampled token   k1 = log q(y) - log p(y)   (signed: the only one fit to shape an advantage)
                    k2 = (k1)^2 / 2,  k3 = p(y)/q(y) - 1 - log(p(y)/q(y))   (non-negative losses)
    top-k           KL(q || p), KL(p || q) and JSD(q, p) over the teacher's top-k tokens plus one
                    bucket for the rest of the mass on each side
    full            the same over the whole vocabulary (K = V, no tail: exact)

Roles: PG-style shapes the advantage per token, A_t - lambda * d_t (d detached); GKD-style mixes
a distillation loss into the objective, (1 - g) * L_RL + g * L_GKD (g = 1: pure distillation, no
task reward needed). Several teachers of one sample mix per token by weight: d = sum_m w_m d_m.
"""
from __future__ import annotations

import torch

SAMPLED = ("k1", "k2", "k3")
SUPPORT = ("topk_kl", "topk_fkl", "topk_jsd", "full_kl", "full_fkl", "full_jsd")
_EPS = 1e-8


def sampled_token(kind: str, student_lp: torch.Tensor, teacher_lp: torch.Tensor) -> torch.Tensor:
    """Schulman's estimators of KL(q || p) from the sampled token's logprobs (any matching shapes)."""
    d = student_lp - teacher_lp
    if kind == "k1":
        return d
    if kind == "k2":
        return 0.5 * d * d
    if kind == "k3":
        return torch.exp(-d) - 1.0 + d
    raise ValueError(f"sampled-token signal: expected one of {SAMPLED}, got {kind!r}")


def _with_tail(lp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Probabilities of the support [..., K] and the mass outside it [...] (clamped above 0)."""
    p = lp.exp()
    return p, (1.0 - p.sum(-1)).clamp_min(_EPS)


def support_divergence(kind: str, student_lp: torch.Tensor, teacher_lp: torch.Tensor) -> torch.Tensor:
    """KL(q || p), KL(p || q) or JSD(q, p) over a support of K tokens ([..., K] logprobs of both on the
    teacher's top-k ids), reduced over K. `topk_*` add one bucket for the remaining mass of each side;
    `full_*` expect the whole vocabulary (K = V) and add none."""
    if kind not in SUPPORT:
        raise ValueError(f"support signal: expected one of {SUPPORT}, got {kind!r}")
    tail = kind.startswith("topk")
    if kind.endswith("kl"):  # reverse KL(q || p), or forward KL(p || q) for *_fkl
        a_lp, b_lp = (teacher_lp, student_lp) if kind.endswith("_fkl") else (student_lp, teacher_lp)
        out = (a_lp.exp() * (a_lp - b_lp)).sum(-1)
        if tail:
            (_, a_rest), (_, b_rest) = _with_tail(a_lp), _with_tail(b_lp)
            out = out + a_rest * (a_rest.log() - b_rest.log())
        return out
    q, p = student_lp.exp(), teacher_lp.exp()
    m = 0.5 * (q + p)
    log_m = m.clamp_min(_EPS).log()
    out = 0.5 * (q * (student_lp - log_m)).sum(-1) + 0.5 * (p * (teacher_lp - log_m)).sum(-1)
    if tail:
        (_, q_rest), (_, p_rest) = _with_tail(student_lp), _with_tail(teacher_lp)
        m_rest = 0.5 * (q_rest + p_rest)
        out = out + 0.5 * q_rest * (q_rest.log() - m_rest.log()) + 0.5 * p_rest * (p_rest.log() - m_rest.log())
    return out


def signal(kind: str, student_lp: torch.Tensor, teacher_lp: torch.Tensor,
           student_top_lp: torch.Tensor | None = None, teacher_top_lp: torch.Tensor | None = None) -> torch.Tensor:
    """Per token and teacher [B, T, M]: a sampled-token estimator from [B, T] student and [B, T, M]
    teacher logprobs, or a support divergence from [B, T, M, K] logprobs of both."""
    if kind in SAMPLED:
        return sampled_token(kind, student_lp.unsqueeze(-1), teacher_lp)
    if student_top_lp is None or teacher_top_lp is None:
        raise ValueError(f"signal {kind!r} needs the teacher's top-k (or full) logprobs")
    return support_divergence(kind, student_top_lp, teacher_top_lp)


def mix(per_teacher: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """[B, T, M] per-teacher signals and [B, M] per-sample teacher weights -> [B, T]."""
    return (per_teacher * weights.to(per_teacher.dtype).unsqueeze(1)).sum(-1)


def shaped_advantages(advantages: torch.Tensor, divergence: torch.Tensor, coef: float) -> torch.Tensor:
    """PG-style: A_t - lambda * d_t, the divergence taken as a fixed per-token penalty."""
    return advantages - coef * divergence.detach()
