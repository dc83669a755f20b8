"""On-policy distillation: a teacher's per-token log-probs on the student's own samples as the learning signal.

The student (the policy) samples y ~ π; the teacher scores the same tokens. The per-token reverse KL
KL(π ‖ π_teacher) at position t is estimated from the sampled token alone (Schulman's k1, as in `kl`):

    rkl_t = log π(y_t | y_<t) - log π_teacher(y_t | y_<t)

and its negative is a dense per-token reward, used directly as the token's advantage (no discounting, no
returns: Agarwal et al. 2024, "On-policy distillation of language models" (GKD); Thinking Machines,
"On-Policy Distillation", 2025; verl #5041, prime-rl's `opd`):

    A_t = -coef · rkl_t = coef · (log π_teacher(y_t) - log π(y_t))

Minimising E_π[rkl] is mode seeking: the student is pushed toward what the teacher finds likely on the
student's own paths, where a forward KL on the teacher's samples (SFT) would spread it over everything the
teacher can say. The estimate is unbiased for sampled tokens and can be negative per token.

How lmrl departs: the signal is added to whatever advantage the algorithm computes from task rewards (a
GRPO sequence advantage broadcast over tokens); with no reward function it is the whole advantage. Inputs in
half precision are computed in float32 and returned in float32: the difference of two bfloat16 log-probs is
exact in float32, and rounding it back would lose what the signal is made of.
"""

from __future__ import annotations

import torch

__all__ = ["distill_advantages", "distill_reverse_kl"]


def _work_dtype(logp: torch.Tensor, teacher_logp: torch.Tensor) -> torch.dtype:
    return torch.promote_types(torch.result_type(logp, teacher_logp), torch.float32)


def _check(logp: torch.Tensor, teacher_logp: torch.Tensor, mask: torch.Tensor) -> None:
    if teacher_logp.shape != logp.shape:
        raise ValueError(f"teacher_logp: shape {tuple(teacher_logp.shape)} does not match logp {tuple(logp.shape)}")
    if mask.shape != logp.shape:
        raise ValueError(f"mask: shape {tuple(mask.shape)} does not match logp {tuple(logp.shape)}")


def distill_reverse_kl(logp: torch.Tensor, teacher_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-token estimate of the reverse KL(π ‖ π_teacher) on tokens the student sampled.

    rkl_t = logp_t - teacher_logp_t on real tokens, 0 on masked ones (which may hold anything, inf or NaN).

    Args:
        logp: [B, T] log-probs of the sampled tokens under the student (the policy that sampled them).
        teacher_logp: [B, T] log-probs of the same tokens under the teacher.
        mask: [B, T] bool or 0/1, true on real response tokens.

    Returns:
        [B, T] in float32 (float64 for float64 inputs), differentiable in both arguments.
    """
    _check(logp, teacher_logp, mask)
    work = _work_dtype(logp, teacher_logp)
    rkl = logp.to(work) - teacher_logp.to(work)
    # where(), not rkl * mask: garbage at masked positions must not leak as NaN
    return torch.where(mask.bool(), rkl, torch.zeros((), dtype=work, device=rkl.device))


def distill_advantages(
    logp: torch.Tensor, teacher_logp: torch.Tensor, mask: torch.Tensor, coef: float = 1.0
) -> torch.Tensor:
    """Per-token advantages of on-policy distillation: A_t = -coef · (logp_t - teacher_logp_t).

    Positive where the teacher finds the sampled token likelier than the student does (more of it), negative
    where the student is more confident than the teacher (less of it); 0 on masked tokens and everywhere when
    teacher = student. Detached: it is a reward, not a loss term.

    Args:
        logp: [B, T] log-probs of the sampled tokens under the student.
        teacher_logp: [B, T] log-probs of the same tokens under the teacher.
        mask: [B, T] bool or 0/1, true on real response tokens.
        coef: weight of the signal, >= 0 (`algorithm.distill_coef`).

    Returns:
        [B, T] float32 (float64 for float64 inputs), no gradient.
    """
    if coef < 0:
        raise ValueError(f"coef: must be >= 0, got {coef}")
    return (-coef * distill_reverse_kl(logp, teacher_logp, mask)).detach()
