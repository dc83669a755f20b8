"""A generator in another process or on another machine: the client of `lmrl serve` (`lmrl.rollout.server`),
what `rollout.backend=vllm-server` trains with.

    generator = ServerGenerator("http://gpu-node:8000", tokenizer)          # a server started elsewhere
    generator = ServerGenerator.start(["model.name_or_path=DIR"], tokenizer)  # or one this process starts and stops
    generator.load_weights(export_weights(policy), version=3)                # streamed, one tensor at a time
    rollout = generator.generate(prompts, n=8, params)                       # the same Rollout as every backend

Every call has a timeout; a server that does not answer, answers an error or dies is one line (`RunError`)
naming its URL. A server this process started is stopped with it, also when the trainer is killed (Linux:
the server asks the kernel for SIGTERM when its parent dies).
"""

from __future__ import annotations

import collections
import contextlib
import http.client
import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterable
from typing import Any
from urllib.parse import urlsplit

import torch

from lmrl.errors import RunError
from lmrl.models.vision import image_to_text
from lmrl.rollout.base import Rollout, SamplingParams
from lmrl.rollout.ops import call_seed, rollout_from_tokens
from lmrl.rollout.wire import frames

READY = "lmrl serve: listening on "  # the line `lmrl serve` prints once it answers


class ServerGenerator:
    """Samples with a generation server (`RemoteGenerator`); see the module docstring.

    Args:
        url: the server, e.g. "http://127.0.0.1:8000".
        tokenizer: the policy's tokenizer: texts are decoded here, as every backend's are.
        timeout: seconds one request may take (a generation, a weight push).
        seed: seeds the per-call seeds drawn when `SamplingParams.seed` is None (`_rng`, saved in checkpoints).
        process: the server's process when this one started it (`start`): `close` stops it.
        api_key: sent with every request as `Authorization: Bearer` (the server's --api-key / LMRL_API_KEY).
        weights_secret: sent with every weight push as `X-Lmrl-Weights-Secret` (the server's --weights-secret).
    """

    def __init__(self, url: str, tokenizer: Any, timeout: float = 600.0, seed: int = 0,
                 process: subprocess.Popen | None = None, api_key: str | None = None,
                 weights_secret: str | None = None):
        self.url, self.tokenizer, self.timeout, self.process = url.rstrip("/"), tokenizer, timeout, process
        self.api_key, self.weights_secret = api_key or None, weights_secret or None
        pad = tokenizer.pad_token_id
        self.pad_token_id = int(pad if pad is not None else (tokenizer.eos_token_id or 0))
        self.max_sequences = 0  # the server's limit on prompts x n of one request (`health`); 0: none
        self.version = -1  # whatever the server holds, it gets the policy's weights before it samples for it
        self._rng = torch.Generator().manual_seed(seed)

    @classmethod
    def start(cls, args: list[str], tokenizer: Any, timeout: float = 600.0, seed: int = 0,
              start_timeout: float = 300.0) -> ServerGenerator:
        """Start `lmrl serve ARGS --port 0` on this machine and wait until it answers. Its API key and weights
        secret are new random ones (`api_key`, `weights_secret`), given by environment, never in its command line:
        other users of the machine can reach its port, not its requests."""
        command = [sys.executable, "-m", "lmrl.cli", "serve", *args, "--host", "127.0.0.1", "--port", "0"]
        api_key, weights_secret = secrets.token_urlsafe(32), secrets.token_urlsafe(32)
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                   env={**os.environ, "LMRL_DIE_WITH_PARENT": str(os.getpid()),
                                        "LMRL_API_KEY": api_key, "LMRL_WEIGHTS_SECRET": weights_secret})
        found: list[str] = []
        errors: collections.deque[str] = collections.deque(maxlen=20)  # its last lines, for the error below
        threading.Thread(target=_keep, args=(process.stderr, errors), daemon=True).start()  # a full pipe would stall it
        ready = threading.Event()  # set by the ready line, or when the server's output ends (it died)
        threading.Thread(target=_find_url, args=(process.stdout, found, ready), daemon=True).start()
        ready.wait(start_timeout)
        if not found:
            process.kill()
            process.wait()
            lines = [line.strip() for line in errors if line.strip()]
            why = lines[-1] if lines else f"no answer in {start_timeout:.0f} s"
            raise RunError(f"rollout.backend: the generation server did not start ({why.removeprefix('lmrl: error: ')})")
        return cls(found[0], tokenizer, timeout=timeout, seed=seed, process=process, api_key=api_key,
                   weights_secret=weights_secret)

    def health(self) -> dict[str, Any]:
        answer = self._json("GET", "/health")
        self.max_sequences = int((answer.get("limits") or {}).get("max_sequences") or 0)
        return answer

    # a vision-language policy's prompts go as the engine takes them (`lmrl.models.vision.ImagePrompt`): the server
    # processes the images (`generate(images=...)`)
    processes_images = True

    def generate(self, prompts: list[list[int]], n: int, params: SamplingParams,
                 images: list[Any] | None = None) -> Rollout:
        """`Generator.generate` on the server, with the weights it was last given. `images`: a vision-language
        policy's prompts as an engine takes them (`lmrl.models.vision.ImagePrompt`, one per prompt), sent with
        each image as base64 PNG; `prompts` are then the policy processor's ids, which the server's must match."""
        params.validate()
        if images is not None and len(images) != len(prompts):
            raise ValueError(f"images: {len(images)} image prompts for {len(prompts)} prompts")
        seed = call_seed(params, self._rng, len(prompts))
        body = {"prompts": [list(map(int, p)) for p in prompts], "n": n,
                "params": {"max_new_tokens": params.max_new_tokens, "temperature": params.temperature,
                           "top_p": params.top_p, "top_k": params.top_k, "stop": list(params.stop), "seed": seed}}
        shown = None if images is None else [{"ids": list(map(int, p.ids)), "images": [image_to_text(v) for v in p.images]}
                                             for p in images]
        out: dict[str, list] = {"tokens": [], "logprobs": [], "finished": []}
        per_request = max(1, self.max_sequences // n) if self.max_sequences else len(prompts)
        for i in range(0, len(prompts), per_request):  # within the server's limit (an eval of every held-out row)
            extra = {} if shown is None else {"images": shown[i:i + per_request]}
            part = self._json("POST", "/lmrl/generate", {**body, "prompts": body["prompts"][i:i + per_request],
                                                         "params": {**body["params"], "seed": seed + i}, **extra})
            for key in out:
                out[key] += part[key]
        return rollout_from_tokens(prompts, n, out["tokens"], out["logprobs"], out["finished"], self.tokenizer,
                                   list(params.stop), self.pad_token_id)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Stream the weights to the server (chunked HTTP, one tensor at a time); returns once it loaded them."""
        parts = urlsplit(self.url)
        connection = http.client.HTTPConnection(parts.hostname, parts.port, timeout=self.timeout)
        try:
            headers = {"X-Lmrl-Version": str(version), "Content-Type": "application/octet-stream", **self._auth()}
            if self.weights_secret:
                headers["X-Lmrl-Weights-Secret"] = self.weights_secret
            # the server may answer before it took the whole stream (a refusal): its answer says why
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                connection.request("POST", "/lmrl/weights", body=frames(weights), encode_chunked=True, headers=headers)
            response = connection.getresponse()
            answer = json.loads(response.read() or b"{}")
        except (OSError, http.client.HTTPException) as e:
            raise RunError(f"rollout.vllm.server_url: the weight sync to {self.url} failed ({_reason(e)})") from e
        finally:
            connection.close()
        if response.status != 200:
            raise RunError(f"rollout.vllm.server_url: {self.url} refused the weights: {_message(answer)}")
        self.version = version

    def close(self) -> None:
        """Stop the server this process started (nothing for one started elsewhere)."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()

    def _auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def _json(self, method: str, path: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, method=method,
                                         headers={"Content-Type": "application/json", **self._auth()})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as e:
            answer = json.loads(e.read() or b"{}")
            raise RunError(f"rollout.vllm.server_url: {self.url}{path} answered {e.code}: {_message(answer)}") from e
        except (OSError, http.client.HTTPException) as e:
            raise RunError(f"rollout.vllm.server_url: no answer from {self.url} ({_reason(e)})") from e


def _find_url(stream, found: list[str], ready: threading.Event) -> None:
    for line in stream:
        if line.startswith(READY):
            found.append(line[len(READY):].strip())
            break
    ready.set()
    _drain(stream)


def _drain(stream) -> None:
    for _ in stream:  # keep the pipe from filling
        pass


def _keep(stream, lines: collections.deque[str]) -> None:
    for line in stream:
        lines.append(line)


def _reason(e: BaseException) -> str:
    reason = getattr(e, "reason", None) or e
    return f"{type(reason).__name__}: {reason}" if str(reason) else type(reason).__name__


def _message(answer: dict[str, Any]) -> str:
    return str((answer.get("error") or {}).get("message", answer))[:500]


def die_with_parent(parent: int | None = None) -> None:
    """In a process a trainer started (a server `ServerGenerator.start` launched, `parent` read from its
    environment; a generator process, `lmrl.async_rollouts`): ask Linux for SIGTERM when the parent dies (a trainer
    killed with SIGKILL leaves nothing behind); elsewhere, a thread watches the parent's pid."""
    parent = parent or os.environ.get("LMRL_DIE_WITH_PARENT")
    if not parent:
        return
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != int(parent):  # the parent died before the request took effect
        os.kill(os.getpid(), signal.SIGTERM)

    def watch() -> None:
        while os.getppid() == int(parent):
            time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, daemon=True).start()
