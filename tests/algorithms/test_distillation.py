"""On-policy distillation's signal: the per-token reverse KL to a teacher and the advantages it gives."""

from __future__ import annotations

import pytest
import torch

from lmrl.algorithms import distill_advantages, distill_reverse_kl

# 2 sequences x 3 tokens; the second sequence has 2 real tokens (its last is padding holding garbage)
STUDENT = torch.tensor([[-0.5, -1.0, -2.0],
                        [-0.1, -3.0, float("nan")]])
TEACHER = torch.tensor([[-1.5, -1.0, -0.5],
                        [-0.6, -2.0, -4.0]])
MASK = torch.tensor([[True, True, True],
                     [True, True, False]])


def test_hand_worked_2x3_case():
    # rkl = student - teacher: [-0.5 + 1.5, -1.0 + 1.0, -2.0 + 0.5] = [1.0, 0.0, -1.5]
    #                          [-0.1 + 0.6, -3.0 + 2.0, masked]      = [0.5, -1.0, 0.0]
    expected_rkl = torch.tensor([[1.0, 0.0, -1.5], [0.5, -1.0, 0.0]])
    torch.testing.assert_close(distill_reverse_kl(STUDENT, TEACHER, MASK), expected_rkl, rtol=0, atol=1e-6)
    # advantages = -coef * rkl, coef 0.5: [-0.5, 0, 0.75], [-0.25, 0.5, 0]
    expected_adv = torch.tensor([[-0.5, 0.0, 0.75], [-0.25, 0.5, 0.0]])
    torch.testing.assert_close(distill_advantages(STUDENT, TEACHER, MASK, coef=0.5), expected_adv, rtol=0, atol=1e-6)
    # the mean per real token (what distill/reverse_kl logs): (1 + 0 - 1.5 + 0.5 - 1) / 5 = -0.2
    assert distill_reverse_kl(STUDENT, TEACHER, MASK).sum().item() / MASK.sum().item() == pytest.approx(-0.2)


def test_zero_when_teacher_is_student():
    logp = -torch.rand(4, 7)
    mask = torch.rand(4, 7) > 0.3
    assert torch.equal(distill_reverse_kl(logp, logp.clone(), mask), torch.zeros(4, 7))
    assert torch.equal(distill_advantages(logp, logp.clone(), mask), torch.zeros(4, 7))


def test_sign_more_of_what_the_teacher_likes():
    logp = torch.full((1, 2), -1.0)
    teacher = torch.tensor([[-0.2, -3.0]])  # token 0: the teacher likes it more; token 1: less
    adv = distill_advantages(logp, teacher, torch.ones(1, 2, dtype=torch.bool))
    assert adv[0, 0] > 0 and adv[0, 1] < 0


def test_masked_positions_never_change_the_result_or_the_gradient():
    logp = STUDENT.nan_to_num(0.0).clone().requires_grad_()
    teacher = TEACHER.clone()
    garbage_logp, garbage_teacher = logp.detach().clone(), teacher.clone()
    garbage_logp[1, 2], garbage_teacher[1, 2] = float("inf"), float("nan")
    out = distill_reverse_kl(logp, teacher, MASK)
    assert torch.isfinite(distill_reverse_kl(garbage_logp, garbage_teacher, MASK)).all()
    torch.testing.assert_close(distill_reverse_kl(garbage_logp, garbage_teacher, MASK), out.detach())
    out.sum().backward()
    torch.testing.assert_close(logp.grad, MASK.float())  # d(sum rkl)/d logp = 1 on real tokens, 0 elsewhere


def test_advantages_carry_no_gradient_and_inputs_are_not_modified():
    logp = (-torch.rand(2, 3)).requires_grad_()
    teacher = -torch.rand(2, 3)
    before = logp.detach().clone(), teacher.clone()
    adv = distill_advantages(logp, teacher, MASK)
    assert not adv.requires_grad
    assert torch.equal(logp.detach(), before[0]) and torch.equal(teacher, before[1])


def test_bfloat16_inputs_are_computed_in_float32():
    student, teacher = STUDENT.nan_to_num(0.0), TEACHER
    out = distill_reverse_kl(student.bfloat16(), teacher.bfloat16(), MASK)
    assert out.dtype == torch.float32
    # within bf16's rounding of the inputs (-0.1 and -0.6 are not exact in bf16: 8 bits of mantissa)
    torch.testing.assert_close(out, distill_reverse_kl(student, teacher, MASK), rtol=0, atol=4e-3)
    # values bf16 rounds: the result is the difference of the rounded inputs, not rounded once more
    a, b = torch.tensor([[-1.001]]), torch.tensor([[-1.0]])
    got = distill_reverse_kl(a.bfloat16(), b.bfloat16(), torch.ones(1, 1, dtype=torch.bool))
    assert got.item() == a.bfloat16().float().item() - b.bfloat16().float().item()


def test_float32_is_kept():
    assert distill_advantages(STUDENT, TEACHER, MASK).dtype == torch.float32


def test_errors_name_the_argument():
    with pytest.raises(ValueError, match=r"teacher_logp: shape \(2, 2\) does not match logp \(2, 3\)"):
        distill_reverse_kl(STUDENT, TEACHER[:, :2], MASK)
    with pytest.raises(ValueError, match=r"mask: shape"):
        distill_reverse_kl(STUDENT, TEACHER, MASK[:, :2])
    with pytest.raises(ValueError, match=r"coef: must be >= 0, got -1"):
        distill_advantages(STUDENT, TEACHER, MASK, coef=-1)
