"""A generation server: one generator behind HTTP, for a trainer in another process or on another machine
(`rollout.backend=vllm-server`, `lmrl.rollout.remote`) and for any OpenAI client.

    lmrl serve model.name_or_path=DIR --port 8000        # a vLLM engine (rollout.backend=lmrl: lmrl's decode)

    GET  /health                 {"version": policy version of the weights it holds, "model": its name}
    GET  /v1/models              the OpenAI model list (one model)
    POST /v1/completions         OpenAI completions: prompt (text or token ids), max_tokens, temperature, top_p,
                                 n, stop, seed, logprobs; each choice also carries its `token_ids`
    POST /v1/chat/completions    OpenAI chat completions: messages rendered with the tokenizer's chat template
    POST /lmrl/generate          {"prompts": [[ids]], "n", "params"} -> sampled tokens, log-probs, finished flags
    POST /lmrl/weights           new weights (header X-Lmrl-Version), streamed one tensor at a time (`frames`)

A request generates alone (the engine batches the rows of one request), and weights load between requests,
never during one: a client that pushes weights and then generates samples with them. Errors are HTTP 400
(a bad request) or 500 with {"error": {"message": one line}}.
"""

from __future__ import annotations

import json
import struct
import threading
import time
import uuid
from collections.abc import Iterable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, BinaryIO

import torch
from torch import nn

from lmrl.models.forward import sequence_logprobs
from lmrl.models.prompt_encoding import encode_prompts
from lmrl.models.weights import CheckpointLayout
from lmrl.rollout.base import Generator, SamplingParams
from lmrl.rollout.hf import HFGenerator

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


# ------------------------------------------------------------------------------ weights on the wire
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
        header = json.loads(_exactly(stream, size))
        dtype = DTYPES[header["dtype"]]
        numel = 1
        for d in header["shape"]:
            numel *= d
        data = bytearray(_exactly(stream, numel * torch.empty((), dtype=dtype).element_size()))
        yield header["name"], torch.frombuffer(data, dtype=torch.uint8).view(dtype).reshape(header["shape"])


def _exactly(stream: BinaryIO, size: int) -> bytes:
    data = stream.read(size)
    if len(data) != size:
        raise ValueError(f"weights: the stream ended {size - len(data)} bytes short")
    return data


class _Chunked:
    """A readable view of an HTTP body sent with chunked transfer encoding."""

    def __init__(self, raw: BinaryIO):
        self.raw, self.buffer, self.done = raw, b"", False

    def read(self, size: int) -> bytes:
        while len(self.buffer) < size and not self.done:
            length = int(self.raw.readline().split(b";")[0].strip() or b"0", 16)
            if length == 0:
                self.done = True
                self.raw.readline()
                break
            self.buffer += self.raw.read(length)
            self.raw.readline()  # the chunk's CRLF
        data, self.buffer = self.buffer[:size], self.buffer[size:]
        return data


# ------------------------------------------------------------------------------ a generator the server owns
class ModelGenerator:
    """lmrl's decode over a model this process owns, taking new weights by name (`RemoteGenerator`): what
    `lmrl serve` runs with rollout.backend=lmrl."""

    def __init__(self, model: nn.Module, tokenizer: Any, seed: int = 0, **options: Any):
        self.model, self.version = model, -1
        self._layout, self._names = None, set()  # where each checkpoint-named weight goes in the model
        self.decoder = HFGenerator(model, tokenizer, seed=seed, **options)  # options: HFGenerator's (batch_size)
        self.tokenizer, self.pad_token_id = tokenizer, self.decoder.pad_token_id
        self._rng = self.decoder._rng

    def generate(self, prompts, n, params):
        return self.decoder.generate(prompts, n, params)

    @torch.no_grad()
    def score(self, prompt: list[int], response: list[int]) -> torch.Tensor:
        """[T] log-probs of the `response` tokens after `prompt` at temperature 1 (the sync probe's sampler side)."""
        return sequence_logprobs(self.model, prompt, response)

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Weights under checkpoint names (`export_weights`), written into the model's own layout."""
        if self._layout is None:
            self._layout = CheckpointLayout(self.model)
            self._names = self._layout.names()
        for name, tensor in weights:
            if name not in self._names:
                raise ValueError(f"weights: the model has no parameter {name!r}")
            self._layout.write(name, tensor)
        self.version = version


# ------------------------------------------------------------------------------ the server
class GenerationServer(ThreadingHTTPServer):
    """`generator` behind HTTP at (host, port); port 0 takes a free one (`url` says which)."""

    daemon_threads = True

    def __init__(self, generator: Generator, tokenizer: Any, name: str, host: str = "127.0.0.1", port: int = 0,
                 max_prompt_length: int = 4096):
        super().__init__((host, port), _Handler)
        self.generator, self.tokenizer, self.name = generator, tokenizer, name
        self.max_prompt_length = max_prompt_length
        self.lock = threading.Lock()

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"

    # --- the requests, each a JSON body -> a JSON answer
    def health(self) -> dict[str, Any]:
        return {"version": getattr(self.generator, "version", -1), "model": self.name}

    def lmrl_generate(self, body: dict[str, Any]) -> dict[str, Any]:
        params = SamplingParams(**body.get("params", {}))
        with self.lock:
            rollout = self.generator.generate([list(map(int, p)) for p in body["prompts"]], int(body.get("n", 1)),
                                              params)
            version = getattr(self.generator, "version", -1)
        lengths = rollout.response_mask.sum(1).tolist()
        return {"tokens": [row[:k] for row, k in zip(rollout.response_ids.tolist(), lengths)],
                "logprobs": [row[:k] for row, k in zip(rollout.logprobs.tolist(), lengths)],
                "finished": rollout.finished.tolist(), "version": version}

    def load_weights(self, stream: BinaryIO, version: int) -> dict[str, Any]:
        with self.lock:
            self.generator.load_weights(read_frames(stream), version)
        return self.health()

    def completions(self, body: dict[str, Any], chat: bool) -> dict[str, Any]:
        prompts = self._prompts(body, chat)
        n = int(body.get("n") or 1)
        stop = body.get("stop") or []
        params = SamplingParams(max_new_tokens=int(body.get("max_tokens") or body.get("max_completion_tokens") or 16),
                                temperature=float(body.get("temperature", 1.0)), top_p=float(body.get("top_p", 1.0)),
                                top_k=int(body.get("top_k") or 0), stop=[stop] if isinstance(stop, str) else list(stop),
                                seed=body.get("seed"))
        with self.lock:
            rollout = self.generator.generate(prompts, n, params)
        lengths = rollout.response_mask.sum(1).tolist()
        choices = []
        for i, (text, k) in enumerate(zip(rollout.texts, lengths)):
            ids, logps = rollout.response_ids[i, :k].tolist(), rollout.logprobs[i, :k].tolist()
            tokens = [self.tokenizer.decode([t]) for t in ids]
            reason = "stop" if bool(rollout.finished[i]) else "length"
            choice: dict[str, Any] = {"index": i, "finish_reason": reason, "token_ids": ids}
            if chat:
                choice["message"] = {"role": "assistant", "content": text}
                choice["logprobs"] = {"content": [{"token": t, "logprob": lp, "bytes": None, "top_logprobs": []}
                                                  for t, lp in zip(tokens, logps)]} if body.get("logprobs") else None
            else:
                choice["text"] = text
                choice["logprobs"] = {"tokens": tokens, "token_logprobs": logps, "top_logprobs": None,
                                      "text_offset": []} if body.get("logprobs") is not None else None
            choices.append(choice)
        prompt_tokens = sum(len(prompts[int(j)]) for j in rollout.prompt_index)
        completion_tokens = sum(lengths)
        return {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
                "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                "model": self.name, "choices": choices,
                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                          "total_tokens": prompt_tokens + completion_tokens}}

    def _prompts(self, body: dict[str, Any], chat: bool) -> list[list[int]]:
        if chat:
            if not isinstance(body.get("messages"), list) or not body["messages"]:
                raise ValueError("messages: expected a non-empty list of {role, content}")
            return encode_prompts(self.tokenizer, [body["messages"]], self.max_prompt_length, use_chat_template=True)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return [prompt]
        if isinstance(prompt, str):
            prompt = [prompt]
        if not isinstance(prompt, list) or not prompt:
            raise ValueError("prompt: expected a string, a list of strings or a list of token ids")
        if all(isinstance(p, list) for p in prompt):
            return [list(map(int, p)) for p in prompt]
        return encode_prompts(self.tokenizer, list(prompt), self.max_prompt_length, use_chat_template=False)


class _Handler(BaseHTTPRequestHandler):
    server: GenerationServer
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - quiet: a trainer's console
        pass

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        if self.path == "/health":
            return self._answer(200, self.server.health())
        if self.path == "/v1/models":
            return self._answer(200, {"object": "list", "data": [{"id": self.server.name, "object": "model",
                                                                  "created": 0, "owned_by": "lmrl"}]})
        return self._answer(404, {"error": {"message": f"no such endpoint: GET {self.path}"}})

    def do_POST(self) -> None:  # noqa: N802
        try:
            if self.path == "/lmrl/weights":
                body = _Chunked(self.rfile) if "chunked" in self.headers.get("Transfer-Encoding", "") else self.rfile
                return self._answer(200, self.server.load_weights(body, int(self.headers.get("X-Lmrl-Version", -1))))
            request = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            if self.path == "/lmrl/generate":
                return self._answer(200, self.server.lmrl_generate(request))
            if self.path in ("/v1/completions", "/v1/chat/completions"):
                return self._answer(200, self.server.completions(request, chat=self.path.endswith("chat/completions")))
            return self._answer(404, {"error": {"message": f"no such endpoint: POST {self.path}"}})
        except (ValueError, TypeError, KeyError) as e:
            return self._answer(400, {"error": {"message": f"{type(e).__name__}: {' '.join(str(e).split())[:500]}"}})
        except Exception as e:  # noqa: BLE001 - the client gets one line; the server keeps serving
            return self._answer(500, {"error": {"message": f"{type(e).__name__}: {' '.join(str(e).split())[:500]}"}})

    def _answer(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
