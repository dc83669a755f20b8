"""Vision-language policies: loading one, and turning a prompt and its images into token ids plus one opaque
bundle of processor outputs.

A bundle (`Media`) is what a processor returns for one prompt besides its per-token outputs (`input_ids`,
`attention_mask`, `mm_token_type_ids`): `pixel_values` for LLaVA, `pixel_values` and `image_grid_thw` for
Qwen2-VL, and so on (video and audio later, the same way). It is computed once per prompt, not once per
completion, and nothing between here and the model's forward looks inside it: `batch_media` concatenates
the bundles of several prompts along their first dimension, as processors batch them, and the forward
takes them as keyword arguments.

Positions. LLaVA-style models take the 1-D positions of text. Qwen2-VL-style models rotate with 3-D
(M-RoPE) positions: temporal, height and width for image tokens, and text after an image continues from
the image's largest position. Given 2-D `position_ids` such a model silently copies them to all three
axes (wrong for image tokens), so `mrope_positions` computes the 3-D ones with the model's own
`get_rope_index`, for left-padded batches, in the prefill and the training forward alike; decode steps
then pass each row's next text position, the same on every axis.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from lmrl.models.image_files import image_to_text, open_image  # noqa: F401  (lmrl.models.vision names them too)

Media = dict[str, torch.Tensor]
"""One prompt's processor outputs besides its token ids, e.g. {"pixel_values": [images, 3, H, W]}."""

# per-token outputs: aligned with the token ids, padded with them, never concatenated as a bundle
_TOWERS = ("vision_tower", "visual", "vision_model")  # LLaVA, Gemma 3 / Qwen2-VL, 2.5-VL / Idefics3, SmolVLM
_TEXT_KEYS = ("input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids")


def image_from_text(text: Any, max_pixels: int, label: str = "image") -> Any:
    """The PIL image of `image_to_text`'s text, refused (ValueError, one line naming `label`) where it is not base64
    of an image or has more than `max_pixels` pixels (checked from its header, before it is decoded)."""
    import base64
    import binascii

    from PIL import Image, UnidentifiedImageError

    if not isinstance(text, str):
        raise ValueError(f"{label}: expected base64 text of an image file (PNG), got {type(text).__name__}")
    try:
        image = Image.open(io.BytesIO(base64.b64decode(text, validate=True)))
    except (binascii.Error, UnidentifiedImageError, ValueError) as e:
        raise ValueError(f"{label}: not base64 of an image file ({type(e).__name__})") from e
    width, height = image.size
    if width * height > max_pixels:
        raise ValueError(f"{label}: {width}x{height} pixels, more than this server allows ({max_pixels})")
    image.load()
    return image.convert("RGB")


def takes_images(model: nn.Module) -> bool:
    """A model with a vision tower (its config has a `vision_config`)."""
    return getattr(model.config, "vision_config", None) is not None


def media_token_ids(model: nn.Module) -> list[int]:
    """The placeholder tokens a vision-language model replaces with image (or video) features: a completion must
    never hold one, or scoring it would find more placeholders than images. [] for a text model."""
    config = getattr(model, "config", None)
    names = ("image_token_index", "image_token_id", "video_token_index", "video_token_id")
    ids = [getattr(config, name, None) for name in names]
    return sorted({i for i in ids if isinstance(i, int)}) if takes_images(model) else []


def load_vision_model(name_or_path: str, dtype: torch.dtype | None = None, processor: Any = None) -> tuple[nn.Module, Any]:
    """`AutoModelForImageTextToText` and `AutoProcessor` (unless given) from a directory or hub id; the model in
    eval mode."""
    from transformers import AutoModelForImageTextToText

    processor = processor or load_vision_processor(name_or_path)
    model = AutoModelForImageTextToText.from_pretrained(name_or_path, dtype=dtype)
    return model.eval(), processor


def load_vision_processor(name_or_path: str) -> Any:
    """The model's `AutoProcessor`; for Qwen2-VL / Qwen2.5-VL where transformers' own cannot be built (it needs
    torchvision), lmrl's stand-in for images (`lmrl.models.qwen_vl`)."""
    from transformers import AutoConfig

    from lmrl.models.qwen_vl import load_processor

    return load_processor(name_or_path, getattr(AutoConfig.from_pretrained(name_or_path), "model_type", None))


def prompt_text(processor: Any, prompt: str | list[dict[str, Any]]) -> str:
    """A row's prompt as the text its processor takes: a string as it is; chat messages (content a string or
    text and image parts) through the processor's chat template, which writes each image part as its token."""
    if isinstance(prompt, str):
        return prompt
    if not getattr(processor, "chat_template", None):
        raise ValueError("prompt is a list of messages but the processor has no chat template; give the model's "
                         "processor one, or write the prompt as a string with its image token")
    return processor.apply_chat_template(list(prompt), add_generation_prompt=True, tokenize=False)


def encode_with_media(processor: Any, prompts: Sequence[str], images: Sequence[Sequence[Any]],
                      add_special_tokens: bool = True) -> tuple[list[list[int]], list[Media | None]]:
    """Token ids and the bundle of each prompt, each prompt processed once on its own (no padding).

    Args:
        processor: the model's processor (its tokenizer expands each image token to the image's tokens).
        prompts: prompt texts holding the processor's image token once per image.
        images: the PIL images of each prompt, in order ([] for a text prompt).
        add_special_tokens: False for text that continues a sequence (an environment's observation): no BOS.

    Returns:
        `[len(prompt) tokens]` per prompt, and its `Media` (None for a prompt without images).
    """
    if len(prompts) != len(images):
        raise ValueError(f"images: {len(images)} image lists for {len(prompts)} prompts")
    ids, bundles = [], []
    for text, imgs in zip(prompts, images):
        extra = {} if add_special_tokens else {"add_special_tokens": False}
        out = processor(text=[text], images=list(imgs) or None, return_tensors="pt", **extra)
        ids.append(out["input_ids"][0].tolist())
        media = {k: v for k, v in out.items() if k not in _TEXT_KEYS and isinstance(v, torch.Tensor)}
        bundles.append(media or None)
    return ids, bundles


def image_media(processor: Any, images: Sequence[Any]) -> Media | None:
    """The bundle of a prompt's images alone, from the processor's image processor: what `encode_with_media` gives
    with the prompt's text, for a generator handed ids its client's processor already expanded (`lmrl serve`)."""
    if not images:
        return None
    out = processor.image_processor(images=[open_image(v).convert("RGB") for v in images], return_tensors="pt")
    return {k: v for k, v in out.items() if k not in _TEXT_KEYS and isinstance(v, torch.Tensor)} or None


@dataclass(frozen=True)
class ImagePrompt:
    """A prompt as an engine that processes images itself takes it (vLLM's `multi_modal_data`): it expands each
    image token with its own processor, which must give the ids `encode_with_media` gave (the engine checks)."""

    ids: list[int]  # the prompt's token ids with each image token once, before a processor expands it
    images: list[Any]  # its PIL images, in order


def image_prompts(processor: Any, prompts: Sequence[str], images: Sequence[Sequence[Any]]) -> list[ImagePrompt]:
    """Each prompt text tokenized as the processor's tokenizer writes it before expanding the images, with them."""
    return [ImagePrompt(processor.tokenizer(text)["input_ids"], list(imgs)) for text, imgs in zip(prompts, images)]


def image_prompts_of(given: Any, count: int, max_images: int, max_pixels: int) -> list[ImagePrompt]:
    """The `images` of a JSON request (`lmrl serve`'s /lmrl/generate): per prompt an object with its ids before the
    images are expanded and its images as base64 PNG (`image_to_text`); ValueError, one line, where it is not that
    or holds more than `max_images` images of a prompt or `max_pixels` pixels of an image."""
    if not isinstance(given, list) or len(given) != count:
        raise ValueError(f"images: expected a list of {count} objects {{ids, images}}, one per prompt")
    out = []
    for i, entry in enumerate(given):
        if not isinstance(entry, dict) or not isinstance(entry.get("images"), list) or not isinstance(entry.get("ids"), list):
            raise ValueError(f"images[{i}]: expected an object with ids (token ids) and images (base64 PNG)")
        if len(entry["images"]) > max_images:
            raise ValueError(f"images[{i}]: {len(entry['images'])} images, more than this server allows ({max_images})")
        out.append(ImagePrompt(entry["ids"], [image_from_text(v, max_pixels, f"images[{i}][{j}]")
                                              for j, v in enumerate(entry["images"])]))
    return out


def batch_media(bundles: Sequence[Media | None], device: torch.device | str | None = None) -> Media:
    """The bundles of several prompts as one forward's keyword arguments: each key concatenated along its
    first dimension, in prompt order; prompts without images add nothing. {} when none has images.

    Where prompts differ in a later dimension (Idefics3 / SmolVLM: `[1, images, 3, H, W]` pixel values and
    their pixel masks), the smaller ones are padded with zeros, as the processor pads a batch: an all-zero
    image is padding to those models."""
    present = [b for b in bundles if b]
    if not present:
        return {}
    keys = set(present[0])
    if any(set(b) != keys for b in present):
        raise ValueError(f"media: the prompts' bundles hold different keys: {sorted({k for b in present for k in b})}")
    out = {}
    for key in present[0]:
        parts = [b[key] for b in present]
        shape = [max(sizes) for sizes in zip(*(p.shape[1:] for p in parts))]
        parts = [_zero_padded_to(p, [p.shape[0], *shape]) for p in parts]
        out[key] = torch.cat(parts) if device is None else torch.cat(parts).to(device)
    return out


def join_media(parts: Sequence[Media | None]) -> Media | None:
    """One sequence's bundles as one, in order: its prompt's, then each observation's (a multi-turn episode whose
    environment showed images). Each key is joined along the images' dimension: the first, or the second where the
    processor writes a prompt dimension first (Idefics3 / SmolVLM: `[1, images, 3, H, W]` pixel values, `[1, images,
    H, W]` pixel masks), images of different sizes zero-padded as `batch_media` pads them. None when none has images."""
    present = [p for p in parts if p]
    if len(present) < 2:
        return present[0] if present else None
    if any(set(p) != set(present[0]) for p in present):
        raise ValueError(f"media: an episode's bundles hold different keys: {sorted({k for p in present for k in p})}")
    out = {}
    for key, first in present[0].items():
        dim = 1 if first.dim() == _PER_PROMPT_RANK.get(key) else 0
        pieces = [p[key] for p in present]
        shape = [max(sizes) for sizes in zip(*(x.shape for x in pieces))]
        pieces = [_zero_padded_to(x, [n if d != dim else x.shape[d] for d, n in enumerate(shape)]) for x in pieces]
        out[key] = torch.cat(pieces, dim)
    return out


# the rank of a key whose processor writes a prompt dimension before the images' (Idefics3 / SmolVLM)
_PER_PROMPT_RANK = {"pixel_values": 5, "pixel_attention_mask": 4}


def _zero_padded_to(x: torch.Tensor, shape: list[int]) -> torch.Tensor:
    """`x` in a zero tensor of `shape`, at the start of every dimension (`x` itself where it has that shape)."""
    if list(x.shape) == shape:
        return x
    out = x.new_zeros(shape)
    out[tuple(slice(0, n) for n in x.shape)] = x
    return out


def row_media(bundles: Sequence[Media | None], prompt_index: Sequence[int] | torch.Tensor,
              device: torch.device | str | None = None) -> Media:
    """The forward arguments of a batch of rows (prompt + completion each) whose prompts are
    `bundles[prompt_index[row]]`: each row brings its prompt's bundle, in row order, so that any selection of
    rows (a micro-batch) is scored with exactly its own images."""
    index = prompt_index.tolist() if isinstance(prompt_index, torch.Tensor) else list(prompt_index)
    return batch_media([bundles[i] for i in index], device)


def freeze_vision(model: nn.Module) -> list[str]:
    """Turn off gradients of the vision tower (what `model.freeze_vision` asks for: the projector and the
    language model train); returns the frozen parameters' names. A model without a vision tower is unchanged."""
    inner = getattr(model, "model", model)
    tower = next((getattr(inner, name) for name in _TOWERS if getattr(inner, name, None) is not None), None)
    if tower is None:
        return []
    for p in tower.parameters():
        p.requires_grad_(False)
    prefix = next(n for n, m in model.named_modules() if m is tower)
    return [f"{prefix}.{n}" for n, _ in tower.named_parameters()]


def uses_mrope(model: nn.Module) -> bool:
    """A Qwen2-VL-style model: 3-D rotary positions from its `get_rope_index` (`mrope_positions`)."""
    return callable(getattr(getattr(model, "model", None), "get_rope_index", None))


def mrope_positions(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    media: Media) -> torch.Tensor | None:
    """`[3, B, S]` M-RoPE position ids of a left-padded batch whose images are `media` (batched in row order),
    as the model computes them for one unpadded row (padding gets 0); None for a model with 1-D positions.

    Args:
        model: the vision-language model.
        input_ids: `[B, S]` left-padded ids, each image's tokens in place.
        attention_mask: `[B, S]`, 1 on real tokens.
        media: the batch's bundles (`image_grid_thw` / `video_grid_thw` say each image's patch grid).
    """
    if not uses_mrope(model):
        return None
    config = model.config
    kinds = torch.zeros_like(input_ids, dtype=torch.int)  # 0 text, 1 image, 2 video: what processors return
    kinds[input_ids == config.image_token_id] = 1
    if getattr(config, "video_token_id", None) is not None:
        kinds[input_ids == config.video_token_id] = 2
    positions, _ = model.model.get_rope_index(input_ids, kinds, media.get("image_grid_thw"),
                                              media.get("video_grid_thw"), attention_mask=attention_mask)
    return positions


def is_vision_model(name_or_path: str) -> bool:
    """A model directory (or cached hub id) whose config has a `vision_config`: a vision-language model, loaded with
    `load_vision_model`. False where the config cannot be read here (a text model's loading then says why)."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(name_or_path)
    except (OSError, ValueError):
        return False
    return getattr(config, "vision_config", None) is not None


def image_token(processor: Any) -> str | None:
    """The placeholder a string prompt writes once per image (`<image>` for LLaVA), as the processor names it."""
    token = getattr(processor, "image_token", None)
    return token if isinstance(token, str) else None


# what a run with a vision-language policy cannot do yet: (is it asked for by the run's config, the line that
# refuses it)
_NOT_WITH_IMAGES = (
    (lambda c: c.algorithm.needs_critic, "a critic (algorithm.advantage=gae, PPO) is not supported with a vision-language policy"),
    (lambda c: c.samples_with_copy, "rollout.dtype: a sampler copy in another dtype is not supported with a vision-language policy"),
    (lambda c: c.algorithm.teacher is not None, "algorithm.teacher is not supported with a vision-language policy"),
    (lambda c: c.env.name == "agent" or (c.env.name or "").startswith("verifiers:"),
     "env.name: an agent program or a verifiers environment is not supported with a vision-language policy yet "
     "(their episodes are text; an environment of lmrl's protocol may show images)"),
    (lambda c: _adapter_dir(c.model.name_or_path),
     "a LoRA adapter directory as model.name_or_path is not supported with a vision-language policy yet"),
)


def _adapter_dir(name_or_path: str) -> bool:
    from lmrl.models.lora import adapter_base

    return adapter_base(name_or_path) is not None


def refuse_unsupported(cfg: Any) -> None:
    """Refuse, in one line and before a model loads, what a vision-language policy cannot do yet."""
    from lmrl.errors import ConfigError

    for asked, line in _NOT_WITH_IMAGES:
        if asked(cfg):
            raise ConfigError(f"model.name_or_path={cfg.model.name_or_path}: " + line.format(cfg.rollout.backend))
