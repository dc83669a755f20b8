"""A Qwen2.5-VL policy at real size through lmrl's Trainer on a GPU: M-RoPE positions, images of two sizes, the
vision tower frozen; the sampler-vs-trainer KL, seconds per step and peak memory.

    python benchmarks/gpu_vision.py                 # on a GPU: Qwen2.5-VL-3B's shape (random weights), bfloat16
    python benchmarks/gpu_vision.py --tiny          # the same path on a CPU with a tiny one: seconds

Nothing is downloaded: the model is built from a config (Qwen2.5-VL-3B's widths and depths: a 36-layer decoder of
width 2048, a 32-block vision tower of width 1280 with window attention) with random weights, a character-level
tokenizer made here and `lmrl.models.qwen_vl.QwenVLImageProcessor` over Pillow's Qwen2-VL image processor (no
torchvision). Random weights say nothing about learning; what this checks at real size is that lmrl's decode and
training forward agree with images (`val/sampler_kl` near 0) and what a step costs. scripts/gpu_run.sh runs it.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # run from a checkout

SHAPES = {  # text: hidden, intermediate, layers, heads, kv heads; vision: hidden, intermediate, depth, heads
    "3b": dict(text=(2048, 11008, 36, 16, 2), vision=(1280, 3420, 32, 16), full=[7, 15, 23, 31]),
    "tiny": dict(text=(64, 128, 2, 4, 2), vision=(32, 64, 2, 2), full=[1]),
}
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"  # an image as Qwen2.5-VL's chat template writes it


def build(shape: str):
    """A randomly initialised Qwen2.5-VL of `shape` and its processor (56x56 to 112x112 images)."""
    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from lmrl.models.qwen_vl import QwenVLImageProcessor
    from lmrl.models.tiny import char_tokenizer

    s = SHAPES[shape]
    (hidden, inter, layers, heads, kv), (v_hidden, v_inter, depth, v_heads) = s["text"], s["vision"]
    tok = char_tokenizer()
    specials = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
    tok.add_special_tokens({"additional_special_tokens": specials})
    ids = dict(zip(specials, tok.convert_tokens_to_ids(specials)))
    section = [hidden // heads // 8, hidden // heads * 3 // 16, hidden // heads * 3 // 16]  # 16, 24, 24 at 3B
    text = dict(vocab_size=len(tok), hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=4096,
                rope_parameters={"rope_type": "default", "mrope_section": section, "rope_theta": 1e6},
                pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    vision = dict(depth=depth, hidden_size=v_hidden, out_hidden_size=hidden, intermediate_size=v_inter, num_heads=v_heads,
                  patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
                  fullatt_block_indexes=s["full"])
    config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
                              video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"])
    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration(config).eval()
    images = Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=112 * 112, patch_size=14, merge_size=2,
                                      temporal_patch_size=2)
    return model, QwenVLImageProcessor(images, tok)


def rows(n: int) -> list[dict]:
    """Prompts with one image, or two of different sizes (a 112x56 one is twice a 56x56 one's tokens)."""
    from PIL import Image

    out = []
    for i in range(n):
        if i % 2:
            out.append({"prompt": f"{IMAGE}{IMAGE} {i}?", "images": [
                Image.new("RGB", (112, 56), (9 * i % 255, 90, 9)), Image.new("RGB", (56, 56), (99, 9 * i % 255, 9))]})
        else:
            out.append({"prompt": f"{IMAGE} {i}?", "image": Image.new("RGB", (56, 56), (30, 9 * i % 255, 90))})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="a tiny Qwen2.5-VL on the CPU")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    import torch

    from lmrl import Trainer
    from lmrl.config import load_config

    shape = "tiny" if args.tiny else "3b"
    cuda = torch.cuda.is_available() and not args.tiny
    model, processor = build(shape)
    print(f"Qwen2.5-VL ({shape}): {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters", flush=True)
    with tempfile.TemporaryDirectory() as out:
        cfg = load_config(None, [
            f"train.steps={args.steps}", "rollout.prompts_per_step=4", "rollout.group_size=4",
            "rollout.max_new_tokens=16", "data.num_eval_prompts=0", "optim.lr=1e-5", "algorithm.tis_cap=2.0",
            f"model.device={'cuda' if cuda else 'cpu'}", *(["model.dtype=bfloat16"] if cuda else []),
            f"train.output_dir={out}", "log.console=false", "train.save_every=0"])
        reward = lambda completions, **kw: [sum(map(ord, c)) % 7 / 7 for c in completions]  # noqa: E731
        trainer = Trainer(cfg, model=model, tokenizer=processor, reward_funcs=[reward], train_dataset=rows(16))
        start = time.perf_counter()
        history = trainer.train().history
        seconds = time.perf_counter() - start
    for step, h in enumerate(history, start=1):
        print(f"step {step}: loss {h['loss']:.4g}, val/sampler_kl {h.get('val/sampler_kl', float('nan')):.3g}, "
              f"time/step {h['time/step']:.2f} s")
    # the trainer resets torch's peak at each phase (memory/peak_*_mb): the run's peak is the largest of those and now's
    phases = [v for h in history for k, v in h.items() if k.startswith("memory/peak_")]
    most = max([torch.cuda.max_memory_allocated() / 2**20, *phases]) if cuda else 0.0
    peak = f", peak GPU memory {most / 2**10:.1f} GiB" if cuda else ""
    print(f"{len(history)} steps in {seconds:.1f} s{peak}")
    kl = [h["val/sampler_kl"] for h in history if "val/sampler_kl" in h]  # (a step whose groups all tied has none)
    if not kl or max(map(abs, kl)) >= 1e-2:
        sys.exit(f"the sampler and the trainer disagree with images (val/sampler_kl {kl}, expected within 1e-2)")


if __name__ == "__main__":
    main()
