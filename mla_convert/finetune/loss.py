"""Distillation loss: KL(teacher || student) on temperature-softened logits, plus optional next-token CE.

KL(p_teacher || p_student) is the forward KL, the one whose minimiser is the teacher's distribution
itself (mode-covering), which is what healing a converted model should do: the student is the same
network with an approximated attention, so the target is the teacher's exact output, not just its
argmax.  The T^2 factor keeps gradient sizes comparable across temperatures (Hinton et al.).
Everything is computed in fp32 whatever the autocast dtype: log-softmax over a large vocabulary in
bf16 loses the small probabilities KL depends on.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class LossParts:
    total: torch.Tensor  # what backward runs on
    kd: float  # mean per-token KL (at temperature T, times T^2), 0 if unused
    ce: float  # mean next-token cross-entropy of the student (always measured: it is free)


def kl_teacher_student(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Mean over tokens of T^2 * KL(softmax(t/T) || softmax(s/T)); logits (..., vocab)."""
    vocab = student_logits.shape[-1]
    student = F.log_softmax(student_logits.float().reshape(-1, vocab) / temperature, dim=-1)  # (N, V)
    teacher = F.log_softmax(teacher_logits.float().reshape(-1, vocab) / temperature, dim=-1)  # (N, V)
    kl = F.kl_div(student, teacher, log_target=True, reduction="sum") / student.shape[0]
    return kl * temperature**2


def next_token_ce(student_logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of predicting token t+1 from positions <= t; logits (B, T, V), ids (B, T)."""
    vocab = student_logits.shape[-1]
    predicting = student_logits[:, :-1].float().reshape(-1, vocab)  # (B*(T-1), V)
    targets = input_ids[:, 1:].reshape(-1)  # (B*(T-1),)
    return F.cross_entropy(predicting, targets)


def distillation_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor | None, input_ids: torch.Tensor,
                      kd_weight: float = 1.0, ce_weight: float = 0.0, temperature: float = 1.0) -> LossParts:
    """kd_weight * KD + ce_weight * CE, with both parts reported."""
    ce = next_token_ce(student_logits, input_ids)
    total = ce * ce_weight if ce_weight else None
    kd_value = 0.0
    if kd_weight:
        if teacher_logits is None:
            raise ValueError("kd_weight > 0 needs teacher logits")
        kd = kl_teacher_student(student_logits, teacher_logits, temperature)
        kd_value = kd.item()
        total = kd * kd_weight if total is None else total + kd * kd_weight
    return LossParts(total, kd_value, ce.item())
