"""Qwen2-VL / Qwen2.5-VL's processor for images alone, where transformers' own cannot be built.

transformers' `Qwen2VLProcessor` insists on a video processor, and its video processors need torchvision, which
does not install beside every CPU build of torch (this machine's, for one): `AutoProcessor` then fails for a
Qwen-VL checkpoint although the model itself loads. `QwenVLImageProcessor` does what that processor does for
text and images, with Pillow's image processor (`Qwen2VLImageProcessorPil`): each `<|image_pad|>` of the text
becomes one `<|image_pad|>` per merged patch of its image (the chat template writes `<|vision_start|>` and
`<|vision_end|>` around it); videos are refused. `load_processor` uses it only where `AutoProcessor` fails.
"""

from __future__ import annotations

import os
from typing import Any

QWEN_VL_TYPES = ("qwen2_vl", "qwen2_5_vl")
"""Model types whose processor `QwenVLImageProcessor` stands in for."""


class QwenVLImageProcessor:
    """Text and images as `Qwen2VLProcessor` processes them (module docstring).

    Args:
        image_processor: Pillow's Qwen2-VL image processor (its `merge_size`: patches merged per image token side).
        tokenizer: the model's tokenizer.
        chat_template: the processor's chat template (the tokenizer's when None).
    """

    image_token = "<|image_pad|>"

    def __init__(self, image_processor: Any, tokenizer: Any, chat_template: str | None = None) -> None:
        self.image_processor, self.tokenizer = image_processor, tokenizer
        self.chat_template = chat_template or getattr(tokenizer, "chat_template", None)
        self.merge = image_processor.merge_size

    def __call__(self, text: list[str], images: list[Any] | None = None, videos: Any = None,
                 return_tensors: str = "pt", **kwargs: Any) -> Any:
        from transformers import BatchFeature

        if videos is not None:
            raise ValueError("videos: this stand-in for Qwen2-VL's processor takes images only (install torchvision "
                             "for transformers' own)")
        text = [text] if isinstance(text, str) else list(text)
        out: dict[str, Any] = {}
        if images:
            out = dict(self.image_processor(images=images, return_tensors=return_tensors))
            counts = iter((out["image_grid_thw"].prod(-1) // self.merge**2).tolist())
            text = ["".join(part if i == 0 else self.image_token * next(counts) + part
                            for i, part in enumerate(t.split(self.image_token))) for t in text]
        out.update(self.tokenizer(text, return_tensors=return_tensors, padding=True, **kwargs))
        return BatchFeature(out)

    def apply_chat_template(self, messages: list[dict[str, Any]], **kwargs: Any) -> Any:
        return self.tokenizer.apply_chat_template(messages, chat_template=self.chat_template, **kwargs)

    def decode(self, *args: Any, **kwargs: Any) -> str:
        return self.tokenizer.decode(*args, **kwargs)

    def batch_decode(self, *args: Any, **kwargs: Any) -> list[str]:
        return self.tokenizer.batch_decode(*args, **kwargs)

    def save_pretrained(self, directory: str | os.PathLike, **kwargs: Any) -> None:
        """Its tokenizer (with the chat template) and image processor: `load_processor` reads them back, and so
        does transformers' own processor where torchvision is installed."""
        if self.chat_template and not getattr(self.tokenizer, "chat_template", None):
            self.tokenizer.chat_template = self.chat_template
        self.tokenizer.save_pretrained(directory, **kwargs)
        self.image_processor.save_pretrained(directory, **kwargs)

    @classmethod
    def from_pretrained(cls, name_or_path: str | os.PathLike) -> QwenVLImageProcessor:
        from transformers import AutoTokenizer
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        return cls(Qwen2VLImageProcessorPil.from_pretrained(name_or_path), AutoTokenizer.from_pretrained(name_or_path))


def load_processor(name_or_path: str | os.PathLike, model_type: str | None) -> Any:
    """`AutoProcessor` of a vision-language model; for a Qwen-VL model whose own processor cannot be built here (no
    torchvision), `QwenVLImageProcessor`."""
    from transformers import AutoProcessor

    try:
        return AutoProcessor.from_pretrained(name_or_path)
    except (ImportError, AttributeError, ValueError, TypeError):
        if model_type not in QWEN_VL_TYPES:
            raise
        return QwenVLImageProcessor.from_pretrained(name_or_path)
