"""On-policy distillation wired through a run: the teacher's log-probs in the experience, the advantage they add,
the teacher's placement, a run with no reward function, and its metrics (the math: tests/algorithms)."""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import pytest
import torch

from lmrl import algorithms as A
from lmrl.config import load_config
from lmrl.experience import make_experience
from lmrl.models.shipped import SHIPPED_MODEL
from tests.forked import lmrl
from tests.test_experience import SCORES, rollout

ROOT = Path(__file__).resolve().parents[1]


def test_experience_adds_the_teacher_signal_to_the_group_advantage():
    r = rollout()  # B=4 in 2 groups of 2, T=5, lengths 5, 3, 2, 4
    teacher = torch.full((4, 5), -0.5)
    calls = []

    def teacher_fn(seqs, attn, T):
        calls.append((seqs.shape[0], T))
        return teacher[: seqs.shape[0]]

    options = load_config(None, ["algorithm.distill_coef=0.5"]).algorithm.options_for(make_experience)
    exp = make_experience(r, SCORES, **options, policy_logprobs=None, teacher_logprobs=teacher_fn, micro_batch_size=4)
    plain = make_experience(r, SCORES, **options, policy_logprobs=None)
    mask = r.response_mask
    # the student's log-probs are the sampler's (one update per batch): A_t = A_grpo + 0.5 (teacher_t - student_t)
    expected = plain.advantages + torch.where(mask, 0.5 * (teacher - r.logprobs), torch.zeros(()))
    torch.testing.assert_close(exp.advantages, expected, rtol=0, atol=1e-6)
    assert calls == [(4, 5)]
    assert not exp.advantages[~mask].any()  # nothing on padding
    torch.testing.assert_close(exp.info["distill_rkl"], A.masked_sum(r.logprobs - teacher, mask, dim=1))


def test_experience_with_zero_scores_is_the_signal_alone():
    r = rollout()
    teacher = -torch.rand(4, 5, generator=torch.Generator().manual_seed(1))
    options = load_config(None, []).algorithm.options_for(make_experience)
    exp = make_experience(r, torch.zeros(4), **options, policy_logprobs=None, teacher_logprobs=lambda s, a, T: teacher)
    torch.testing.assert_close(exp.advantages, A.distill_advantages(r.logprobs, teacher, r.response_mask))


def test_a_teacher_makes_reward_functions_optional():
    cfg = load_config(None, ["algorithm.teacher=tiny-addition"])
    assert not cfg.trains_on_rewards  # the task's reward evaluates; none trains
    assert load_config(None, ["algorithm.teacher=tiny-addition", "reward.functions=[exact_match]"]).trains_on_rewards
    assert load_config(None, []).trains_on_rewards


def _perturbed_copy(directory: Path, scale: float) -> None:
    """The shipped model with every weight moved by `scale` times its tensor's std of noise (seeded)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(SHIPPED_MODEL, directory)
    weights = load_file(directory / "model.safetensors")
    g = torch.Generator().manual_seed(0)
    weights = {k: v + scale * v.float().std() * torch.randn(v.shape, generator=g) for k, v in weights.items()}
    save_file(weights, directory / "model.safetensors", metadata={"format": "pt"})


def test_the_teacher_is_placed_like_the_reference(tmp_path):
    from lmrl.build import load_models

    _perturbed_copy(tmp_path / "teacher", 0.1)
    cfg = load_config(None, [f"algorithm.teacher={tmp_path / 'teacher'}", "algorithm.kl_coef=0.01", "model.dropout=true"])
    models = load_models(cfg)
    t, ref = models.teacher, models.reference
    assert not t.training and not any(p.requires_grad for p in t.parameters())
    assert next(t.parameters()).dtype == next(ref.parameters()).dtype == next(models.policy.parameters()).dtype
    assert next(t.parameters()).device == next(models.policy.parameters()).device
    assert not torch.equal(t.lm_head.weight, models.policy.lm_head.weight)  # its own weights, not a copy
    bf16 = load_models(load_config(None, [f"algorithm.teacher={tmp_path / 'teacher'}", "model.dtype=bfloat16"]))
    assert next(bf16.teacher.parameters()).dtype == torch.bfloat16  # the policy's dtype, whatever its checkpoint's


def test_a_run_with_no_reward_function_trains_on_the_teacher_alone(tmp_path):
    """A teacher from 40 GRPO steps, then `lmrl train` of the shipped model from it with no reward function: rc 0,
    distill/reverse_kl logged and finite at every step and falling as the student takes the teacher's ways, the task
    reward logged but not trained on (objective/scores 0), a final model saved."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    quiet = ("data.num_eval_prompts=0", "log.console=false")
    teacher = lmrl("train", "train.steps=40", *quiet, f"train.output_dir={tmp_path / 'teacher'}", cwd=tmp_path, env=env,
                   timeout=120)
    assert teacher.returncode == 0, teacher.stderr[-2000:]
    proc = lmrl("train", f"algorithm.teacher={tmp_path / 'teacher' / 'final'}", "train.steps=8", *quiet,
                f"train.output_dir={tmp_path / 'run'}", cwd=tmp_path, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 8
    for row in rows:
        assert math.isfinite(row["distill/reverse_kl"])
        assert row["distill/teacher_logprob"] < 0
        assert row["objective/scores"] == 0.0 and "reward/mean" in row  # logged, not trained on
    rkl = [row["distill/reverse_kl"] for row in rows]
    # measured: 0.198, 0.118, 0.104, 0.067, 0.057, 0.094, 0.053, 0.058 (the student starts 0.2 nats per token away)
    assert rkl[0] > 0.05 and sum(rkl[-3:]) / 3 < 0.6 * sum(rkl[:2]) / 2, rkl
    assert (tmp_path / "run" / "final" / "model.safetensors").is_file()
    shutil.rmtree(tmp_path / "teacher")  # evaluating the result needs no teacher
    evaluated = lmrl("eval", str(tmp_path / "run"), "--num-prompts", "4", cwd=tmp_path, env=env, timeout=120)
    assert evaluated.returncode == 0 and "4 prompts of" in evaluated.stdout, evaluated.stderr[-2000:]


def test_a_dataset_with_no_reward_function_distils_and_resumes_exactly(tmp_path):
    """`reward.functions=[]` with a dataset is refused without a teacher and accepted with one (nothing scores: no
    evaluation); the teacher is frozen, so a run resumed from a checkpoint is the straight run to the bit."""
    from lmrl import Config, Trainer
    from lmrl.errors import ConfigError

    _perturbed_copy(tmp_path / "teacher", 0.3)
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps({"prompt": f"{i}+{i}="}) + "\n" for i in range(40)))

    def cfg(out, steps, resume=None, teacher=True):
        return Config(train={"steps": steps, "output_dir": str(out), "save_every": 1, "resume": resume},
                      log={"console": False}, rollout={"prompts_per_step": 4, "group_size": 4},
                      data={"path": str(tmp_path / "rows.jsonl"), "eval_path": str(tmp_path / "rows.jsonl")},
                      algorithm={"teacher": str(tmp_path / "teacher") if teacher else None})

    with pytest.raises(ConfigError, match="reward.functions: a dataset needs at least one reward function"):
        Trainer(cfg(tmp_path / "none", 1, teacher=False))

    def run(out, steps, resume=None):
        trainer = Trainer(cfg(out, steps, resume))
        assert trainer.data.eval_rows == [] and trainer.data.rewards.names == ["none"]
        trainer.train()
        return trainer.policy.state_dict(), trainer.forward_counts

    whole, counts = run(tmp_path / "whole", 3)
    assert counts["teacher"] == 3 and counts["reference"] == 0
    run(tmp_path / "split", 1)
    resumed, _ = run(tmp_path / "split", 3, resume="auto")
    assert all(torch.equal(whole[k], resumed[k]) for k in whole)
    start = Trainer(cfg(tmp_path / "unused", 1)).policy.state_dict()
    assert any(not torch.equal(whole[k], start[k]) for k in whole)  # it trained


def test_the_teachers_forward_is_the_references_chunked_one(monkeypatch):
    """Forwards.teacher: no gradient, the run's temperature and chunk size (never the whole [B, T, V] log-softmax
    at once), each prompt once, and the log-probs a plain forward of the teacher gives."""
    from lmrl.models import forward as F
    from lmrl.models.forward import Forwards, model_forward_logprobs
    from lmrl.models.shipped import SHIPPED_MODELS, load_shipped

    policy, _ = load_shipped()
    teacher, _ = load_shipped(SHIPPED_MODELS["tiny-calculator"])
    seqs = torch.randint(3, 20, (4, 9), generator=torch.Generator().manual_seed(0))
    seqs[1] = seqs[0]  # two rows of one prompt and completion
    attn = torch.ones_like(seqs)
    chunks = []
    real = F.token_logprobs
    monkeypatch.setattr(F, "token_logprobs", lambda *a, **k: chunks.append(k["chunk_size"]) or real(*a, **k))
    f = Forwards(policy, None, None, temperature=0.7, chunk_size=3, share_prompt=True, autocast_bf16=False,
                 shared_critic=False, teacher=teacher)
    out = f.teacher(seqs, attn, 5)
    assert chunks == [3] and not out.requires_grad and f.counts["teacher"] == 1
    plain = model_forward_logprobs(teacher, seqs, attn, 5, temperature=0.7)
    torch.testing.assert_close(out, plain, rtol=0, atol=1e-5)
    assert not torch.allclose(out, model_forward_logprobs(policy, seqs, attn, 5, temperature=0.7))  # the teacher's


def test_a_lora_student_distils_from_a_whole_teacher(tmp_path):
    """With LoRA adapters on the student, the teacher is its own whole model (the adapters' base is the reference, not
    the teacher): a step moves the adapters only, with the teacher's signal in the advantages."""
    pytest.importorskip("peft")
    from lmrl import Config, Trainer

    cfg = Config(train={"steps": 1, "output_dir": str(tmp_path / "run")}, log={"console": False},
                 rollout={"prompts_per_step": 4, "group_size": 4}, data={"num_eval_prompts": 0},
                 algorithm={"teacher": "tiny-calculator"},
                 model={"lora": {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}})
    trainer = Trainer(cfg)
    assert not any(p.requires_grad for p in trainer.models.teacher.parameters())
    assert not hasattr(trainer.models.teacher, "peft_config")  # not wrapped: LoRA is the student's
    before = {k: v.clone() for k, v in trainer.policy.state_dict().items()}
    step = trainer.train_step(1)
    assert math.isfinite(step["distill/reverse_kl"]) and step["distill/reverse_kl"] > 0.01  # another model's verdict
    moved = {k for k, v in trainer.policy.state_dict().items() if not torch.equal(v, before[k])}
    assert moved and all("lora_" in k for k in moved)
