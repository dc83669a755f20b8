"""What a step's metrics are called: lmrl's names for the experience's statistics, and the names TRL's
GRPOTrainer logs, beside them (docs/metrics.md lists every name)."""

from __future__ import annotations

import re
import resource
import time
from typing import Any

import torch

from lmrl import algorithms as A


class Phases:
    """A step's phases, one after the other: `end(name)` closes the phase running since the last call (or since
    this object was made), returns the time it ended, and keeps the memory peak within it as
    `peaks["memory/peak_<name>_mb"]`: on a GPU torch's peak of allocated memory on `device`, on a CPU the process's
    peak resident memory (on Linux reset at each phase through /proc/self/clear_refs, elsewhere the peak so far)."""

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.peaks: dict[str, float] = {}
        self.start = self._reset()

    def end(self, name: str) -> float:
        self.peaks[f"memory/peak_{name}_mb"] = self._peak_mb()
        return self._reset()

    def _reset(self) -> float:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            try:  # "5" resets the peak resident set size (Linux >= 4.0)
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")
            except OSError:
                pass
        return time.time()

    def _peak_mb(self) -> float:
        if self.cuda:
            return torch.cuda.max_memory_allocated(self.device) / 2**20
        try:
            with open("/proc/self/status") as f:
                return int(re.search(r"VmHWM:\s+(\d+)", f.read()).group(1)) / 1024
        except (OSError, AttributeError):
            return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def experience_metrics(exp: Any, kl_coef: float) -> dict[str, float]:
    """The statistics of a batch of experience (`lmrl.experience.Experience`): scores, lengths, advantages, the KL
    to the reference and what the algorithm's options changed. `kl_coef`: the KL coefficient now."""
    out = {"objective/scores": exp.per_episode().scores.mean().item(),  # per episode (an agent's may be samples)
           "val/response_length": exp.info["length"].float().mean().item(),
           "val/num_eos_tokens": exp.info["finished"].float().sum().item(),
           "val/advantage_mean": A.masked_mean(exp.advantages, exp.response_mask).item()}
    if "kl_k3" in exp.info:  # k3 (>= 0), a mean over every response token (as TRL's GRPOTrainer reports `kl`)
        out["kl"] = exp.info["kl_k3"].sum().item() / max(int(exp.response_mask.sum()), 1)
    lengths, finished = exp.info["length"].float(), exp.info["finished"].bool()
    out |= {"completions/min_length": lengths.min().item(),
            "completions/max_length": lengths.max().item(), "completions/clipped_ratio": 1 - finished.float().mean().item(),
            "completions/mean_terminated_length": lengths[finished].mean().item() if finished.any() else 0.0}
    if "kl" in exp.info:  # summed per sequence, averaged over sequences (as TRL reports it)
        out["objective/kl"] = exp.info["kl"].mean().item()
        out["objective/non_score_reward"] = -kl_coef * out["objective/kl"]
        out["objective/rlhf_reward"] = out["objective/scores"] + out["objective/non_score_reward"]
    return out | _option_metrics(exp)


def _option_metrics(exp: Any) -> dict[str, float]:
    """What the algorithm's options did to the batch, for those that acted on it."""
    out, real = {}, max(int(exp.response_mask.sum()), 1)
    if "reward_minus_kl" in exp.info:  # algorithm.reward_minus_kl_coef: the reward the advantages saw
        out["objective/reward_minus_kl"] = exp.info["reward_minus_kl"].double().mean().item()
    if "relu_zeroed" in exp.info:  # algorithm.relu_log_p_weights: share of tokens whose weight became 0
        out["val/relu_zeroed_frac"] = exp.info["relu_zeroed"].sum().item() / real
    if "clip_filter_weight" in exp.info:
        out["val/clip_filter_weight_mean"] = exp.info["clip_filter_weight"].float().mean().item()
    if "tis_weight" in exp.info:  # how far the sampler's probabilities are from the trainer's
        out["val/tis_weight_mean"] = exp.info["tis_weight"].mean().item()
        out["val/tis_masked_frac"] = exp.info["tis_masked"].sum().item() / real
        out["val/sampler_kl"] = exp.info["sampler_kl"].mean().item()
        out["val/sampler_logprob_diff"] = exp.info["sampler_diff"].mean().item()
    if "distill_rkl" in exp.info:  # on-policy distillation: how far the student's samples are from the teacher's liking
        out["distill/reverse_kl"] = exp.info["distill_rkl"].sum().item() / real
        out["distill/reverse_kl_seq"] = exp.info["distill_rkl"].mean().item()
        out["distill/teacher_logprob"] = exp.info["distill_teacher_logp"].sum().item() / real
    if "entropy" in exp.info:
        out["objective/entropy"] = exp.info["entropy"].mean().item()
    return out


def grpo_trainer_names(m: dict[str, float]) -> dict[str, float]:
    """The names TRL's GRPOTrainer logs, beside lmrl's, so that its users' dashboards find them (docs/metrics.md)."""
    same = {"reward": "reward/mean", "reward_std": "reward/std", "entropy": "policy/entropy_avg",
            "completions/mean_length": "val/response_length",
            "clip_ratio/region_mean": "policy/clipfrac_avg", "loss": "loss/policy_avg", "grad_norm": "policy/grad_norm",
            "learning_rate": "lr"}
    out = {trl: m[ours] for trl, ours in same.items() if ours in m}
    for key, value in m.items():  # reward/<fn>/mean -> rewards/<fn>/mean
        parts = key.split("/")
        if len(parts) == 3 and parts[0] == "reward" and parts[2] in ("mean", "std"):
            out[f"rewards/{parts[1]}/{parts[2]}"] = value
    return out


def prompt_text(prompt: Any) -> str:
    """A prompt as one line of text for the sample table: a chat as `role: content | ...`."""
    return prompt if isinstance(prompt, str) else " | ".join(f"{m.get('role')}: {m.get('content')}" for m in prompt)
