"""The architecture matrix (benchmarks/architectures.py): every architecture trains through rollout.backend=lmrl and
LoRA with finite losses and a sampler that computes the trainer's distribution (dropout configs included), a few
representative ones through vLLM's CPU build, and each cell run here is what docs/supported-models.md's table says.
"""

from __future__ import annotations

import importlib.util
import json
import platform
import sys
from pathlib import Path

import pytest
import torch

from tests import forked

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import architectures  # noqa: E402

RECORDED = sorted((ROOT / "benchmarks" / "results").glob("supported-models.*.json"))
# vLLM cells in the suite (a cell is ~20 s, its engine's start half of it): sliding windows and soft-capping, and a
# mixture of experts, refused (test_vllm_engine.py runs GPT-NeoX through the Transformers backend and Qwen3-MoE);
# benchmarks/architectures.py --record runs the whole column
VLLM_CELLS = ["gemma2", "mixtral"]


def recorded_cell(arch: str, column: str) -> str:
    """The cell's status in the recorded table: trains, refused or fails."""
    assert len(RECORDED) == 1, RECORDED
    rows = {row["arch"]: row for row in json.loads(RECORDED[0].read_text())["rows"]}
    return rows[arch][column].split()[0]


@pytest.fixture
def one_thread():
    """One torch thread: on a shared CPU, two spin-waiting threads make a 0.3 s cell take 10 s."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_the_matrix_has_every_kind_of_model():
    names = set(architectures.ARCHITECTURES)
    assert len({model_type for model_type, *_ in architectures.ARCHITECTURES.values()}) >= 15
    shapes = " ".join(shape for *_, shape in architectures.ARCHITECTURES.values())
    for kind in ("sliding window", "mixture of experts", "tied", "untied", "no pad token", "chat template", "dropout"):
        assert kind in shapes, kind
    assert {"gpt2", "opt", "gpt_neox", "gpt_neox-nopad", "qwen3_moe", "mixtral"} <= names


vllm_cpu = (sys.platform == "linux" and platform.machine() == "x86_64" and importlib.util.find_spec("vllm") is not None
            and not torch.cuda.is_available())  # the table's column is vLLM's CPU build


@pytest.mark.skipif(not vllm_cpu, reason="vLLM's CPU build is made for x86-64 Linux machines without a GPU")
@pytest.mark.parametrize("arch", VLLM_CELLS)
def test_representative_architectures_through_vllm(tmp_path, arch):
    """Each in a process of its own (one engine per process), forked from a zygote that imported vLLM's engine. A
    mixture of experts is refused before training: vLLM's CPU build does not compute the experts it is given
    (tests/rollout/test_vllm_engine.py shows it)."""
    cell = architectures.run_cell_apart(arch, "vllm", tmp_path, run=lambda path, *args, timeout: forked.script(
        path, *args, cwd=tmp_path, timeout=timeout, imports=forked.VLLM))
    assert cell["status"] == recorded_cell(arch, "vllm"), cell
    if architectures.ARCHITECTURES[arch][3] == "mixture of experts":
        assert cell["status"] == "refused" and cell["diff"] is None, cell  # before its first step
        assert cell["reason"].startswith(f"rollout.backend=vllm: {arch} is a mixture-of-experts model"), cell
    else:
        assert cell["status"] == "trains", cell
        assert cell["diff"] < architectures.MAX_DIFF


@pytest.mark.parametrize("column", ["lmrl", "lora"])
@pytest.mark.parametrize("arch", list(architectures.ARCHITECTURES))
def test_every_architecture_trains(tmp_path, one_thread, arch, column):
    cell = architectures.run_cell(arch, column, tmp_path)
    assert cell["status"] == "trains", cell
    assert cell["diff"] < architectures.MAX_DIFF  # the sampler computes the trained forward, dropout configs too
    assert recorded_cell(arch, column) == "trains"


def test_a_cell_with_a_wrong_sampler_or_a_nan_fails():
    """The verdict can fail: a sampler 0.003 nats per token away, a NaN loss, a step missing."""
    good = [{"step": 0}, *({"step": s, "loss/policy_avg": 0.1, "val/sampler_logprob_diff": 1e-7} for s in (1, 2))]
    assert architectures.verdict(good, None)["status"] == "trains"
    assert architectures.verdict([*good[:2], {**good[2], "val/sampler_logprob_diff": 3e-3}], None)["status"] == "fails"
    assert architectures.verdict([*good[:2], {**good[2], "loss/policy_avg": float("nan")}], None)["status"] == "fails"
    assert architectures.verdict(good[:2], None)["status"] == "fails"
    refused = architectures.verdict(good[:2], "step 1: the sampler does not compute the policy")
    assert refused == {"status": "refused", "reason": "step 1: the sampler does not compute the policy", "diff": 1e-7}
