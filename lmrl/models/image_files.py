"""Images as files and text, without torch: what data rows, environments' observations and the generation server's
requests hold (a path, bytes, a PIL image, a `datasets` Image) opened as PIL images, and an image as base64 PNG
(how a prompt's images travel in JSON). `lmrl.data` imports this, and importing the data must not import torch."""

from __future__ import annotations

import io
import os
from collections.abc import Mapping
from typing import Any


def open_image(value: Any):
    """The PIL image a value holds (a path, bytes, a PIL image or a `datasets` Image's `{"bytes", "path"}`), loaded:
    a row's images and an environment's observation images alike."""
    from PIL import Image

    if isinstance(value, Image.Image):
        return value
    if isinstance(value, Mapping):
        value = value.get("bytes") if value.get("bytes") is not None else value.get("path")
    if isinstance(value, (bytes, bytearray)):
        image = Image.open(io.BytesIO(value))
    else:
        image = Image.open(os.fspath(value))
    image.load()
    return image


def image_to_text(image: Any) -> str:
    """An image as base64 PNG text, lossless: how a prompt's images travel in a JSON request (`lmrl serve`)."""
    import base64

    buffer = io.BytesIO()
    open_image(image).save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode("ascii")
