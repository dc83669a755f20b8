"""What the generation server (`lmrl.rollout.server`) reads and writes besides JSON: a request's head (`read_head`),
weights streamed one tensor at a time (`frames`, `read_frames`), and request bodies read no further than their length
or the server's limit (`Sized`, `Chunked`, `TooLarge`)."""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable, Iterator
from typing import BinaryIO

import torch

MAX_HEADERS = 100
MAX_LINE = 1 << 16


class Headers(dict):
    """A request's headers by lower-cased name (the first of repeated ones): `get` as http.server's message's."""

    def get(self, name: str, default=None):  # noqa: ANN001 - a header's value or whatever the caller gives
        return super().get(name.lower(), default)


def read_head(rfile: BinaryIO, request_line: bytes) -> tuple[str, str, str, Headers] | tuple[int, str]:
    """(method, path, version, headers) of an HTTP/1.0 or 1.1 request whose first line was `request_line`, the headers
    read from `rfile` up to the blank line; or (status, one line) for a request that is none. Read by hand: http.server
    runs the email package's parser over each request's headers, a fair part of a small request's cost."""
    words = str(request_line, "iso-8859-1").rstrip("\r\n").split()
    if len(words) != 3 or words[2] not in ("HTTP/1.0", "HTTP/1.1"):
        return 400, f"bad request line: {' '.join(words)[:80]!r} (METHOD PATH HTTP/1.1)"
    headers = Headers()
    for _ in range(MAX_HEADERS + 1):
        line = rfile.readline(MAX_LINE + 1)
        if len(line) > MAX_LINE:
            return 431, f"a header line over {MAX_LINE} bytes"
        if line in (b"\r\n", b"\n", b""):
            return words[0], words[1], words[2], headers
        name, colon, value = str(line, "iso-8859-1").partition(":")
        if not colon or not name.strip() or name != name.strip():
            return 400, f"bad header line: {line[:60]!r}"
        headers.setdefault(name.lower(), value.strip())
    return 431, f"more than {MAX_HEADERS} headers"


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}
MAX_FRAME_HEADER = 1 << 16  # a frame's JSON header: a name, a dtype and a shape


def frames(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[bytes]:
    """(name, tensor) pairs as bytes, one tensor at a time: a 4-byte little-endian header length, the JSON header
    {"name", "dtype", "shape"}, the raw bytes; a zero length ends the stream."""
    for name, tensor in weights:
        tensor = tensor.detach().to("cpu").contiguous()
        header = json.dumps({"name": name, "dtype": str(tensor.dtype).removeprefix("torch."),
                             "shape": list(tensor.shape)}).encode()
        yield struct.pack("<I", len(header)) + header
        yield tensor.reshape(-1).view(torch.uint8).numpy().tobytes()
    yield struct.pack("<I", 0)


def read_frames(stream: BinaryIO) -> Iterator[tuple[str, torch.Tensor]]:
    """The (name, tensor) pairs of a `frames` stream, each read when asked for."""
    while True:
        (size,) = struct.unpack("<I", _exactly(stream, 4))
        if size == 0:
            return
        if size > MAX_FRAME_HEADER:
            raise ValueError(f"weights: a frame header of {size} bytes (at most {MAX_FRAME_HEADER})")
        header = json.loads(_exactly(stream, size))
        if header.get("dtype") not in DTYPES:
            raise ValueError(f"weights: dtype {str(header.get('dtype'))[:40]!r} is none of {', '.join(DTYPES)}")
        dtype, shape = DTYPES[header["dtype"]], header.get("shape")
        if not isinstance(shape, list) or any(isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in shape):
            raise ValueError(f"weights: shape {str(shape)[:80]} of {str(header.get('name'))[:80]!r} is not a list of sizes")
        numel = 1
        for d in shape:
            numel *= d
        data = bytearray(_exactly(stream, numel * torch.empty((), dtype=dtype).element_size()))
        yield header["name"], torch.frombuffer(data, dtype=torch.uint8).view(dtype).reshape(header["shape"])


def _exactly(stream: BinaryIO, size: int) -> bytes:
    data = stream.read(size)
    if len(data) != size:
        raise ValueError(f"weights: the stream ended {size - len(data)} bytes short")
    return data


class TooLarge(ValueError):
    """A request body over the server's limit (HTTP 413)."""


class Chunked:
    """A readable view of an HTTP body sent with chunked transfer encoding, cut at `limit` bytes (`TooLarge`)."""

    def __init__(self, raw: BinaryIO, limit: int | None = None):
        self.raw, self.buffer, self.done, self.limit, self.total = raw, b"", False, limit, 0

    def read(self, size: int) -> bytes:
        while len(self.buffer) < size and not self.done:
            length = int(self.raw.readline(64).split(b";")[0].strip() or b"0", 16)
            if length == 0:
                self.done = True
                self.raw.readline(64)
                break
            self.total += length
            if self.limit is not None and self.total > self.limit:  # refused before the chunk is read
                raise TooLarge(f"body: over this server's limit of {self.limit} bytes")
            self.buffer += self.raw.read(length)
            self.raw.readline(64)  # the chunk's CRLF
        data, self.buffer = self.buffer[:size], self.buffer[size:]
        return data


class Sized:
    """A readable view of an HTTP body of Content-Length `length`: reads stop at its end."""

    def __init__(self, raw: BinaryIO, length: int):
        self.raw, self.left = raw, length

    def read(self, size: int) -> bytes:
        data = self.raw.read(min(size, self.left))
        self.left -= len(data)
        return data
