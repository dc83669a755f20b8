"""End-to-end training on tiny models: every algorithm runs, skipped work is skipped, invariants hold."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch
from transformers import AutoModelForCausalLM

from lmrl.config import ALGORITHM_PRESETS, load_config
from lmrl.models.critic import HEAD_FILE, PolicyValueHead
from lmrl.models.forward import model_forward_logprobs
from lmrl.models.tiny import char_tokenizer, tiny_causal_lm
from lmrl.trainer import Trainer
from tests.models.test_loading import tiny_dropout_lm

ROWS = [{"prompt": f"{i}+{i}=", "kind": "digits"} for i in range(40)]


def digit_share(prompts, completions, kind, **kw):
    """A reward that varies between a random model's samples: the share of characters that are `kind`."""
    assert set(kind) == {"digits"}  # dataset columns reach reward functions
    return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]


def make_trainer(tmp_path, *overrides, model=None, device=None, **kw):
    tok = char_tokenizer()
    model = model or tiny_causal_lm(tok, hidden_size=32, num_layers=1, seed=0)
    on = [f"model.device={device}"] if device is not None else []
    cfg = load_config(None, [
        "train.steps=2", "rollout.prompts_per_step=4", "rollout.group_size=4", "rollout.max_new_tokens=6",
        "optim.lr=1e-2", f"train.output_dir={tmp_path}", "log.console=false", "train.eval_every=0", *on, *overrides])
    return Trainer(cfg, model=model, tokenizer=tok, reward_funcs=[digit_share], train_dataset=ROWS,
                   eval_dataset=ROWS[:4], **kw)


@pytest.mark.parametrize("algorithm", list(ALGORITHM_PRESETS))
def test_every_algorithm_trains_end_to_end(tmp_path, algorithm):
    trainer = make_trainer(tmp_path, f"algorithm={algorithm}")
    before = [p.detach().clone() for p in trainer.policy.parameters()]
    result = trainer.train()
    assert len(result.history) == 2
    last = result.history[-1]
    assert all(torch.isfinite(torch.tensor(v)) for k, v in last.items() if k.startswith(("loss/", "policy/")))
    changed = any(not torch.equal(a, b) for a, b in zip(before, trainer.policy.parameters()))
    assert changed, "no weight changed"
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert "policy/clipfrac_avg" in rows[-1] and "objective/scores" in rows[-1]
    assert "reward/digit_share/mean" in rows[-1]
    # the final model is plain transformers
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "final")
    p0 = next(iter(trainer.policy.state_dict().values()))
    assert torch.allclose(next(iter(reloaded.state_dict().values())), p0.cpu())


def test_no_reference_forward_without_kl_and_no_extra_policy_forward(tmp_path):
    trainer = make_trainer(tmp_path, "algorithm=grpo", "algorithm.kl_coef=0", "optim.micro_batch_size=8")
    assert trainer.models.reference is None
    trainer.train()
    # 2 steps x (16 sequences / micro-batch 8) grad forwards; no old-log-prob forward, no reference
    assert trainer.forward_counts == {"policy": 4, "reference": 0, "critic": 0}


def test_reference_and_old_forwards_happen_when_needed(tmp_path):
    trainer = make_trainer(tmp_path, "algorithm.kl_coef=0.1", "algorithm.num_iterations=2", "optim.micro_batch_size=16")
    trainer.train()
    # per step: 1 old-log-prob forward + 2 iterations x 1 micro-batch; 1 reference forward
    assert trainer.forward_counts == {"policy": 6, "reference": 2, "critic": 0}


def test_ppo_with_a_shared_critic_reads_values_from_the_policys_forward(tmp_path):
    """model.shared_critic: the critic is a value head on the policy (its only parameters, at critic_lr); the
    update takes values from the policy's own forward, so the only critic forward is the experience's (no grad);
    the head and the policy learn, and the head is saved with the model."""
    trainer = make_trainer(tmp_path, "algorithm=ppo", "model.shared_critic=true", "optim.micro_batch_size=16",
                           "optim.critic_lr=3e-3")
    head = trainer.models.critic
    assert isinstance(head, PolicyValueHead)
    critic_group = trainer.optimizer.param_groups[-1]
    assert critic_group["lr"] == 3e-3 and {id(p) for p in critic_group["params"]} == {id(p) for p in head.parameters()}
    before = head.value_head.weight.detach().clone()
    history = trainer.train().history
    # per step: the update's policy forward, the reference's, and the experience's critic forward
    assert trainer.forward_counts == {"policy": 2, "reference": 2, "critic": 2}
    assert history[0]["val/clipfrac_avg"] == 0.0  # step 1: the update's values equal the experience's
    assert all(math.isfinite(h["loss/value_avg"]) for h in history)
    assert not torch.equal(before, head.value_head.weight)
    assert (tmp_path / "final" / "critic" / HEAD_FILE).is_file()


def test_step_one_invariants(tmp_path, device):
    """First minibatch: ratio 1 (the sampler's log-probs are the trainer's), clip fraction 0; KL to the
    (identical) reference 0."""
    trainer = make_trainer(tmp_path, "algorithm.kl_coef=0.1", "train.steps=1", device=device)
    assert next(trainer.policy.parameters()).device.type == device.type
    m = trainer.train().history[0]
    assert m["val/ratio"] == pytest.approx(1.0, abs=1e-5)
    assert m["policy/clipfrac_avg"] == 0.0
    assert m["policy/approxkl_avg"] == pytest.approx(0.0, abs=1e-8)
    assert abs(m["objective/kl"]) < 1e-4
    assert abs(m["objective/kl_loss"]) < 1e-6


@pytest.mark.filterwarnings("ignore:Seems like `optimizer.step\\(\\)` has been overridden")
@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_gradient_accumulation_1x8_equals_8x1(tmp_path, aggregation):
    """One micro-batch of 8 rows, 8 of one row, and micro-batches cut by tokens give one gradient."""
    tok = char_tokenizer()
    grads, counts = [], []
    for micro in ("8", "1", "8 optim.micro_batch_tokens=40"):
        size, *tokens = micro.split()
        trainer = make_trainer(tmp_path / micro, f"optim.micro_batch_size={size}", *tokens, "rollout.prompts_per_step=2",
                               f"algorithm.aggregation={aggregation}", "optim.max_grad_norm=null",
                               model=tiny_causal_lm(tok, hidden_size=32, num_layers=1, seed=0))
        c = trainer.collect(1)
        from lmrl.experience import make_experience

        exp = make_experience(c.rollout, c.scores, **trainer.cfg.algorithm.options_for(make_experience), policy_logprobs=None)
        trainer.optimizer.step = lambda: None  # keep the gradients, skip the update
        trainer.updater.optimizer_step(exp)
        grads.append(torch.cat([p.grad.flatten() for p in trainer.policy.parameters()]))
        counts.append(trainer.forward_counts["policy"])
    assert grads[0].abs().max() > 0 and counts[0] == 1 and 1 < counts[2] < counts[1]  # (rows without signal skip)
    torch.testing.assert_close(grads[0], grads[1], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(grads[0], grads[2], atol=1e-5, rtol=1e-4)


def _step_with_zeroed_groups(tmp_path, skip: bool, zero_groups, steps=1, *overrides):
    """Parameters after `steps` optimizer steps on one batch whose listed groups have zero advantages."""
    from lmrl.experience import make_experience

    tok = char_tokenizer()
    trainer = make_trainer(tmp_path, "optim.micro_batch_size=1", "rollout.prompts_per_step=3", *overrides,
                           model=tiny_causal_lm(tok, hidden_size=32, num_layers=1, seed=0))
    c = trainer.collect(1)
    exp = make_experience(c.rollout, c.scores, **trainer.cfg.algorithm.options_for(make_experience), policy_logprobs=None)
    for g in exp.group_index.unique().tolist():  # the listed groups' advantages 0, every other row's nonzero
        rows = exp.group_index == g
        exp.advantages[rows] = 0.0 if g in zero_groups else torch.where(exp.advantages[rows] == 0, 0.25, exp.advantages[rows])
    if not skip:
        trainer.updater.rows_with_gradient = lambda mb: torch.arange(len(mb))
    stats = [trainer.updater.optimizer_step(exp if i == 0 else exp.select(torch.arange(len(exp)))) for i in range(steps)]
    return [p.detach().clone() for p in trainer.policy.parameters()], trainer.forward_counts["policy"], stats


@pytest.mark.parametrize("zero_groups", [[0, 2], [0, 1, 2]])
def test_rows_with_zero_advantage_are_skipped_without_changing_the_update(tmp_path, zero_groups):
    """Rows whose advantages are all 0 are left out of the forward: the parameters after the step are
    the same, also when no row is left (Adam's momentum and weight decay still act on a zero gradient)."""
    overrides = ["optim.weight_decay=0.1"]
    skipped, n_skipped, stats = _step_with_zeroed_groups(tmp_path / "a", True, zero_groups, 2, *overrides)
    full, n_full, _ = _step_with_zeroed_groups(tmp_path / "b", False, zero_groups, 2, *overrides)
    G = 4
    assert n_full == 2 * 3 * G and n_skipped == 2 * (3 - len(zero_groups)) * G  # micro-batch 1: a forward per row
    assert stats[0]["update/rows_skipped"] == pytest.approx(len(zero_groups) / 3)
    for a, b in zip(skipped, full):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_no_row_is_skipped_when_an_entropy_bonus_acts_on_it(tmp_path):
    _, n, _ = _step_with_zeroed_groups(tmp_path, True, [0, 1, 2], 1, "algorithm.entropy_coef=0.01")
    assert n == 3 * 4


def test_experience_info_carries_per_reward_scores(tmp_path):
    trainer = make_trainer(tmp_path, "algorithm=dapo")  # dynamic sampling filters rows: scores stay aligned
    c = trainer.collect(1)
    per = c.per_function["reward/digit_share"]
    assert per.shape == c.scores.shape
    torch.testing.assert_close(per.cpu(), torch.tensor(digit_share(None, c.rollout.texts, ["digits"] * len(c.rollout.texts)), dtype=torch.float64))


def test_same_seed_same_run(tmp_path):
    a = make_trainer(tmp_path / "a").train().history
    b = make_trainer(tmp_path / "b").train().history
    assert [h["objective/scores"] for h in a] == [h["objective/scores"] for h in b]
    assert [h["loss/policy_avg"] for h in a] == [h["loss/policy_avg"] for h in b]


def test_lora_run_trains_adapters_and_saves_a_merged_model(tmp_path, device):
    lora = '{r: 4, alpha: 8, target_modules: [q_proj, v_proj]}'
    trainer = make_trainer(tmp_path, f"model.lora={lora}", device=device)
    trainable = [n for n, p in trainer.policy.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    trainer.train()
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "final")  # plain transformers, adapters merged
    assert not any("lora" in k for k in reloaded.state_dict())


def test_gradient_checkpointing_and_tis_weights(tmp_path):
    trainer = make_trainer(tmp_path, "model.gradient_checkpointing=true", "algorithm.tis_cap=2.0")
    last = trainer.train().history[-1]
    assert last["val/tis_weight_mean"] == pytest.approx(1.0, abs=1e-3)  # same engine and dtype: weights ~1


def test_bf16_sampler_copy_is_corrected_by_tis_without_an_extra_forward(tmp_path, device):
    trainer = make_trainer(tmp_path, "rollout.dtype=bfloat16", "model.attn_implementation=eager",
                           "optim.micro_batch_size=16", "train.steps=1", device=device)
    sampler = trainer.models.sampler
    assert trainer.cfg.algorithm.tis_cap == 2.0  # set because the sampler differs from the trainer
    assert trainer.generator.model is sampler and sampler is not trainer.policy
    assert {p.dtype for p in sampler.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in trainer.policy.parameters()} == {torch.float32}
    assert trainer.policy.config._attn_implementation == "eager"
    m = trainer.train().history[0]
    assert trainer.forward_counts["policy"] == 1  # the update's forward gives old log-probs and TIS weights
    assert m["val/ratio"] == 1.0 and m["policy/clipfrac_avg"] == 0.0  # old = the update's own, detached
    assert 0.9 < m["val/tis_weight_mean"] < 1.1 and m["val/tis_weight_mean"] != 1.0  # bf16 differs, a little
    # the sampler takes the policy's weights (rounded to bf16) before every generation
    with torch.no_grad():
        for p in trainer.policy.parameters():
            p.add_(0.01)
    assert any(not torch.equal(a, b.detach().to(torch.bfloat16)) for a, b in zip(sampler.parameters(), trainer.policy.parameters()))
    trainer.generate_and_score(ROWS[:2], 2, seed=0)
    for a, b in zip(sampler.parameters(), trainer.policy.parameters()):
        assert torch.equal(a, b.detach().to(torch.bfloat16))


def test_sampler_in_the_policy_dtype_is_the_policy(tmp_path):
    trainer = make_trainer(tmp_path, "rollout.dtype=float32")
    assert trainer.models.sampler is None and trainer.generator.model is trainer.policy
    assert trainer.cfg.algorithm.tis_cap is None


@pytest.mark.parametrize("fast", [True, False])
def test_bf16_on_a_cpu_without_native_bf16_warns_once_naming_the_fields(tmp_path, monkeypatch, fast):
    import warnings

    import lmrl.build

    monkeypatch.setattr(lmrl.build, "cpu_has_fast_bf16", lambda: fast)
    cfg = load_config(None, ["train.autocast_bf16=true", "rollout.dtype=bfloat16", "model.device=cpu"])
    note = lmrl.build.slow_bf16_warning(cfg)
    assert (note is None) == fast
    if not fast:
        assert note.startswith("train.autocast_bf16=true, rollout.dtype=bfloat16: this CPU has no native bfloat16")
    assert lmrl.build.slow_bf16_warning(load_config(None, [])) is None  # float32 asks nothing
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_trainer(tmp_path, "train.autocast_bf16=true", "train.steps=1", device="cpu")  # a CPU warning: on a GPU machine too
    assert sum("no native bfloat16" in str(w.message) for w in caught) == (0 if fast else 1)


def test_optimizer_is_fused_adamw_and_steps_like_the_per_parameter_loop():
    from lmrl.build import make_optimizer

    tok = char_tokenizer()
    fused_model, loop_model = (tiny_causal_lm(tok, hidden_size=32, num_layers=1, seed=0) for _ in range(2))
    cfg = load_config(None, ["optim.lr=1e-2", "optim.weight_decay=0.1", "optim.betas=[0.8,0.95]"])
    fused, _ = make_optimizer(cfg, fused_model, None)
    assert fused.defaults["fused"] is True
    loop = torch.optim.AdamW(loop_model.parameters(), lr=1e-2, betas=(0.8, 0.95), weight_decay=0.1, foreach=False)
    torch.manual_seed(0)
    for _ in range(3):
        for a, b in zip(fused_model.parameters(), loop_model.parameters()):
            a.grad = torch.randn_like(a)
            b.grad = a.grad.clone()
        fused.step()
        loop.step()
    for a, b in zip(fused_model.parameters(), loop_model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    start = tiny_causal_lm(tok, hidden_size=32, num_layers=1, seed=0)
    assert all(not torch.equal(a, b) for a, b in zip(fused_model.parameters(), start.parameters()))  # the steps moved every weight


def test_packed_and_shared_prompt_forwards_make_the_same_update(tmp_path, monkeypatch):
    """train.packing (the default), the padded shared-prompt forward (packing=false) and transformers' own
    (share_prompt=false) make one update."""
    import lmrl.models.forward as forward

    calls = []
    real = forward.packed_states
    monkeypatch.setattr(forward, "packed_states", lambda *a, **k: calls.append((k["pack"], real(*a, **k))) or calls[-1][1])
    params = {}
    for share, pack in ((True, True), (True, False), (False, False)):
        trainer = make_trainer(tmp_path / f"{share}{pack}", "train.steps=1", f"train.share_prompt={str(share).lower()}",
                               f"train.packing={str(pack).lower()}", "algorithm.kl_coef=0.05")  # a reference forward too
        trainer.train_step(1)
        params[share, pack] = [p.detach().cpu() for p in trainer.policy.parameters()]
    # the update's forward and the reference forward took the shared path, packed or not, and only when asked to
    assert [pack for pack, _ in calls] == [True, True, False, False] and all(s is not None for _, s in calls)
    start = tiny_causal_lm(char_tokenizer(), hidden_size=32, num_layers=1, seed=0)
    assert any(not torch.equal(a, b) for a, b in zip(params[True, True], start.parameters()))
    # Adam's first step moves each weight by about lr = 1e-2; float rounding in tiny gradients may move a few
    # by a little more or less, a different update would move many by ~1e-2
    for other in ((True, False), (False, False)):
        for a, b in zip(params[True, True], params[other]):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=0)


SAME_UPDATE = [[f"algorithm={name}"] for name in ALGORITHM_PRESETS] + [
    ["algorithm=ppo", "model.shared_critic=true"], ["algorithm=grpo", "algorithm.kl_coef=0.05", "algorithm.kl_in=reward"]]


@pytest.mark.parametrize("overrides", SAME_UPDATE, ids=" ".join)
def test_packed_and_padded_make_the_same_update_for_every_algorithm(tmp_path, overrides):
    """Packed forwards with micro-batches cut by tokens against padded ones of whole minibatches: one step of every
    algorithm (a critic of its own or on the policy, the KL in the loss or in the reward, several minibatches and
    iterations) gives the same metrics and weights to float rounding."""
    runs = {}
    for pack in (True, False):
        split = ["optim.micro_batch_tokens=50"] if pack else []
        trainer = make_trainer(tmp_path / str(pack), "train.steps=1", f"train.packing={str(pack).lower()}", *split, *overrides)
        metrics = trainer.train_step(1)
        runs[pack] = metrics, [p.detach().clone() for p in trainer.policy.parameters()]
    (packed, packed_weights), (padded, padded_weights) = runs[True], runs[False]
    for key in ("loss/policy_avg", "policy/grad_norm", "objective/scores"):
        assert packed[key] == pytest.approx(padded[key], rel=1e-4, abs=1e-6), key
    for a, b in zip(packed_weights, padded_weights):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)


def test_minibatches_keep_a_prompts_rows_adjacent(tmp_path, monkeypatch):
    """Shuffled minibatches hold the same rows as before; inside one, a prompt's rows are adjacent, so that
    micro-batches can share prompts."""
    trainer = make_trainer(tmp_path, "algorithm.num_minibatches=2", "optim.micro_batch_size=2")
    seen = []
    real = trainer.updater.optimizer_step
    monkeypatch.setattr(trainer.updater, "optimizer_step", lambda mb: seen.append(mb.group_index.cpu()) or real(mb))
    trainer.train_step(1)
    order = torch.randperm(16, generator=torch.Generator().manual_seed(trainer.cfg.train.seed))
    groups = torch.arange(4).repeat_interleave(4)  # 4 prompts x 4 completions, in group order
    assert len(seen) == 2
    for m, got in enumerate(seen):
        assert torch.equal(got, got.sort().values)  # adjacent
        assert torch.equal(got.sort().values, groups[order[m * 8:(m + 1) * 8]].sort().values)  # same rows


GRPO_TRAINER_NAMES = ["reward", "reward_std", "rewards/digit_share/mean", "rewards/digit_share/std", "kl", "entropy",
                      "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "completions/mean_length",
                      "completions/min_length", "completions/max_length", "completions/clipped_ratio",
                      "completions/mean_terminated_length", "frac_reward_zero_std", "loss", "grad_norm", "learning_rate"]


def test_metrics_carry_the_names_trls_grpo_trainer_logs(tmp_path):
    last = make_trainer(tmp_path, "algorithm=rloo").train().history[-1]  # rloo: a reference model, so a kl
    assert [k for k in GRPO_TRAINER_NAMES if k not in last] == []
    assert last["reward"] == last["reward/mean"] and last["learning_rate"] == last["lr"]
    assert last["kl"] >= 0  # k3, never negative (objective/kl is the k1 sum the reward used, and can be)
    assert last["completions/min_length"] <= last["completions/mean_length"] <= last["completions/max_length"]


def test_ranks_reduce_minima_and_maxima_as_such(monkeypatch):
    import torch.distributed as dist

    from lmrl.distributed import World

    every = [{"val/ratio_max": 1.5, "completions/min_length": 3.0, "loss/policy_avg": 0.25, "reward": 1.0},
             {"val/ratio_max": 2.5, "completions/min_length": 1.0, "loss/policy_avg": 0.5, "reward": 0.0}]
    monkeypatch.setattr(dist, "all_gather_object", lambda out, metrics: out.__setitem__(slice(None), every))
    reduced = World(rank=0, size=2).reduce_metrics(every[0])  # two ranks' metrics, without processes
    assert reduced == {"val/ratio_max": 2.5, "completions/min_length": 1.0, "loss/policy_avg": 0.75, "reward": 0.5}


# --- dropout: the trained forward computes the sampler's distribution ---------------------------------------------


@pytest.mark.parametrize("arch", ["gpt2", "opt"])
def test_with_the_models_dropout_off_the_first_step_is_on_policy(tmp_path, arch):
    """GPT-2 and OPT ship dropout 0.1. With it on in the trained forward (the sampler and the reference run in eval
    mode) the first step's importance weight was 1.0018 (GPT-2) / 1.0011 (OPT), the KL to an identical reference
    9.4e-4 / 3.1e-4."""
    tok = char_tokenizer()
    for name, override, metric, expected, tol in (("tis", "algorithm.tis_cap=2.0", "val/tis_weight_mean", 1.0, 1e-5),
                                                  ("kl", "algorithm.kl_coef=0.05", "objective/kl_loss", 0.0, 1e-6)):
        make_trainer(tmp_path / name, "train.steps=1", override, model=tiny_dropout_lm(tok, arch)).train()
        row = json.loads((tmp_path / name / "metrics.jsonl").read_text().splitlines()[-1])
        assert row["step"] == 1 and abs(row[metric] - expected) <= tol, (name, row[metric])
    saved = json.loads((tmp_path / "kl" / "final" / "config.json").read_text())
    assert saved["attn_pdrop" if arch == "gpt2" else "attention_dropout"] == 0.1  # the saved model keeps its config's


@pytest.mark.parametrize(("arch", "keep"), [("gpt2", False), ("opt", False), ("opt", True)])
def test_the_trained_forwards_are_the_eval_forwards_unless_model_dropout(tmp_path, arch, keep):
    tok = char_tokenizer()
    trainer = make_trainer(tmp_path, "algorithm=ppo", "algorithm.kl_coef=0.05", f"model.dropout={keep}",
                           model=tiny_dropout_lm(tok, arch))
    models = trainer.models
    rows = tok(["12+34=46", "7+8=15  "], return_tensors="pt").to(trainer.device)  # model.device=auto: cuda on a GPU
    ids, mask = rows["input_ids"], rows["attention_mask"]

    def forwards(train: bool) -> list[torch.Tensor]:
        for m in (trainer.policy, models.reference, models.critic):
            m.train(train)
        torch.manual_seed(1)
        with torch.no_grad():
            return [model_forward_logprobs(trainer.policy, ids, mask, 4), model_forward_logprobs(models.reference, ids, mask, 4),
                    models.critic(ids, mask)]

    same = [torch.equal(a, b) for a, b in zip(forwards(True), forwards(False))]
    assert same == [not keep] * 3  # policy, reference, critic


def test_each_phase_reports_its_own_memory_peak(tmp_path):
    from lmrl.logging.metrics import Phases

    metrics = make_trainer(tmp_path, "train.steps=1").train_step(1)
    assert all(metrics[f"memory/peak_{phase}_mb"] > 0 for phase in ("generate", "experience", "update"))
    phases = Phases("cpu")
    big = torch.ones(32 * 2**20)  # 128 MiB, touched
    del big
    phases.end("big")
    phases.end("small")
    if os.path.exists("/proc/self/clear_refs"):  # Linux resets the process's peak at each phase
        assert phases.peaks["memory/peak_big_mb"] - phases.peaks["memory/peak_small_mb"] > 100


def test_the_memory_check_counts_a_packed_micro_batch_by_its_tokens():
    """`update_bytes` (checked before step 1): a micro-batch's padded width without a token budget; with packing
    and optim.micro_batch_tokens, that budget (or one whole row, where it is larger)."""
    from lmrl.memory_check import update_bytes

    config = tiny_causal_lm(char_tokenizer(), hidden_size=32, num_layers=2, seed=0).config
    padded = load_config(None, ["optim.micro_batch_size=64", "rollout.max_new_tokens=100"])
    budget = load_config(None, ["optim.micro_batch_size=64", "rollout.max_new_tokens=100", "optim.micro_batch_tokens=500"])
    unpacked = load_config(None, ["optim.micro_batch_size=64", "rollout.max_new_tokens=100",
                                  "optim.micro_batch_tokens=500", "train.packing=false"])
    layer, logits = 2 * 32 * 4, config.vocab_size * 4  # bytes a token keeps: each layer's input, a response's logits
    assert update_bytes(padded, config, 50) == 64 * 150 * layer + 64 * 100 * logits
    assert update_bytes(budget, config, 50) == 500 * layer + 500 * logits
    assert update_bytes(unpacked, config, 50) == update_bytes(padded, config, 50)
    assert update_bytes(budget, config, 1000) == 1100 * layer + 1100 * logits  # a row longer than the budget runs whole
