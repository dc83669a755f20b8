"""An LLM as the reward: each completion put into a template and sent to a judge model behind any
OpenAI-compatible endpoint (`lmrl serve`, vLLM, a hosted API), its answer read as a score.

    reward:
      functions:
        - fn: judge
          url: http://127.0.0.1:8000/v1        # the API's base; /chat/completions or /completions is added
          model: judge-model
          template: "Question: {prompt}\\nAnswer: {completion}\\nReference: {answer}\\nRate 0-10. Score:"
          api_key_env: OPENAI_API_KEY           # the variable's name; the key never goes in a config

Two readers of the answer:

- `regex` (default): the last match of `pattern` (default: the number after "Score:") in the answer's
  text, a number on the judge's `scale` (default [0, 10]) mapped to [0, 1];
- `yes_no`: P(yes) / (P(yes) + P(no)) over the first generated token, from the endpoint's log-probs of that
  token and of its `top_logprobs` alternatives (the tokens, stripped and lower-cased, that are in `yes` or
  `no`). An endpoint that gives only the sampled token's log-prob gives 1 or 0 (`lmrl serve` gives alternatives).

An answer with no score in it, a score outside the scale, a first token neither yes nor no, is that
completion's `Failed` (`lmrl.rewards.core`): `reward.on_error` decides, never a silent 0. An endpoint that
cannot be reached, times out, or answers 4xx or something that is not an OpenAI completion fails the
whole call with one line naming the URL (`JudgeError`), as the remote scorer does: connection errors,
timeouts, 429 and 5xx are first retried with exponential backoff. Requests run `concurrency` at a time;
the same request (endpoint, model, messages or prompt, every sampling parameter) is sent once per
scorer, its answer cached, so that a completion seen again (a repeated sample, a re-scored batch) costs
nothing. The judge's text goes into the sample table (samples.jsonl) as the column `<name>/text`.
"""

from __future__ import annotations

import asyncio
import collections
import json
import math
import os
import re
import string
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import httpx

from lmrl.errors import ConfigError, RewardError
from lmrl.rewards.core import Failed, completion_text, is_chat
from lmrl.rewards.remote import post_retried

DEFAULT_PATTERN = r"(?i)score\s*[:=]\s*\**\s*([-+]?\d+(?:\.\d+)?)"
"""The number after "Score:" (any case, markdown bold allowed), the default regex reader."""

APIS = {"chat": "/chat/completions", "completions": "/completions"}
READERS = ("regex", "yes_no")


class JudgeError(RewardError):
    """The judge endpoint could not be reached or gave an answer that is not a completion (one line naming it)."""


def _prompt_text(prompt: Any) -> str:
    """A prompt as the template's {prompt}: the text, or a chat prompt's messages one per line."""
    if is_chat(prompt):
        return "\n".join(f"{m.get('role', '')}: {m.get('content', '')}" for m in prompt)
    return str(prompt)


class JudgeScorer:
    """Async reward function: one judge request per completion (at most `concurrency` at once), its answer
    read as a score in [0, 1] (regex) or a probability (yes_no).

    Args:
        url: the API's base URL, e.g. "http://127.0.0.1:8000/v1".
        model: the judge model's name, sent as the request's `model`.
        template: the judge's prompt; `{prompt}`, `{completion}` and `{<column>}` (any dataset column, e.g.
            `{answer}`) are filled in; write a literal brace as `{{` or `}}`.
        api: "chat" (the template is the user message, after `system` if given) or "completions".
        reader: "regex" or "yes_no" (see the module docstring).
        pattern: the regex reader's pattern; its first group (or the whole match) is the score.
        scale: [low, high], the judge's score range; a score maps to (score - low) / (high - low).
        yes, no: the yes_no reader's answer tokens, compared stripped and lower-cased.
        top_logprobs: alternatives of the first token asked for by the yes_no reader.
        system: a system message (chat only).
        max_tokens: the judge's answer length (default 512 for regex, 1 for yes_no).
        temperature: the judge's sampling temperature (0: greedy, the same answer for the same request).
        params: further request fields sent as given (e.g. {"seed": 0, "top_p": 0.9}).
        concurrency: requests in flight at once.
        timeout: seconds for one request (connect, read, write); keep (max_retries + 1) * timeout, plus
            backoff, under `reward.timeout`.
        max_retries: retries after the first attempt, on connection errors, timeouts, 429 and 5xx.
        backoff: delay before the first retry; doubles with each retry, at most `max_backoff`.
        api_key_env: the name of an environment variable holding the API key, sent as
            `Authorization: Bearer <key>`; checked when the scorer is built.
        cache_size: answers kept, keyed by the full request (0: no cache).
        name: the metric name (`reward/<name>/...`) and the sample table's column `<name>/text`.
    """

    learned = True  # `lmrl.rewards.core.is_learned`: evaluation verifies beside it

    def __init__(
        self, url: str, model: str, template: str, *, api: str = "chat", reader: str = "regex",
        pattern: str = DEFAULT_PATTERN, scale: Sequence[float] = (0, 10), yes: Sequence[str] = ("yes",),
        no: Sequence[str] = ("no",), top_logprobs: int = 20, system: str | None = None,
        max_tokens: int | None = None, temperature: float = 0.0, params: Mapping[str, Any] | None = None,
        concurrency: int = 8, timeout: float = 30.0, max_retries: int = 3, backoff: float = 0.5,
        max_backoff: float = 8.0, api_key_env: str | None = None, cache_size: int = 100_000, name: str = "judge",
        **unknown: Any,
    ) -> None:
        if "api_key" in unknown:
            raise ConfigError("api_key: a saved config must not hold a secret; put the key in an environment "
                              "variable and name it in api_key_env")
        if unknown:
            raise ValueError(f"unknown option(s) {sorted(unknown)}")
        if not isinstance(url, str) or not url.startswith(("http://", "https://")):
            raise ValueError(f"url: expected an http:// or https:// URL, got {url!r:.80}")
        if url.rstrip("/").endswith("/completions"):
            raise ValueError(f"url: give the API's base (e.g. http://host:port/v1), not an endpoint: {url!r:.80}")
        if api not in APIS:
            raise ValueError(f"api: expected 'chat' or 'completions', got {api!r:.40}")
        if reader not in READERS:
            raise ValueError(f"reader: expected 'regex' or 'yes_no', got {reader!r:.40}")
        if not isinstance(model, str) or not model:
            raise ValueError(f"model: expected the judge model's name, got {model!r:.40}")
        self.fields = _template_fields(template)
        try:
            self.pattern = re.compile(pattern)
        except (re.error, TypeError) as e:
            raise ValueError(f"pattern: {pattern!r:.60} is not a regular expression ({e})") from None
        if (not isinstance(scale, Sequence) or len(scale) != 2
                or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in scale)
                or not scale[0] < scale[1]):
            raise ValueError(f"scale: expected [low, high], two finite numbers with low < high, got {scale!r:.60}")
        for key, value, least in (("concurrency", concurrency, 1), ("max_retries", max_retries, 0),
                                  ("top_logprobs", top_logprobs, 1), ("cache_size", cache_size, 0),
                                  ("max_tokens", 1 if max_tokens is None else max_tokens, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{key}: must be a whole number >= {least}, got {value!r:.40}")
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not 0 <= temperature < math.inf:
            raise ValueError(f"temperature: must be a number >= 0, got {temperature!r:.40}")
        if not (isinstance(timeout, (int, float)) and timeout > 0):
            raise ValueError(f"timeout: must be > 0 seconds, got {timeout!r}")
        if not (backoff >= 0 and max_backoff >= 0):
            raise ValueError(f"backoff: delays must be >= 0, got backoff={backoff}, max_backoff={max_backoff}")
        self.headers = {"Content-Type": "application/json"}
        if api_key_env is not None:
            key = os.environ.get(str(api_key_env))
            if not key:
                raise ConfigError(f"api_key_env: the environment variable {api_key_env!r} (the judge's API key) "
                                  "is not set")
            self.headers["Authorization"] = f"Bearer {key}"
        self.url, self.model, self.template, self.api, self.reader = url.rstrip("/"), model, template, api, reader
        self.endpoint = self.url + APIS[api]
        self.scale = (float(scale[0]), float(scale[1]))
        self.yes = {str(t).strip().lower() for t in yes}
        self.no = {str(t).strip().lower() for t in no}
        if not self.yes or not self.no or self.yes & self.no:
            raise ValueError(f"yes, no: expected two non-empty, disjoint lists of tokens, got {list(yes)}, {list(no)}")
        self.system, self.temperature, self.top_logprobs = system, float(temperature), top_logprobs
        self.max_tokens = max_tokens if max_tokens is not None else (1 if reader == "yes_no" else 512)
        self.params = dict(params or {})
        self.concurrency, self.timeout, self.max_retries = concurrency, float(timeout), max_retries
        self.backoff, self.max_backoff, self.cache_size, self.name = backoff, max_backoff, cache_size, name
        self.columns = [f for f in self.fields if f not in ("prompt", "completion")]  # checked on every row
        self.cache: collections.OrderedDict[str, tuple[str, float | Failed]] = collections.OrderedDict()

    # --- one request per completion
    def request(self, prompt: Any, completion: Any, row: Mapping[str, Any]) -> dict[str, Any]:
        """The JSON body sent for one completion."""
        values = {k: row[k] for k in self.columns}
        text = self.template.format(**values, prompt=_prompt_text(prompt), completion=completion_text(completion))
        body: dict[str, Any] = {**self.params, "model": self.model, "max_tokens": self.max_tokens,
                                "temperature": self.temperature}
        if self.api == "chat":
            system = [{"role": "system", "content": self.system}] if self.system else []
            body["messages"] = [*system, {"role": "user", "content": text}]
            if self.reader == "yes_no":
                body |= {"logprobs": True, "top_logprobs": self.top_logprobs}
        else:
            body["prompt"] = text
            if self.reader == "yes_no":
                body["logprobs"] = self.top_logprobs
        return body

    def read(self, answer: Mapping[str, Any]) -> tuple[str, float | Failed]:
        """An endpoint's answer -> (the judge's text, its score or why it has none)."""
        choices = answer.get("choices") if isinstance(answer, Mapping) else None
        if not isinstance(choices, list) or not choices or not isinstance(choices[0], Mapping):
            raise JudgeError(f"judge {self.endpoint}: expected an OpenAI completion "
                             f"({{\"choices\": [...]}}), got {' '.join(str(answer).split())[:100]}")
        choice = choices[0]
        if self.api == "chat":
            text = (choice.get("message") or {}).get("content") or ""
        else:
            text = choice.get("text") or ""
        text = str(text)
        return text, (self._regex(text) if self.reader == "regex" else self._yes_no(choice))

    def _regex(self, text: str) -> float | Failed:
        matches = list(self.pattern.finditer(text))
        if not matches:
            wanted = "no number after 'Score:'" if self.pattern.pattern == DEFAULT_PATTERN else \
                f"no match of pattern {self.pattern.pattern!r}"
            return Failed(f"the judge's answer holds no score ({wanted}): {text[:80]!r}")
        found = matches[-1].group(1) if self.pattern.groups else matches[-1].group(0)
        try:
            x = float(found)
        except (TypeError, ValueError):
            return Failed(f"the judge's score {found!r:.40} is not a number")
        low, high = self.scale
        if not math.isfinite(x) or not low <= x <= high:
            return Failed(f"the judge's score {found!r:.40} is outside its scale [{low:g}, {high:g}]")
        return (x - low) / (high - low)

    def _yes_no(self, choice: Mapping[str, Any]) -> float | Failed:
        candidates = _first_token_logprobs(choice.get("logprobs"), chat=self.api == "chat")
        if candidates is None:
            return Failed("the judge's answer has no log-probs of its first token (does the endpoint return logprobs?)")
        p_yes = p_no = 0.0
        for token, logprob in candidates.items():
            word = str(token).strip().lower()
            if word not in self.yes and word not in self.no:
                continue
            if isinstance(logprob, bool) or not isinstance(logprob, (int, float)) or math.isnan(logprob) or logprob > 1e-6:
                return Failed(f"the judge's log-prob of {token!r:.20} is not a log-probability: {logprob!r:.40}")
            if word in self.yes:
                p_yes += math.exp(logprob)
            else:
                p_no += math.exp(logprob)
        if p_yes + p_no == 0.0:
            return Failed(f"the judge's first token is neither yes nor no: {list(candidates)[:5]!r:.100}")
        return p_yes / (p_yes + p_no)

    # --- the batch
    async def __call__(self, prompts: list[Any], completions: list[Any], log_metric: Callable[..., Any] | None = None,
                       log_extra: Callable[..., Any] | None = None, **columns: Any) -> list[float | Failed]:
        bodies = [self.request(p, c, {k: columns[k][i] for k in self.columns})
                  for i, (p, c) in enumerate(zip(prompts, completions))]
        stats = {"requests": 0, "retries": 0, "cache_hits": 0, "tokens": 0}
        semaphore = asyncio.Semaphore(self.concurrency)
        pending: dict[str, asyncio.Task] = {}  # a request asked twice in one batch is sent once
        t0 = time.perf_counter()
        async with httpx.AsyncClient(timeout=self.timeout) as client:
            async def judge(body: dict[str, Any]) -> tuple[str, float | Failed]:
                key = json.dumps([self.endpoint, body], sort_keys=True, default=str)
                if key in self.cache:
                    stats["cache_hits"] += 1
                    self.cache.move_to_end(key)
                    return self.cache[key]
                if key in pending:
                    stats["cache_hits"] += 1
                    return await asyncio.shield(pending[key])
                pending[key] = asyncio.ensure_future(self._ask(client, semaphore, body, stats))
                verdict = await pending[key]
                if self.cache_size > 0:
                    self.cache[key] = verdict
                    while len(self.cache) > self.cache_size:
                        self.cache.popitem(last=False)
                return verdict

            tasks = [asyncio.ensure_future(judge(b)) for b in bodies]
            try:
                verdicts = await asyncio.gather(*tasks)
            except BaseException:  # one request failed for good (or the call timed out): the others stop too
                for task in [*tasks, *pending.values()]:
                    task.cancel()
                raise
        if log_metric is not None:
            for key, value in stats.items():
                log_metric(f"reward/{self.name}/{key}", float(value))
            log_metric(f"reward/{self.name}/request_seconds", time.perf_counter() - t0)
        if log_extra is not None:
            log_extra(f"{self.name}/text", [text for text, _ in verdicts])
        return [value for _, value in verdicts]

    async def _ask(self, client: httpx.AsyncClient, semaphore: asyncio.Semaphore, body: dict[str, Any],
                   stats: dict[str, int]) -> tuple[str, float | Failed]:
        """One request, retried on connection errors, timeouts, 429 and 5xx; its answer read."""
        async with semaphore:
            response, attempts, last = await post_retried(
                client, self.endpoint, max_retries=self.max_retries, backoff=self.backoff,
                max_backoff=self.max_backoff, timeout=self.timeout, json=body, headers=self.headers)
        stats["requests"] += attempts
        stats["retries"] += attempts - 1
        if response is None:
            raise self._fail(attempts, last)
        try:
            answer = response.json()
        except ValueError:
            raise self._fail(attempts, f"the answer is not JSON: {response.text[:100]!r}") from None
        usage = answer.get("usage") if isinstance(answer, Mapping) else None
        if isinstance(usage, Mapping) and isinstance(usage.get("total_tokens"), int):
            stats["tokens"] += usage["total_tokens"]
        return self.read(answer)

    def _fail(self, attempts: int, problem: str) -> JudgeError:
        problem = " ".join(problem.split())[:300]
        return JudgeError(f"judge {self.endpoint} failed after {attempts} attempt(s): {problem}")


def _template_fields(template: Any) -> list[str]:
    """The names a template fills in; it must show the judge the completion."""
    if not isinstance(template, str) or not template.strip():
        raise ValueError(f"template: expected the judge's prompt, a non-empty string, got {template!r:.40}")
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as e:
        raise ValueError(f"template: {e} (write a literal brace as {{{{ or }}}})") from None
    fields = []
    for _, field, spec, conversion in parsed:
        if field is None:
            continue
        if not field.isidentifier() or spec or conversion:
            raise ValueError(f"template: {{{field}{'!' + conversion if conversion else ''}{':' + spec if spec else ''}}}"
                             " is not a field; use {prompt}, {completion} or {<column>} (a literal brace: {{ or }})")
        fields.append(field)
    if "completion" not in fields:
        raise ValueError("template: has no {completion}, so the judge would not see what it judges")
    return list(dict.fromkeys(fields))


def _first_token_logprobs(logprobs: Any, chat: bool) -> dict[str, Any] | None:
    """token -> log-prob for the first generated token and the alternatives the endpoint gave for it (OpenAI's
    chat form `{"content": [{"token", "logprob", "top_logprobs": [{"token", "logprob"}]}]}` or its completions
    form `{"tokens": [...], "token_logprobs": [...], "top_logprobs": [{token: logprob}]}`); None without them."""
    if not isinstance(logprobs, Mapping):
        return None
    out: dict[str, Any] = {}
    if chat:
        content = logprobs.get("content")
        if not isinstance(content, list) or not content or not isinstance(content[0], Mapping):
            return None
        first = content[0]
        for alt in first.get("top_logprobs") or []:
            if isinstance(alt, Mapping) and "token" in alt:
                out[str(alt["token"])] = alt.get("logprob")
        if "token" in first:
            out.setdefault(str(first["token"]), first.get("logprob"))
        return out or None
    tokens, values, top = logprobs.get("tokens"), logprobs.get("token_logprobs"), logprobs.get("top_logprobs")
    if isinstance(top, list) and top and isinstance(top[0], Mapping):
        out |= {str(t): lp for t, lp in top[0].items()}
    if isinstance(tokens, list) and tokens and isinstance(values, list) and values:
        out.setdefault(str(tokens[0]), values[0])
    return out or None
