"""A generation server: one generator behind HTTP, for a trainer in another process or on another machine
(`rollout.backend=vllm-server`, `lmrl.rollout.remote`) and for any OpenAI client.

    lmrl serve model.name_or_path=DIR --port 8000        # a vLLM engine (rollout.backend=lmrl: lmrl's decode)

    GET  /health                 {"version": policy version of the weights it holds, "model": its name}
    GET  /v1/models              the OpenAI model list (one model)
    POST /v1/completions         OpenAI completions: prompt (text or token ids), max_tokens, temperature, top_p,
                                 n, stop, seed, logprobs (a number: that many alternatives per token);
                                 each choice also carries its `token_ids`
    POST /v1/chat/completions    OpenAI chat completions: messages rendered with the tokenizer's chat template
                                 and its `tools`; the model's tool calls (its family's format, `chat_turns`) come
                                 back in `tool_calls`
                                 (logprobs and top_logprobs as OpenAI: alternatives at temperature 1)
                                 (both: `stream: true` answers with server-sent events, `lmrl.rollout.streaming`)
    POST /lmrl/generate          {"prompts": [[ids]], "n", "params"} -> sampled tokens, log-probs, finished flags;
                                 a vision-language model's prompts add "images": [{"ids", "images": [base64 PNG]}]
    POST /lmrl/weights           new weights (header X-Lmrl-Version), streamed one tensor at a time (`lmrl.rollout.wire.frames`)

Concurrent requests that sample alike are batched into one generator call (`lmrl.rollout.batcher`; a seeded
request runs alone), and weights load between calls,
never during one: a client that pushes weights and then generates samples with them. Errors are HTTP 400
(a bad request), 401 / 403 (no key, no weights secret), 413 (a body over the limit) or 500 with
{"error": {"message": one line, "type", "param", "code"}} (OpenAI's shape).

Who gets in (docs/generation.md, "Who can reach the server"): with an API key (`api_key`), every endpoint
/health included wants `Authorization: Bearer KEY`, compared in constant time; without one the server listens
on loopback only. A weight push also wants the weights secret (`X-Lmrl-Weights-Secret`); a server started without
one takes no weights, on loopback too (a server a run starts has a random one). What a request may ask for is bounded (`Limits`): a body over the limit
is refused from its Content-Length before it is read, a chunked one where it crosses the limit.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import socket
import threading
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, BinaryIO

import torch
from torch import nn

from lmrl.errors import ConfigError
from lmrl.models.forward import sequence_logprobs
from lmrl.models.prompt_encoding import encode_prompts
from lmrl.models.vision import image_media, image_prompts_of
from lmrl.models.weights import CheckpointLayout
from lmrl.rollout.base import Generator, SamplingParams
from lmrl.rollout.batcher import Batcher
from lmrl.rollout.chat_turns import parse_tool_calls, tool_call_format
from lmrl.rollout.hf import HFGenerator
from lmrl.rollout.ops import stop_found
from lmrl.rollout.streaming import Events, stream_events, wants_stream
from lmrl.rollout.wire import Chunked, Sized, TooLarge, read_frames, read_head


# ------------------------------------------------------------------------------ a generator the server owns
class ModelGenerator:
    """lmrl's decode over a model this process owns, taking new weights by name (`RemoteGenerator`): what
    `lmrl serve` runs with rollout.backend=lmrl."""

    def __init__(self, model: nn.Module, tokenizer: Any, seed: int = 0, processor: Any = None, **options: Any):
        self.model, self.version, self.processor = model, -1, processor
        self._layout, self._names = None, set()  # where each checkpoint-named weight goes in the model
        self.decoder = HFGenerator(model, tokenizer, seed=seed, **options)  # options: HFGenerator's (batch_size)
        self.tokenizer, self.pad_token_id = tokenizer, self.decoder.pad_token_id
        self._rng = self.decoder._rng
        self.processes_images = processor is not None  # a vision-language model: requests may carry images

    def generate(self, prompts, n, params, images=None, media=None):
        """`images` (`ImagePrompt`s, one per prompt): each prompt's images, processed here by the model's image
        processor; `prompts` are the expanded ids, as the client's processor wrote them. `media`: the bundles
        already made (an asynchronous run's generator process), as `HFGenerator.generate` takes them."""
        if images is None:
            return self.decoder.generate(prompts, n, params, media=media)
        if self.processor is None:
            raise ValueError("images: this server's model takes no images")
        return self.decoder.generate(prompts, n, params, media=[image_media(self.processor, p.images) for p in images])

    @torch.no_grad()
    def score(self, prompt: list[int], response: list[int]) -> torch.Tensor:
        """[T] log-probs of the `response` tokens after `prompt` at temperature 1 (the sync probe's sampler side)."""
        return sequence_logprobs(self.model, prompt, response)

    @torch.no_grad()
    def top_logprobs(self, prompt: list[int], response: list[int], k: int) -> list[list[tuple[int, float]]]:
        """The `k` most likely tokens and their log-probs at temperature 1 at each position of `response` after
        `prompt` (what an OpenAI client's `top_logprobs` asks for), from one forward over the sequence."""
        device = next(self.model.parameters()).device
        ids = torch.tensor([[*prompt, *response]], device=device)
        logits = self.model(input_ids=ids).logits[0, len(prompt) - 1: -1].float()  # [T, V]: one row, a short response
        values, tokens = torch.log_softmax(logits, dim=-1).topk(k, dim=-1)
        return [list(zip(t.tolist(), v.tolist())) for t, v in zip(tokens, values)]

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


# ------------------------------------------------------------------------------ who gets in, and how much
def is_loopback(host: str) -> bool:
    """Whether every address `host` names is this machine's own (127.0.0.0/8, ::1): "" and 0.0.0.0 are not."""
    try:
        addresses = {info[4][0] for info in socket.getaddrinfo(host or None, None, proto=socket.IPPROTO_TCP)}
    except (OSError, UnicodeError):
        return False
    return bool(host) and all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses)


def check_exposure(host: str, api_key: str | None) -> None:
    """Refuse to listen beyond loopback without an API key: a model anyone on the network may run is not lmrl's to
    hand out."""
    if not api_key and not is_loopback(host):
        raise ConfigError(f"--host {host}: listening beyond loopback needs an API key (--api-key KEY or the "
                          "LMRL_API_KEY environment variable); or listen on 127.0.0.1")


@dataclass
class Limits:
    """What one request may ask for; beyond it the answer is one line (413 for a body, else 400). 0: no limit."""

    max_body_bytes: int = 8 << 20
    """A JSON body (the weights stream is bounded by `max_weights_bytes` instead)."""
    max_n: int = 64
    """Completions per prompt (`n`)."""
    max_sequences: int = 2048
    """Prompts times n of one request."""
    max_prompt_length: int = 4096
    """Tokens of one prompt."""
    max_new_tokens: int = 4096
    """`max_tokens` (`max_new_tokens` of /lmrl/generate)."""
    context: int = 0
    """Prompt and completion together: the engine's or the model's positions."""
    vocab_size: int = 0
    """Token ids in prompts are below it."""
    max_weights_bytes: int = 0
    """One weight push, frames included: a few times the model's bytes (a push may come in float32)."""
    max_images: int = 16
    """Images of one prompt (a vision-language model's /lmrl/generate)."""
    max_image_pixels: int = 16 << 20
    """Pixels of one image, read from its header before it is decoded."""


class Refused(Exception):
    """A request answered with `status` and one line, the body left unread (the connection closes)."""

    def __init__(self, status: int, message: str, code: str | None = None):
        super().__init__(message)
        self.status, self.code = status, code


# ------------------------------------------------------------------------------ the server
class GenerationServer(ThreadingHTTPServer):
    """`generator` behind HTTP at (host, port); port 0 takes a free one (`url` says which).

    Args:
        api_key: wanted from every request as `Authorization: Bearer KEY`; None only on loopback.
        weights_secret: wanted from a weight push as `X-Lmrl-Weights-Secret`; None: no pushes (an inference server).
        limits: what one request may ask for (`Limits`).
    """

    daemon_threads = True
    request_queue_size = 256  # connections waiting to be accepted (socketserver's 5 resets a burst of 32 clients)

    def __init__(self, generator: Generator, tokenizer: Any, name: str, host: str = "127.0.0.1", port: int = 0,
                 max_prompt_length: int = 4096, api_key: str | None = None, weights_secret: str | None = None,
                 limits: Limits | None = None, tool_format: str = "auto"):
        check_exposure(host, api_key)
        super().__init__((host, port), _Handler)
        self.generator, self.tokenizer, self.name = generator, tokenizer, name
        self.limits = limits or Limits(max_prompt_length=max_prompt_length)
        self.api_key, self.weights_secret = api_key or None, weights_secret or None
        self.loopback = is_loopback(host)
        self.lock = threading.Lock()  # a generation or a weight load at a time
        self.batcher = Batcher(generator, self.lock, max_sequences=self.limits.max_sequences)
        self.tool_format = tool_call_format(tokenizer, tool_format)  # the family's tool calls (`chat_turns`)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host}:{port}"

    # --- the requests, each a JSON body -> a JSON answer
    def health(self) -> dict[str, Any]:
        return {"version": getattr(self.generator, "version", -1), "model": self.name,
                "limits": {"max_n": self.limits.max_n, "max_sequences": self.limits.max_sequences}}

    def lmrl_generate(self, body: dict[str, Any]) -> dict[str, Any]:
        prompts = body.get("prompts")
        if not isinstance(prompts, list) or not prompts or not all(isinstance(p, list) for p in prompts):
            raise ValueError("prompts: expected a non-empty list of lists of token ids")
        params = body.get("params", {})
        if not isinstance(params, dict):
            raise ValueError(f"params: expected an object of SamplingParams fields, got {_show(params)}")
        params = SamplingParams(**params)
        params.validate()
        if params.seed is not None:
            _integer(params.seed, "params.seed", 0, "", low=None)
        _integer(params.max_new_tokens, "max_new_tokens", self.limits.max_new_tokens,
                 "lmrl serve rollout.max_new_tokens=...")
        n = _integer(body.get("n", 1), "n", self.limits.max_n, "lmrl serve --max-n")
        self._check(prompts, n, params.max_new_tokens, "max_new_tokens")
        if body.get("images") is not None:
            return self._generate_with_images(prompts, n, params, self._image_prompts(body["images"], len(prompts)))
        rows = self.batcher.generate(prompts, n, params)
        return {"tokens": rows.tokens, "logprobs": rows.logprobs, "finished": rows.finished, "version": rows.version}

    def _image_prompts(self, given: Any, count: int) -> list[Any]:
        """A request's `images` (`lmrl.models.vision.image_prompts_of`), their ids checked as prompts are."""
        if not getattr(self.generator, "processes_images", False):
            raise ValueError("images: this server's model takes no images")
        out = image_prompts_of(given, count, self.limits.max_images, self.limits.max_image_pixels)
        self._check([p.ids for p in out], 1, 0, "max_new_tokens")
        return out

    def _generate_with_images(self, prompts: list[list[int]], n: int, params: SamplingParams,
                              images: list[Any]) -> dict[str, Any]:
        """A request with images runs alone (the batcher merges token-id requests), between the batcher's calls (a
        joining decode takes no more rows meanwhile) and with its precision."""
        with self.batcher.exclusive(), self.batcher.precision():
            version = getattr(self.generator, "version", -1)
            rollout = self.generator.generate(prompts, n, params, images=images)
        lengths = rollout.response_mask.sum(1).tolist()
        return {"tokens": [row[:k] for row, k in zip(rollout.response_ids.tolist(), lengths)],
                "logprobs": [row[:k] for row, k in zip(rollout.logprobs.tolist(), lengths)],
                "finished": rollout.finished.tolist(), "version": version}

    def load_weights(self, stream: BinaryIO, version: int) -> dict[str, Any]:
        with self.batcher.exclusive():
            self.generator.load_weights(read_frames(stream), version)
        return self.health()

    def completions(self, body: dict[str, Any], chat: bool) -> dict[str, Any]:
        prompts = self._prompts(body, chat)
        n = _integer(_given(body, "n", 1), "n", self.limits.max_n, "lmrl serve --max-n")
        stop = body.get("stop") or []
        max_tokens = _given(body, "max_tokens", _given(body, "max_completion_tokens", 16))
        params = SamplingParams(max_new_tokens=_integer(max_tokens, "max_tokens", self.limits.max_new_tokens,
                                                        "lmrl serve rollout.max_new_tokens=..."),
                                temperature=_number(_given(body, "temperature", 1.0), "temperature"),
                                top_p=_number(_given(body, "top_p", 1.0), "top_p"),
                                top_k=_integer(body.get("top_k") or 0, "top_k", 0, "", low=0),
                                stop=[stop] if isinstance(stop, str) else _list(stop, "stop"),
                                seed=None if body.get("seed") is None else _integer(body["seed"], "seed", 0, "", low=None))
        params.validate()
        self._check(prompts, n, params.max_new_tokens, "max_tokens")
        keep_stop = _flag(body, "include_stop_str_in_output")
        rows = self.batcher.generate(prompts, n, params)
        k = _top_logprobs(body, chat)
        choices = []
        for i, (text, ids, logps) in enumerate(zip(rows.texts, rows.tokens, rows.logprobs)):
            tokens = [self.tokenizer.decode([t]) for t in ids] if body.get("logprobs") is not None else []  # asked only
            top = self._alternatives(prompts[i // n], ids, k)
            reason = "stop" if rows.finished[i] else "length"
            tail = stop_found(text, params.stop) if rows.finished[i] else None
            choice: dict[str, Any] = {"index": i, "finish_reason": reason, "stop_reason": tail, "token_ids": ids}
            shown = text[:len(text) - len(tail)] if tail and not keep_stop else text  # the API's text has no stop string
            if chat:
                # tool calls from the whole text (a stop string may close one); without any, the content is `shown`
                content, calls = self.tool_calls(text, ids, f"call-{i}") if body.get("tools") else (shown, [])
                content = content if calls else shown
                choice["message"] = {"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})}
                choice["finish_reason"] = "tool_calls" if calls and rows.finished[i] else reason
                choice["logprobs"] = {"content": [
                    {"token": t, "logprob": lp, "bytes": None,
                     "top_logprobs": [{"token": a, "logprob": alp, "bytes": None} for a, alp in alts.items()]}
                    for t, lp, alts in zip(tokens, logps, top)]} if body.get("logprobs") else None
            else:
                choice["text"] = shown
                choice["logprobs"] = {"tokens": tokens, "token_logprobs": logps, "top_logprobs": top if k else None,
                                      "text_offset": []} if body.get("logprobs") is not None else None
            choices.append(choice)
        prompt_tokens = n * sum(map(len, prompts))
        completion_tokens = sum(map(len, rows.tokens))
        return {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}",
                "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
                "model": self.name, "choices": choices,
                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                          "total_tokens": prompt_tokens + completion_tokens}}

    def tool_calls(self, text: str, ids: list[int], call_id: str) -> tuple[str | None, list[dict[str, Any]]]:
        """(content, tool_calls) of a chat turn in the model family's format (`lmrl.rollout.chat_turns`)."""
        raw = self.tokenizer.decode(ids, skip_special_tokens=False) if self.tool_format == "mistral" else None
        return parse_tool_calls(text, call_id, self.tool_format, raw)

    def _alternatives(self, prompt: list[int], response: list[int], k: int) -> list[dict[str, float]]:
        """Per response token, its `k` likeliest alternatives as {text: log-prob} ({} each when k is 0), from the
        generator's forward over the sampled sequence, between generations (a weight push in between would be
        scored with the new weights)."""
        if not k or not response:
            return [{} for _ in response]
        if not hasattr(self.generator, "top_logprobs"):
            raise ValueError(f"top_logprobs: this server's generator ({type(self.generator).__name__}) does not "
                             "give alternatives; ask for logprobs without them")
        with self.batcher.exclusive():
            top = self.generator.top_logprobs(prompt, response, k)
        return [{self.tokenizer.decode([t]): lp for t, lp in position} for position in top]

    def _prompts(self, body: dict[str, Any], chat: bool) -> list[list[int]]:
        longest = self.limits.max_prompt_length
        if chat:
            if not isinstance(body.get("messages"), list) or not body["messages"]:
                raise ValueError("messages: expected a non-empty list of {role, content}")
            tools = body.get("tools") or None
            if tools is not None and not isinstance(tools, list):
                raise ValueError(f"tools: expected a list of tool schemas, got {_show(tools)}")
            return encode_prompts(self.tokenizer, [body["messages"]], longest, use_chat_template=True, tools=tools)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return [prompt]
        if isinstance(prompt, str):
            prompt = [prompt]
        if not isinstance(prompt, list) or not prompt:
            raise ValueError("prompt: expected a string, a list of strings or a list of token ids")
        if all(isinstance(p, list) for p in prompt):
            return prompt
        if not all(isinstance(p, str) for p in prompt):
            raise ValueError("prompt: expected a string, a list of strings or a list of token ids")
        if len(prompt) > (self.limits.max_sequences or len(prompt)):  # before tokenizing them
            raise ValueError(f"prompt: {len(prompt)} prompts are more than this server allows "
                             f"({self.limits.max_sequences}; lmrl serve --max-sequences)")
        return encode_prompts(self.tokenizer, list(prompt), longest, use_chat_template=False)

    def _check(self, prompts: list[list[Any]], n: int, max_tokens: int, key: str) -> None:
        """Token-id prompts within the vocabulary and the prompt limit, rows and context within the limits."""
        lim = self.limits
        if lim.max_sequences and len(prompts) * n > lim.max_sequences:
            raise ValueError(f"n: {len(prompts)} prompts x n={n} are {len(prompts) * n} sequences, more than this "
                             f"server allows ({lim.max_sequences}; lmrl serve --max-sequences)")
        for i, p in enumerate(prompts):
            if not p or any(isinstance(t, bool) or not isinstance(t, int) for t in p):
                raise ValueError(f"prompt {i}: expected a non-empty list of token ids")
            if lim.vocab_size and not all(0 <= t < lim.vocab_size for t in p):
                bad = next(t for t in p if not 0 <= t < lim.vocab_size)
                raise ValueError(f"prompt {i}: token id {bad} is outside the vocabulary of {lim.vocab_size} tokens")
            if lim.max_prompt_length and len(p) > lim.max_prompt_length:
                raise ValueError(f"prompt {i}: {len(p)} tokens, more than this server allows ({lim.max_prompt_length}; "
                                 "lmrl serve rollout.max_prompt_length=...)")
            if lim.context and len(p) + max_tokens > lim.context:
                raise ValueError(f"{key}: a prompt of {len(p)} tokens and {key}={max_tokens} exceed the model's "
                                 f"context of {lim.context} tokens")


def _given(body: dict[str, Any], key: str, default: Any) -> Any:
    """body[key], or `default` where it is missing or null (OpenAI clients send null for "not given")."""
    value = body.get(key)
    return default if value is None else value


def _integer(value: Any, key: str, most: int, option: str, low: int | None = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{key}: expected an integer, got {_show(value)}")
    if low is not None and value < low:
        raise ValueError(f"{key}: must be >= {low}, got {value}")
    if most and value > most:
        raise ValueError(f"{key}: {value} is more than this server allows ({most}; {option})")
    return value


MAX_TOP_LOGPROBS = 20  # as OpenAI's API allows


def _top_logprobs(body: dict[str, Any], chat: bool) -> int:
    """How many alternatives per token a request asks for: chat's `top_logprobs` (with `logprobs: true`), the
    completions API's `logprobs` number; 0 for none."""
    if chat:
        asked = body.get("top_logprobs") if body.get("logprobs") else None
        return 0 if asked is None else _integer(asked, "top_logprobs", MAX_TOP_LOGPROBS, "OpenAI's limit", low=0)
    asked = body.get("logprobs")
    if asked is None or asked is False:
        return 0
    if asked is True:  # not the completions API's type, but meant as "the sampled token's"
        return 0
    return _integer(asked, "logprobs", MAX_TOP_LOGPROBS, "OpenAI's limit", low=0)


def _flag(body: dict[str, Any], key: str) -> bool:
    """body[key] as a boolean, False where it is missing or null."""
    value = _given(body, key, False)
    if not isinstance(value, bool):
        raise ValueError(f"{key}: expected true or false, got {_show(value)}")
    return value


def _number(value: Any, key: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{key}: expected a number, got {_show(value)}")
    return float(value)


def _list(value: Any, key: str) -> list[Any]:
    if not isinstance(value, list):
        raise ValueError(f"{key}: expected a string or a list of strings, got {_show(value)}")
    return value


def _show(value: Any) -> str:
    text = json.dumps(value) if isinstance(value, str | int | float | bool | type(None)) else type(value).__name__
    return text if len(text) <= 60 else text[:57] + "..."


def _same(given: str | None, secret: str) -> bool:
    """`given` equals `secret`, compared in constant time."""
    return given is not None and hmac.compare_digest(given.encode("utf-8", "surrogateescape"),
                                                     secret.encode("utf-8", "surrogateescape"))


class _Handler(BaseHTTPRequestHandler):
    server: GenerationServer
    protocol_version = "HTTP/1.1"
    timeout = 300  # seconds a connection may sit silent (a client that opens one and sends nothing holds a thread)
    # an answer's headers and body leave in one send (http.server flushes after each request), where two writes cost
    # a system call and a wake-up of the client more per request; TCP_NODELAY for an answer over the buffer: with
    # Nagle's algorithm its second write waits for the client's delayed ACK, 40 ms on Linux
    wbufsize = 1 << 16
    disable_nagle_algorithm = True

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - quiet: a trainer's console
        pass

    def parse_request(self) -> bool:
        """The request line and headers (`lmrl.rollout.wire.read_head`); False: answered already (one line)."""
        self.command, self.request_version, self.close_connection = None, "HTTP/0.9", True
        self.requestline = str(self.raw_requestline, "iso-8859-1").rstrip("\r\n")
        if not self.requestline.strip():
            return False
        head = read_head(self.rfile, self.raw_requestline)
        if len(head) == 2:
            self.request_version = "HTTP/1.1"  # the answer's status line
            self._error(*head)
            return False
        self.command, self.path, self.request_version, self.headers = head
        connection = self.headers.get("Connection", "").lower()
        self.close_connection = connection == "close" or (self.request_version == "HTTP/1.0" and connection != "keep-alive")
        if self.headers.get("Expect", "").lower() == "100-continue" and self.request_version == "HTTP/1.1":
            return self.handle_expect_100()
        return True

    def handle_expect_100(self) -> bool:
        ok = super().handle_expect_100()
        self.wfile.flush()  # the interim answer now, not with the final one (the writer is buffered: `wbufsize`)
        return ok

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self._serve(self._get)

    def do_POST(self) -> None:  # noqa: N802
        self._serve(self._post)

    def _serve(self, answer) -> None:
        """Authorize, then answer: every error is one line in OpenAI's error shape, and the server keeps serving."""
        try:
            self._authorize()
            return self._answer(200, answer())
        except Refused as e:
            self.close_connection = True  # its body, if any, was not read
            self._error(e.status, str(e), e.code)
            return self._linger()
        except TooLarge as e:
            self.close_connection = True
            hint = "a weight push: the model's size" if self.path == "/lmrl/weights" else "lmrl serve --max-body-mb"
            self._error(413, f"{e} ({hint})", "body_too_large")
            return self._linger()
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            self.close_connection = self.close_connection or self.path == "/lmrl/weights"  # a stream read part-way
            kind = "" if type(e) is ValueError else f"{type(e).__name__}: "  # lmrl's own checks say what they are
            return self._error(400, f"{kind}{' '.join(str(e).split())[:500]}")
        except Exception as e:  # noqa: BLE001 - the client gets one line; the server keeps serving
            return self._error(500, f"{type(e).__name__}: {' '.join(str(e).split())[:500]}")

    def _linger(self, seconds: float = 2.0) -> None:
        """After a refusal, read and drop what the client still sends for a moment before the socket closes: a
        client streaming its body then reads the answer instead of a connection reset."""
        try:
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_WR)
            self.connection.settimeout(0.25)
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline and self.connection.recv(1 << 16):
                pass
        except OSError:
            pass

    def _authorize(self) -> None:
        key = self.server.api_key
        if key is None:
            return
        scheme, _, token = self.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not _same(token.strip(), key):
            raise Refused(401, "authorization: a missing or wrong API key: send Authorization: Bearer KEY, the "
                          "server's --api-key / LMRL_API_KEY", "invalid_api_key")

    def _get(self) -> dict[str, Any]:
        if self.path == "/health":
            return self.server.health()
        if self.path == "/v1/models":
            return {"object": "list", "data": [{"id": self.server.name, "object": "model", "created": 0,
                                                "owned_by": "lmrl"}]}
        raise Refused(404, f"no such endpoint: GET {self.path}")

    def _post(self) -> dict[str, Any]:
        if self.path == "/lmrl/weights":
            return self.server.load_weights(self._weights_body(), _header_int(self.headers, "X-Lmrl-Version", -1))
        if self.path not in ("/lmrl/generate", "/v1/completions", "/v1/chat/completions"):
            raise Refused(404, f"no such endpoint: POST {self.path}")
        with self.server.batcher.incoming():  # a burst's generator call waits for this request
            request = json.loads(self._body(self.server.limits.max_body_bytes).read(1 << 62) or b"{}")
            if not isinstance(request, dict):
                raise ValueError(f"body: expected a JSON object, got {type(request).__name__}")
            if self.path == "/lmrl/generate":
                return self.server.lmrl_generate(request)
            chat, stream = self.path.endswith("chat/completions"), wants_stream(request)
            answer = self.server.completions(request, chat=chat)
            return stream_events(answer, chat, request) if stream else answer

    def _weights_body(self):
        secret = self.server.weights_secret
        if secret is None:
            raise Refused(403, "weights: this server takes no weights: it was started without a weights secret "
                          "(lmrl serve --weights-secret SECRET, better LMRL_WEIGHTS_SECRET)", "weights_refused")
        if not _same(self.headers.get("X-Lmrl-Weights-Secret"), secret):
            raise Refused(403, "weights: a missing or wrong X-Lmrl-Weights-Secret header (the server's "
                          "--weights-secret / LMRL_WEIGHTS_SECRET)", "invalid_weights_secret")
        return self._body(self.server.limits.max_weights_bytes)

    def _body(self, limit: int):
        """The request's body as a stream, refused (413) from its Content-Length before a byte of it is read."""
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            return Chunked(self.rfile, limit or None)
        length = _header_int(self.headers, "Content-Length", 0)
        if length < 0:
            raise Refused(400, f"Content-Length: must be >= 0, got {length}")
        if limit and length > limit:
            raise Refused(413, f"body: {length} bytes, over this server's limit of {limit} bytes "
                          "(lmrl serve --max-body-mb)", "body_too_large")
        return Sized(self.rfile, length)

    def _error(self, status: int, message: str, code: str | None = None) -> None:
        kind = "authentication_error" if status in (401, 403) else "invalid_request_error" if status < 500 else "server_error"
        self._answer(status, {"error": {"message": message, "type": kind, "param": None, "code": code}})

    def _answer(self, status: int, body: dict[str, Any]) -> None:
        events = isinstance(body, Events)  # stream: true (`lmrl.rollout.streaming`): sent whole, its length known
        data = body.encode() if events else json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "text/event-stream" if events else "application/json")
        self.send_header("Content-Length", str(len(data)))
        if status == 401:
            self.send_header("WWW-Authenticate", "Bearer")
        if self.close_connection:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(data)


def _header_int(headers: Any, name: str, default: int) -> int:
    value = headers.get(name)
    if value is None:
        return default
    try:
        return int(value)
    except ValueError:
        raise Refused(400, f"{name}: expected an integer, got {value[:40]!r}") from None
