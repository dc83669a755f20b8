"""Math-answer checking with math-verify, in process or in a separate worker process.

Why a worker process: a model can write an answer such as `\\boxed{9^{9^{9^9}}}` whose comparison
makes sympy compute a gigantic integer inside one C call. That call holds the GIL, so no thread-based
timeout (neither `score(timeout=...)` nor anything else in the trainer process) can interrupt it:
the whole trainer freezes. math-verify's own timeout uses `signal.alarm`, which only works in the
main thread. The worker runs math-verify in *its* main thread with those signal timeouts, and the
trainer kills and restarts it when a sample overruns its deadline (that sample scores 0.0).

This file imports only the standard library (and math-verify inside functions) because it is also
run as a script, `python math_verifier.py`, to be the worker: JSON lines on stdin / stdout.
"""

from __future__ import annotations

import json
import logging
import os
import re
import select
import subprocess
import sys
import threading
import weakref
from typing import Any

logger = logging.getLogger(__name__)

# A final-answer line: "The answer is 42", "Answer: 42", "final answer: $\frac12$".
_ANSWER_LINE = re.compile(r"\banswer\s*(?:is\s*[:=]?|[:=])\s*(.+?)\s*$", re.IGNORECASE)
_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_GSM8K = re.compile(r"####\s*(.+?)\s*$", re.MULTILINE)


def _last_boxed(text: str) -> str | None:
    """Contents of the last \\boxed{...} (or \\fbox{...}), matching nested braces; None if absent."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    i = text.find("{", start)
    if i < 0:
        return None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j]
    return None  # unbalanced: an unfinished answer is no answer


def extract_final_answer(text: str) -> str | None:
    """The final answer of a worked solution, or None when it states none.

    Looks, in order, for the last `\\boxed{...}`, the last GSM8K `#### X` line, the last
    `<answer>X</answer>` block and the last line of the form "The answer is X" / "Answer: X".
    A trailing period is dropped.
    """
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    gsm = _GSM8K.findall(text)
    if gsm:
        return gsm[-1].strip().rstrip(".")
    tags = _ANSWER_TAG.findall(text)
    if tags:
        return tags[-1].strip().rstrip(".")
    for line in reversed(text.strip().splitlines()):
        m = _ANSWER_LINE.search(line)
        if m:
            return m.group(1).strip().rstrip(".")
    return None


def _as_math(answer: str) -> str:
    # math-verify finds LaTeX inside $...$ or \boxed{}; a bare "\frac{1}{2}" is wrapped so it parses.
    return answer if "$" in answer or "\\boxed" in answer else f"${answer}$"


def verify_answer(gold: Any, completion: str, *, require_anchor: bool = True, timeout_seconds: int = 5) -> float | None:
    """1.0 if `completion`'s final answer equals `gold` mathematically, 0.0 if not, None if `gold` is unusable.

    Runs in the calling thread. math-verify's signal-based timeouts are used only in the main thread
    (elsewhere they raise); off the main thread there is no timeout at all.
    """
    from math_verify import parse, verify  # imported lazily: sympy is slow to import

    if gold is None or not str(gold).strip():
        return None
    t = timeout_seconds if threading.current_thread() is threading.main_thread() else None
    gold_text = str(gold)
    # a GSM8K solution ("... #### 72") or a boxed solution: compare with its final answer
    gold_answer = extract_final_answer(gold_text) if "####" in gold_text or "\\boxed" in gold_text else None
    gold_parsed = parse(_as_math((gold_answer or gold_text).strip()), parsing_timeout=t)
    if not gold_parsed:
        return None
    answer = extract_final_answer(completion)
    if answer is None:
        if require_anchor:
            return 0.0
        answer_parsed = parse(completion, parsing_timeout=t)
    else:
        answer_parsed = parse(_as_math(answer), parsing_timeout=t)
    ok = bool(answer_parsed) and verify(gold_parsed, answer_parsed, timeout_seconds=t)
    return 1.0 if ok else 0.0


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()


class MathVerifyWorker:
    """`verify_answer` in a worker process that is killed and restarted when a sample overruns.

    Args:
        timeout_seconds: math-verify's timeout per parse / verify inside the worker; the trainer-side
            deadline for one sample is 3 * timeout_seconds + 2 (two parses and a verify, plus slack).
        startup_timeout: seconds allowed for the worker to start (it imports sympy).
    """

    def __init__(self, timeout_seconds: int = 5, startup_timeout: float = 120.0) -> None:
        if timeout_seconds < 1:
            raise ValueError(f"timeout_seconds: must be an integer >= 1, got {timeout_seconds}")
        self.timeout_seconds = int(timeout_seconds)
        self.deadline = 3 * self.timeout_seconds + 2.0
        self.startup_timeout = startup_timeout
        self.restarts = 0  # how many times a stuck or dead worker was replaced
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()  # one request in flight at a time

    def _start(self) -> subprocess.Popen:
        # run this file as a script: it imports no lmrl (and so no torch), only math-verify
        proc = subprocess.Popen(
            [sys.executable, "-u", os.path.abspath(__file__)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
        )
        weakref.finalize(self, _stop, proc)
        line = self._readline(proc, self.startup_timeout)
        if line is None or json.loads(line).get("ready") is not True:
            _stop(proc)
            raise RuntimeError(f"math-verify worker failed to start (got {line!r}); is math-verify installed?")
        return proc

    @staticmethod
    def _readline(proc: subprocess.Popen, timeout: float) -> str | None:
        ready, _, _ = select.select([proc.stdout], [], [], timeout)  # waits without holding the GIL
        if not ready:
            return None
        line = proc.stdout.readline()
        return line or None  # "" = the worker died

    def close(self) -> None:
        """Stop the worker process (it restarts on the next call)."""
        with self._lock:
            if self._proc is not None:
                _stop(self._proc)
                self._proc = None

    def __call__(self, gold: Any, completion: str, *, require_anchor: bool = True) -> float | None:
        request = json.dumps(
            {"gold": None if gold is None else str(gold), "completion": completion,
             "require_anchor": require_anchor, "timeout": self.timeout_seconds}
        )
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self._proc = self._start()
            try:
                self._proc.stdin.write(request + "\n")
                self._proc.stdin.flush()
                line = self._readline(self._proc, self.deadline)
            except (BrokenPipeError, OSError):
                line = None
            if line is None:  # overran its deadline or died: this answer earns nothing
                logger.warning("math-verify worker stuck or dead on an answer; restarting it and scoring 0.0")
                _stop(self._proc)
                self._proc = None
                self.restarts += 1
                return 0.0
        reward = json.loads(line)["reward"]
        return None if reward is None else float(reward)


def _serve() -> None:
    """Worker loop: one JSON request per stdin line, one {"reward": ...} per stdout line."""
    logging.basicConfig(level=logging.ERROR)
    try:
        import math_verify  # noqa: F401 - import now so that the first request is fast
    except ImportError as e:
        print(json.dumps({"ready": False, "error": str(e)}), flush=True)
        return
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        try:
            reward = verify_answer(
                req["gold"], req["completion"], require_anchor=req["require_anchor"], timeout_seconds=req["timeout"]
            )
        except Exception:  # noqa: BLE001 - an answer that breaks the parser is a wrong answer
            reward = 0.0
        print(json.dumps({"reward": reward}), flush=True)


if __name__ == "__main__":
    _serve()
