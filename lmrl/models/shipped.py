"""The tiny model that ships with lmrl: what `lmrl train` with no arguments starts from.

A character-level Llama (about 0.5M parameters) fine-tuned briefly on the built-in addition task
(`lmrl.data.tasks.AdditionTask`) by `scripts/make_tiny_model.py`. It is stopped early on purpose: it
answers a minority of held-out sums greedily but samples the right answer for most of them within a
few tries, which is the starting point where RL visibly helps within minutes on a CPU.
"""

from __future__ import annotations

from pathlib import Path

SHIPPED_MODEL: Path = Path(__file__).resolve().parent.parent / "assets" / "tiny-addition"
"""Directory of the shipped model: config, weights (safetensors), generation config, tokenizer."""

SHIPPED_MODELS: dict[str, Path] = {
    "tiny-addition": SHIPPED_MODEL,
    # the calculator task's model (`data.task=calculator`): fine-tuned on traces that call the tool half the time
    "tiny-calculator": SHIPPED_MODEL.parent / "tiny-calculator",
    # the calculator task as a reasoning chat model plays it through an agent program (examples/reasoning_agent.py):
    # its chat template opens <think> and writes earlier turns without their reasoning, as DeepSeek-R1's does
    "tiny-reasoner": SHIPPED_MODEL.parent / "tiny-reasoner",
    # a tiny LLaVA (`data.task=digits`: the digit drawn plus k), made by scripts/make_tiny_vision.py; a
    # vision-language model, loaded with `lmrl.models.vision.load_vision_model`, not `load_shipped`
    "tiny-vision": SHIPPED_MODEL.parent / "tiny-vision",
}
"""Every model shipped with lmrl, by the name `model.name_or_path` accepts."""


def load_shipped(path: str | Path = SHIPPED_MODEL):
    """Load the shipped model and its character-level tokenizer, in eval mode, on CPU.

    Returns:
        (model, tokenizer): a `LlamaForCausalLM` and a `PreTrainedTokenizerFast` (left padding,
        ids <pad>=0 <s>=1 </s>=2). Prompts are tokenized as is: no BOS, no chat template.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path)
    if not (path / "config.json").is_file():
        raise ValueError(f"path: no model at {path}; rebuild it with scripts/make_tiny_model.py")
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    return model.eval(), tokenizer
