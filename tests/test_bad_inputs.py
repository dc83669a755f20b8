"""Bad inputs, as a careful user meets them: each row of BAD is `lmrl ...` given one bad input. Every one
must end with the exit code in the row (2: refused before training, 1: a fault mid-run), a stderr of one
`lmrl: error:` line (after any `lmrl: warning:` lines) holding the row's text, which names the key, file
and line, dataset row or reward function, and the value given; no traceback; and nothing written or lost:
a run refused before training leaves no output directory, one stopped mid-run no non-finite weight on disk.

The table doubles as documentation: docs/bad-inputs.md lists the same classes with the lines they get.
Rows run as real processes, two at a time (this machine has two cores). Config and command-line rows
never import torch (about 0.5 s each); a data, model or reward row loads torch and the shipped model
(about 7 s), so only a few of those run as processes (`real=True`: one per kind of failure, and every
exit from a reward) and the rest call `lmrl.cli.main` in this process, which checks the same line and code.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import shlex
import shutil
import subprocess
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from unittest import mock

import pytest
import torch
from safetensors.torch import load_file, save_file

from lmrl.cli import main
from lmrl.config import load_config
from lmrl.errors import ConfigError, DataError, ModelError, RewardError
from lmrl.experience import compute_advantages
from lmrl.models.shipped import SHIPPED_MODEL
from lmrl.rewards import score
from tests.forked import lmrl

ROOT = Path(__file__).resolve().parents[1]
# a step of the shipped model that takes a second: 2 prompts x 2 completions, no evaluation
QUICK = "train.steps=2 rollout.prompts_per_step=2 rollout.group_size=2 data.num_eval_prompts=0"
ROWS = "data.path=rows.jsonl reward.functions=[exact_match]"  # a good dataset (RowFiles below)


@dataclass(frozen=True)
class Bad:
    args: str  # what follows `lmrl` (train cases also get train.output_dir=out/<case> log.console=false)
    line: str  # text the one stderr line holds, after `lmrl: error: ` ({url} is the test's scorer)
    code: int = 2
    saves: bool = False  # True: a mid-run fault; what it saved (if anything) must be finite
    real: bool = True  # False: through lmrl.cli.main in the test's process (rows that load torch and a model)


BAD: dict[str, Bad] = {
    # --- config values: checked on load, before torch is imported; the full key and the value given
    "steps negative": Bad("train train.steps=-3", "train.steps: must be >= 1 (got -3)"),
    "steps zero": Bad("train train.steps=0", "train.steps: must be >= 1 (got 0)"),
    "steps fraction": Bad("train train.steps=2.5", "train.steps: must be a whole number (got 2.5)"),
    "steps bool": Bad("train train.steps=true", "train.steps: expected a number, got True"),
    "steps text": Bad("train train.steps=abc", "train.steps: must be a whole number (got 'abc')"),
    "seed negative": Bad("train train.seed=-1", "train.seed: must be >= 0 (got -1)"),
    "seed too large": Bad("train train.seed=4294967296", "train.seed: must be <= 4294967295 (got 4294967296)"),
    "eval_every negative": Bad("train train.eval_every=-1", "train.eval_every: must be >= 0 (got -1)"),
    "save_every negative": Bad("train train.save_every=-1", "train.save_every: must be >= 0 (got -1)"),
    "keep_last zero": Bad("train train.keep_last=0", "train.keep_last: must be >= 1 (got 0)"),
    "max_minutes zero": Bad("train train.max_minutes=0", "train.max_minutes: must be > 0 (got 0)"),
    "threads negative": Bad("train train.threads=-1", "train.threads: must be >= 1 (got -1)"),
    "logprob chunk zero": Bad("train train.logprob_chunk_size=0", "train.logprob_chunk_size: must be >= 1 (got 0)"),
    "output_dir empty": Bad("train train.output_dir=", "train.output_dir: must be set (got null or an empty value)"),
    "resume missing": Bad("train train.resume=no/such/checkpoint", "train.resume: no/such/checkpoint does not exist"),
    "eval prompts negative": Bad("train data.num_eval_prompts=-1", "data.num_eval_prompts: must be >= 0 (got -1)"),
    "on_bad_row unknown": Bad("train data.on_bad_row=drop", "data.on_bad_row: got 'drop'; input should be 'fail' or 'skip'"),
    "no data": Bad("train data.task=null", "data: set data.task (a built-in task) or data.path (a prompt dataset)"),
    "prompts_per_step zero": Bad("train rollout.prompts_per_step=0", "rollout.prompts_per_step: must be >= 1 (got 0)"),
    "group_size zero": Bad("train rollout.group_size=0", "rollout.group_size: must be >= 1 (got 0)"),
    "group_size 1 for grpo": Bad("train rollout.group_size=1", "rollout.group_size: must be >= 2 for the grpo advantage (got 1)"),
    "max_new_tokens zero": Bad("train rollout.max_new_tokens=0", "rollout.max_new_tokens: must be >= 1 (got 0)"),
    "max_prompt_length negative": Bad("train rollout.max_prompt_length=-1", "rollout.max_prompt_length: must be >= 1 (got -1)"),
    "temperature zero": Bad("train rollout.temperature=0", "rollout.temperature: must be > 0 (got 0)"),
    "temperature negative": Bad("train rollout.temperature=-1", "rollout.temperature: must be > 0 (got -1)"),
    "top_p zero": Bad("train rollout.top_p=0", "rollout.top_p: must be > 0 (got 0)"),
    "top_p above 1": Bad("train rollout.top_p=1.5", "rollout.top_p: must be <= 1 (got 1.5)"),
    "top_k negative": Bad("train rollout.top_k=-1", "rollout.top_k: must be >= 0 (got -1)"),
    "batch_size zero": Bad("train rollout.batch_size=0", "rollout.batch_size: must be >= 1 (got 0)"),
    "stop empty": Bad("train rollout.stop=\"['']\"", "rollout.stop[0]: must not be empty"),
    "reward timeout zero": Bad("train reward.timeout=0", "reward.timeout: must be > 0 (got 0)"),
    "reward weights count": Bad("train reward.functions=[math] reward.weights=[1,2]",
                                "reward.weights: 2 weights for 1 reward.functions; give one weight per function"),
    "reward weight inf": Bad("train reward.weights=[.inf]", "reward.weights[0]: must be a finite number (got inf)"),
    "overlong_buffer zero": Bad("train reward.overlong_buffer=0", "reward.overlong_buffer: must be >= 1 (got 0)"),
    "reward clip zero": Bad("train reward.clip=0", "reward.clip: must be > 0 (got 0)"),
    "reward clip range reversed": Bad("train 'reward.clip=[1, -1]'", "reward.clip: [low, high] needs low < high (got [1.0, -1.0])"),
    "recipes and functions": Bad("train reward.functions=[math] 'reward.recipes={math: [math]}'",
                                 "reward.recipes: set reward.functions (every row) or reward.recipes (a recipe per data_source), not both"),
    "recipe empty": Bad("train 'reward.recipes={math: []}'", "reward.recipes: recipe 'math' has no reward functions"),
    "on_error unknown": Bad("train reward.on_error=ignore", "reward.on_error: got 'ignore'; input should be 'fail' or 'zero'"),
    "eos penalty inf": Bad("train reward.missing_eos_penalty=inf", "reward.missing_eos_penalty: must be a finite number (got 'inf')"),
    "algorithm unknown": Bad("train algorithm=foo", "algorithm.name: unknown algorithm 'foo'; choose one of grpo,"),
    "clip_low above 1": Bad("train algorithm.clip_low=2", "algorithm.clip_low: must be <= 1 (got 2)"),
    "clip_high negative": Bad("train algorithm.clip_high=-0.1", "algorithm.clip_high: must be >= 0 (got -0.1)"),
    "dual_clip 1": Bad("train algorithm.dual_clip=1", "algorithm.dual_clip: must be > 1 (got 1)"),
    "kl_coef negative": Bad("train algorithm.kl_coef=-0.1", "algorithm.kl_coef: must be >= 0 (got -0.1)"),
    "kl_target without coef": Bad("train algorithm.kl_target=0.1", "algorithm.kl_coef: must be > 0 with kl_target"),
    "gamma above 1": Bad("train algorithm.gamma=1.5", "algorithm.gamma: must be <= 1 (got 1.5)"),
    "lam negative": Bad("train algorithm.lam=-0.1", "algorithm.lam: must be >= 0 (got -0.1)"),
    "iterations zero": Bad("train algorithm.num_iterations=0", "algorithm.num_iterations: must be >= 1 (got 0)"),
    "minibatches not dividing": Bad("train algorithm.num_minibatches=3",
                                    "algorithm.num_minibatches: 3 must divide the batch of 256 sequences"),
    "entropy fraction zero": Bad("train algorithm.entropy_top_fraction=0", "algorithm.entropy_top_fraction: must be > 0 (got 0)"),
    "tis_cap zero": Bad("train algorithm.tis_cap=0", "algorithm.tis_cap: must be > 0 (got 0)"),
    "value_clip negative": Bad("train algorithm.value_clip=-1", "algorithm.value_clip: must be > 0 (got -1)"),
    "sampling rounds zero": Bad("train algorithm.max_sampling_rounds=0", "algorithm.max_sampling_rounds: must be >= 1 (got 0)"),
    "lr zero": Bad("train optim.lr=0", "optim.lr: must be > 0 (got 0)"),
    "lr negative": Bad("train optim.lr=-1e-5", "optim.lr: must be > 0 (got -1e-05)"),
    "lr nan": Bad("train optim.lr=nan", "optim.lr: must be a finite number (got 'nan')"),
    "betas above 1": Bad("train optim.betas=[1.5,0.9]", "optim.betas[0]: must be < 1 (got 1.5)"),
    "betas one value": Bad("train optim.betas=[0.9]", "optim.betas: too few values (got [0.9])"),
    "weight decay negative": Bad("train optim.weight_decay=-0.1", "optim.weight_decay: must be >= 0 (got -0.1)"),
    "warmup negative": Bad("train optim.warmup_steps=-1", "optim.warmup_steps: must be >= 0 (got -1)"),
    "max_grad_norm zero": Bad("train optim.max_grad_norm=0",
                              "optim.max_grad_norm: must be > 0, or null for no clipping (got 0.0; 0.0 would clip"),
    "micro batch zero": Bad("train optim.micro_batch_size=0", "optim.micro_batch_size: must be >= 1 (got 0)"),
    "device unknown": Bad("train model.device=gpu", "model.device: must be auto, cpu, cuda or cuda:N (got 'gpu')"),
    "dtype unknown": Bad("train model.dtype=float8", "model.dtype: got 'float8'; input should be 'auto', 'float32'"),
    "lora rank zero": Bad("train model.lora.r=0", "model.lora.r: must be >= 1 (got 0)"),
    "lora dropout 1": Bad("train model.lora.dropout=1", "model.lora.dropout: must be < 1 (got 1)"),
    "log every zero": Bad("train log.every=0", "log.every: must be >= 1 (got 0)"),
    "samples_every negative": Bad("train log.samples_every=-1", "log.samples_every: must be >= 0 (got -1)"),
    "guard zero": Bad("train guard.max_skipped_steps=0", "guard.max_skipped_steps: must be >= 1 (got 0)"),
    "collapse_drop zero": Bad("train guard.collapse_drop=0", "guard.collapse_drop: must be > 0 (got 0)"),
    "section typo": Bad("train trian.steps=3", "trian: config has no field 'trian'; did you mean 'train'?"),
    "env tools missing": Bad("train env.name=tools",
                             'env.tools: the "tools" environment needs at least one tool, e.g. env.tools=[python]'),
    "env pattern invalid": Bad("train env.name=tools env.tools=[python] env.tool_call_pattern=(",
                               "env.tool_call_pattern: not a valid regex (missing ), unterminated subpattern at position 0)"),
    "env pattern groups": Bad("train env.name=tools env.tools=[python] env.tool_call_pattern=call",
                              "env.tool_call_pattern: needs a group named json, or a group named name (and arguments, or one group per argument)"),
    "env spec missing": Bad("train env.name=nope.py:Env", "env.name: environment 'nope.py:Env': file 'nope.py' not found",
                            real=False),
    "env tool missing": Bad("train env.name=tools env.tools=[nope.py:f]",
                            "env.tools[0]: tool spec 'nope.py:f': file 'nope.py' not found", real=False),
    "verifiers module missing": Bad("train env.name=verifiers:no_such_vf_env",
                                    "env.name: verifiers environment 'verifiers:no_such_vf_env': cannot import module "
                                    "'no_such_vf_env': ModuleNotFoundError: No module named 'no_such_vf_env'", real=False),
    "agent serve beyond loopback": Bad("train env.name=agent env.agent_mode=serve env.agent_host=0.0.0.0",
                                       "env.agent_host: 0.0.0.0: listening beyond loopback needs a run key of yours, in "
                                       "the LMRL_AGENT_KEY environment variable; or listen on 127.0.0.1", real=False),
    "agent serve with a command": Bad("train env.name=agent env.agent_mode=serve env.command=x",
                                      "env.command: env.agent_mode=serve starts no program (yours ask for work); drop "
                                      "env.command"),
    "sandbox timeout zero": Bad("train sandbox.timeout=0", "sandbox.timeout: must be > 0 (got 0)"),
    "override not YAML": Bad("train 'reward.functions=[{fn:'", "override reward.functions: value '[{fn:' is not valid YAML"),
    "field typo": Bad("train algorithm.clip_hgh=0.3", "algorithm.clip_hgh: algorithm has no field 'clip_hgh'; did you mean 'clip_high'?"),
    # --- the command line and config files
    "forgotten = first": Bad("train train.steps 2", "config file 'train.steps' does not exist; to set a field write train.steps=VALUE"),
    "forgotten = later": Bad("train train.steps=2 algorithm dapo", "override 'algorithm': expected key=value, e.g. train.steps=50; write algorithm=VALUE"),
    "config missing": Bad("train nope.yaml", "config file 'nope.yaml' does not exist"),
    "config is a directory": Bad("train data", "config file 'data' is a directory, expected a YAML file"),
    "config invalid YAML": Bad("train invalid.yaml", "config file 'invalid.yaml' is not valid YAML (line 2): expected ',' or ']'"),
    "config section twice": Bad("train twice.yaml", "config file 'twice.yaml' line 4: key 'train' appears twice (first on line 1)"),
    "config key twice": Bad("train key_twice.yaml", "config file 'key_twice.yaml' line 3: key 'steps' appears twice (first on line 2)"),
    "config a list": Bad("train list.yaml", "config file 'list.yaml' must hold a mapping of sections, not a list"),
    "config unknown field": Bad("train unknown.yaml", "rollout.group: rollout has no field 'group'; did you mean 'group_size'?"),
    "unknown option": Bad("train --bogus", "unrecognized arguments: --bogus"),
    "unknown command": Bad("bogus", "argument command: invalid choice: 'bogus'"),
    "eval k zero": Bad("eval --k 0", "argument --k: must be >= 1 (got 0)"),
    "eval --num-prompts negative": Bad("eval --num-prompts -5", "argument --num-prompts: must be >= 1 (got -5)"),
    "eval tokens zero": Bad("eval --max-new-tokens 0", "argument --max-new-tokens: must be >= 1 (got 0)"),
    "eval temperature zero": Bad("eval --temperature 0", "argument --temperature: must be a finite number > 0 (got 0)"),
    # --- data: every row checked before the model loads; file and line (or index), and the other bad rows
    "data file missing": Bad(f"train {ROWS} data.path=none.jsonl", "data.path: none.jsonl: file not found", real=False),
    "data is a directory": Bad(f"train {ROWS} data.path=data", "data.path: data: is a directory, expected a .jsonl/.json/.parquet file or a dataset saved with datasets' save_to_disk", real=False),
    "data extension": Bad(f"train {ROWS} data.path=rows.csv", "data.path: rows.csv: unsupported extension '.csv'", real=False),
    "data invalid JSON": Bad(f"train {ROWS} data.path=broken.jsonl", "data.path: broken.jsonl line 3: not valid JSON", real=False),
    "data empty": Bad(f"train {ROWS} data.path=empty.jsonl", "data.path: empty.jsonl has no rows", real=False),
    "prompt blank": Bad(f"train {ROWS} data.path=blank.jsonl", "data.path: blank.jsonl line 5: prompt is only whitespace; fix it, or set data.on_bad_row=skip", real=False),
    "prompt too long at row 600": Bad(f"train {ROWS} data.path=long.jsonl rollout.max_prompt_length=32",
                                      "data.path: long.jsonl line 600: prompt is 41 tokens, longer than rollout.max_prompt_length=32 (2 other bad rows: line 601, line 640)"),
    "messages without a chat template": Bad(f"train {ROWS} data.path=messages.jsonl",
                                            "data.path: messages.jsonl line 2: prompt is a list of messages but the tokenizer has no chat template; use a chat model's tokenizer (model.name_or_path) or plain-text prompts"),
    "prompt column missing": Bad(f"train {ROWS} data.prompt_column=question", "data.path: rows.jsonl line 1: no prompt column 'question'", real=False),
    "prompt a number": Bad(f"train {ROWS} data.path=number.jsonl", "data.path: number.jsonl line 2: prompt must be a string or a list", real=False),
    "reward column missing": Bad(f"train {ROWS} 'reward.functions=[{{fn: exact_match, column: solution}}]'",
                                 "data.path: rows.jsonl line 1: column 'solution' (needed by reward 'exact_match') is missing", real=False),
    "recipe label unknown": Bad("train data.path=mixed.jsonl 'reward.recipes={sum: [exact_match], code: [exact_match]}'",
                                "data.path: mixed.jsonl line 3: data_source 'physics' has no reward.recipes entry (recipes: sum, code); "
                                "fix it, or set data.on_bad_row=skip to leave it out", real=False),
    "recipe column missing": Bad("train data.path=rows.jsonl 'reward.recipes={sum: [exact_match]}' reward.recipe_column=label",
                                 "data.path: rows.jsonl line 1: column 'label' (reward.recipe_column: it picks the row's reward "
                                 "recipe) is missing (19 other bad rows: line 2, line 3, line 4, ...)", real=False),
    "recipe column a recipe needs": Bad("train data.path=mixed.jsonl 'reward.recipes={sum: [exact_match], "
                                        "code: [{fn: exact_match, column: tests, name: tests}], default: [exact_match]}'",
                                        "data.path: mixed.jsonl line 2: column 'tests' (needed by reward 'tests') is missing; "
                                        "fix it, or set data.on_bad_row=skip", real=False),
    "recipes two functions one name": Bad("train data.path=mixed.jsonl 'reward.recipes={sum: [exact_match], "
                                          "default: [{fn: exact_match, column: answer}]}'",
                                          "reward.recipes: recipes 'sum' and 'default' hold two different reward functions "
                                          "named 'exact_match'; give them distinct names (name: in a config entry, name= in Python)", real=False),
    "image for a text-only model": Bad(f"train {ROWS} data.path=images.jsonl",
                                       "data.path: images.jsonl line 2: image: 1 image for a text-only model "
                                       "(model.name_or_path=tiny-addition); use a vision-language model or drop the column"),
    "every row bad, skipped": Bad(f"train {ROWS} data.path=all_blank.jsonl data.on_bad_row=skip", "every row is bad, so there is nothing to train on", real=False),
    "eval rows bad": Bad(f"train {ROWS} data.eval_path=blank.jsonl", "data.eval_path: blank.jsonl line 5: prompt is only whitespace", real=False),
    "task unknown": Bad("train data.task=subtraction", "data.task: unknown task 'subtraction'; known tasks: addition", real=False),
    # --- models
    "model missing": Bad("train model=./no-model", "model.name_or_path: cannot load tokenizer './no-model': no such file or directory"),
    "model not a model": Bad("train model=./data", "model.name_or_path: cannot load tokenizer './data': the directory holds no tokenizer_config.json or tokenizer.json or config.json", real=False),
    "model an encoder": Bad("train model=bert-model", "model.name_or_path: the bert model (BertLMHeadModel) is not a causal LM: its logits at a position change with the tokens after it", real=False),
    "model an encoder-decoder": Bad("train model=t5-model", "model.name_or_path: cannot load 't5-model': it is a t5 model (T5ForConditionalGeneration), an encoder-decoder, which lmrl cannot train: lmrl trains decoder-only causal LMs", real=False),
    "output_dir under a file": Bad("train train.output_dir=rows.jsonl/run", "train.output_dir: rows.jsonl/run cannot be created: ", real=False),
    "no CUDA here": Bad("train model.device=cuda", "model.device: 'cuda' asked for, but this machine has no CUDA device; use model.device=cpu", real=False),
    "eval NaN weights": Bad("eval --model nan-model", "model: nan-model has non-finite weights (NaN or inf); refusing to train or evaluate it"),
    "teacher missing": Bad("train algorithm.teacher=./no-teacher",
                           "algorithm.teacher: cannot load the teacher './no-teacher': no such file or directory"),
    "teacher another tokenizer": Bad("train algorithm.teacher=other-tokenizer",
                                     "algorithm.teacher: the teacher's tokenizer (other-tokenizer) differs from the policy's "
                                     "(tiny-addition): 2 of 99 tokens have other ids (first: '1' is 5 for the teacher, 4 for "
                                     "the policy); distillation needs the student's tokenizer", real=False),
    "teacher another vocab size": Bad("train algorithm.teacher=other-vocab",
                                      "algorithm.teacher: the teacher 'other-vocab' has a vocabulary of 107 tokens, the policy "
                                      "'tiny-addition' 99: distillation compares their log-probs of the same token ids; use a "
                                      "teacher with the policy's tokenizer", real=False),
    "rollout cannot fit": Bad("train rollout.prompts_per_step=100000000", "rollout: a step generates 800000000 sequences", real=False),
    "micro-batch cannot fit": Bad("train optim.micro_batch_size=100000000000", "optim: a training forward of up to ", real=False),
    # --- rewards: a value that is not a finite real number, a failure, an exit: the function, completion, value
    "reward inf": Bad(f"train {QUICK} reward.functions=[rewards.py:inf_reward]",
                      "step 1: reward function 'inf_reward' returned inf for completion 0 (expected a finite number or None)", 1, True),
    "reward nan": Bad(f"train {QUICK} reward.functions=[rewards.py:nan_reward]",
                      "reward function 'nan_reward' returned nan for completion 0 (return None where the reward does not apply)", 1, True, real=False),
    "reward dict": Bad(f"train {QUICK} reward.functions=[rewards.py:dict_reward]", "reward function 'dict_reward' returned a dict", 1, True, real=False),
    "reward bool": Bad(f"train {QUICK} reward.functions=[rewards.py:bool_reward]", "reward function 'bool_reward' returned a bool", 1, True, real=False),
    "reward count": Bad(f"train {QUICK} reward.functions=[rewards.py:short_reward]", "reward function 'short_reward' returned 1 rewards for 4 completions", 1, True, real=False),
    "reward raises": Bad(f"train {QUICK} reward.functions=[rewards.py:boom]", "reward function 'boom' failed: ZeroDivisionError: division by zero", 1, True, real=False),
    "reward sys.exit": Bad(f"train {QUICK} reward.functions=[rewards.py:exits]", "reward function 'exits' called sys.exit(0)", 1, True),
    "reward os._exit": Bad(f"train {QUICK} reward.functions=[rewards.py:os_exits]", "reward function 'os_exits' called os._exit(0)", 1, True),
    "reward async -inf": Bad(f"train {QUICK} reward.functions=[rewards.py:async_neg_inf]", "reward function 'async_neg_inf' returned -inf for completion 0", 1, True, real=False),
    "reward timeout": Bad(f"train {QUICK} reward.functions=[rewards.py:slow] reward.timeout=1", "reward function 'slow' failed: TimeoutError: timed out after 1s", 1, True, real=False),
    "remote Infinity": Bad(f"train {QUICK} 'reward.functions=[{{fn: remote, url: \"{{url}}/inf\", max_retries: 0}}]'",
                           "remote reward {url}/inf failed after 1 attempt(s): rewards must be finite numbers or null: completion 0 got inf", 1, True),
    "remote 500": Bad(f"train {QUICK} 'reward.functions=[{{fn: remote, url: \"{{url}}/crash\", max_retries: 0}}]'",
                      "remote reward {url}/crash failed after 1 attempt(s): HTTP 500: 'scorer crashed: out of memory'", 1, True, real=False),
    "reward sys.exit at import": Bad(f"train {QUICK} reward.functions=[exits_at_import.py:f]", "reward.functions[0]: reward spec 'exits_at_import.py:f': importing"),
    "reward import fails": Bad(f"train {QUICK} reward.functions=[broken_import.py:f]", "reward.functions[0]: reward spec 'broken_import.py:f': importing", real=False),
    "reward function missing": Bad(f"train {QUICK} reward.functions=[rewards.py:nope]", "reward.functions[0]: reward spec 'rewards.py:nope': no function 'nope'", real=False),
    "reward builtin unknown": Bad(f"train {QUICK} reward.functions=[exact]", "reward.functions[0]: reward spec 'exact': expected a built-in name", real=False),
    # --- quiet failures made loud
    "every completion dropped": Bad(f"train {QUICK} reward.drop_truncated=true rollout.max_new_tokens=1 guard.max_empty_steps=2",
                                    "step 2: 2 steps in a row learned nothing (guard.max_empty_steps=2): every completion was cut", 1, True, real=False),
}

REWARDS_PY = '''
import asyncio, os, sys, time

def inf_reward(prompts, completions, **kw):
    return [float("inf")] * len(completions)

def nan_reward(prompts, completions, **kw):
    return [float("nan")] * len(completions)

def dict_reward(prompts, completions, **kw):
    return {i: 1.0 for i in range(len(completions))}

def bool_reward(prompts, completions, **kw):
    return [c.strip() == "" for c in completions]

def short_reward(prompts, completions, **kw):
    return [1.0]

def boom(prompts, completions, **kw):
    return [1 / 0]

def exits(prompts, completions, **kw):
    sys.exit(0)

def os_exits(prompts, completions, **kw):
    os._exit(0)

async def async_neg_inf(prompts, completions, **kw):
    return [float("-inf")] * len(completions)

def slow(prompts, completions, **kw):
    time.sleep(60)
    return [0.0] * len(completions)

def huge(prompts, completions, answer, **kw):
    return [1e39 if c.strip() == a else 0.0 for c, a in zip(completions, answer)]
'''


def _rows(n: int, long_at: tuple[int, ...] = ()) -> str:
    lines = []
    for i in range(n):
        a, b = i % 50, (7 * i) % 50
        prompt = f"{a}+{b}=" if i + 1 not in long_at else "1+1=" * 10 + "1"
        lines.append(json.dumps({"prompt": prompt, "answer": str(a + b)}))
    return "\n".join(lines) + "\n"


FILES = {
    "rows.jsonl": _rows(20),
    "mixed.jsonl": "".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1), "data_source": source}) + "\n"
                           for i, source in enumerate(["sum", "code", "physics", "sum"])),
    "long.jsonl": _rows(640, long_at=(600, 601, 640)),
    "blank.jsonl": _rows(4) + json.dumps({"prompt": "  \t ", "answer": "1"}) + "\n" + _rows(3),
    "all_blank.jsonl": "\n".join(json.dumps({"prompt": " ", "answer": "1"}) for _ in range(3)) + "\n",
    "number.jsonl": _rows(1) + json.dumps({"prompt": 12, "answer": "1"}) + "\n",
    "messages.jsonl": _rows(1) + json.dumps({"prompt": [{"role": "user", "content": "1+1="}], "answer": "2"}) + "\n",
    "images.jsonl": _rows(1) + json.dumps({"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "digit?"}]}],
                                            "image": "digit.png", "answer": "7"}) + "\n",
    "broken.jsonl": _rows(2) + '{"prompt": "1+1=", "answer": \n',
    "empty.jsonl": "",
    "rows.csv": "prompt,answer\n1+1=,2\n",
    "data/README": "not a model, not a config",
    "invalid.yaml": "train: [1\n",
    "twice.yaml": "train:\n  steps: 5\nalgorithm: dapo\ntrain:\n  steps: 7\n",
    "key_twice.yaml": "train:\n  steps: 5\n  steps: 6\n",
    "list.yaml": "- train\n- steps\n",
    "unknown.yaml": "rollout:\n  group: 4\n",
    "rewards.py": REWARDS_PY,
    "exits_at_import.py": "import sys\nsys.exit(0)\n",
    "broken_import.py": "import no_such_module_here\n",
}


class _Scorer(BaseHTTPRequestHandler):
    """A reward server that answers Infinity on /inf and HTTP 500 on /crash."""

    def do_POST(self):  # noqa: N802 - http.server's name
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path == "/inf":
            self._send(200, '{"rewards": [' + ", ".join(["Infinity"] * len(body["completions"])) + "]}")
        else:
            self._send(500, "scorer crashed: out of memory")

    def _send(self, status: int, text: str):
        self.send_response(status)
        self.send_header("Content-Length", str(len(text)))
        self.end_headers()
        self.wfile.write(text.encode())

    def log_message(self, *args):
        pass


def _nan_model(directory: Path) -> None:
    shutil.copytree(SHIPPED_MODEL, directory)
    weights = load_file(directory / "model.safetensors")
    name = next(iter(weights))
    weights[name] = torch.full_like(weights[name], math.nan)
    save_file(weights, directory / "model.safetensors", metadata={"format": "pt"})


def _not_causal_models(cwd: Path) -> None:
    """A BERT and a T5 of random weights with the shipped model's tokenizer: models lmrl cannot train."""
    from transformers import AutoTokenizer, BertConfig, BertForMaskedLM, T5Config, T5ForConditionalGeneration

    tok = AutoTokenizer.from_pretrained(SHIPPED_MODEL)
    torch.manual_seed(0)
    bert = BertForMaskedLM(BertConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                      intermediate_size=64))
    t5 = T5ForConditionalGeneration(T5Config(vocab_size=len(tok), d_model=32, d_ff=64, num_layers=1, num_heads=2,
                                             d_kv=16, decoder_start_token_id=0))
    for name, model in (("bert-model", bert), ("t5-model", t5)):
        model.save_pretrained(cwd / name)
        tok.save_pretrained(cwd / name)


def _teachers(cwd: Path) -> None:
    """Teachers a distillation cannot use: the shipped model with two token ids swapped in its tokenizer, and with
    8 more rows of embeddings (the same tokenizer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    shutil.copytree(SHIPPED_MODEL, cwd / "other-tokenizer")
    spec = json.loads((cwd / "other-tokenizer" / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    vocab["1"], vocab["2"] = vocab["2"], vocab["1"]
    (cwd / "other-tokenizer" / "tokenizer.json").write_text(json.dumps(spec))
    model = AutoModelForCausalLM.from_pretrained(SHIPPED_MODEL)
    model.resize_token_embeddings(model.config.vocab_size + 8, mean_resizing=False)
    model.save_pretrained(cwd / "other-vocab")
    AutoTokenizer.from_pretrained(SHIPPED_MODEL).save_pretrained(cwd / "other-vocab")


def _args(case: str, bad: Bad, url: str) -> list[str]:
    """The row's arguments after `lmrl`; a train row writes to out/<case> without a console."""
    args = shlex.split(bad.args.replace("{url}", url))
    if args[0] == "train":
        args += ["log.console=false"]
        if not any(a.startswith("train.output_dir=") for a in args):
            args += [f"train.output_dir=out/{case.replace(' ', '_')}"]
    return args


def _main(args: list[str], cwd: Path) -> tuple[int, str]:
    """`lmrl ARGS` through lmrl.cli.main in this process, in `cwd`: (exit code, stderr). CUDA is hidden, so
    that a machine with a GPU checks the lines this one does ("no CUDA here" among them)."""
    err, here = io.StringIO(), os.getcwd()
    os.chdir(cwd)
    try:
        with (contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()),
              mock.patch("torch.cuda.is_available", return_value=False)):
            try:
                code = main(args)
            except SystemExit as e:  # argparse's usage errors
                code = e.code
    finally:
        os.chdir(here)
    return code, err.getvalue()


@pytest.fixture(scope="module")
def ran(tmp_path_factory):
    """Every row of BAD run once: name -> (args, exit code, stderr); and the scorer's URL and the directory."""
    cwd = tmp_path_factory.mktemp("bad-inputs")
    for name, text in FILES.items():
        (cwd / name).parent.mkdir(parents=True, exist_ok=True)
        (cwd / name).write_text(text)
    _nan_model(cwd / "nan-model")
    _not_causal_models(cwd)
    _teachers(cwd)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Scorer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "LMRL_TRACEBACK": ""}

    def run(case: str):
        args = _args(case, BAD[case], url)
        try:
            proc = lmrl(*args, cwd=cwd, timeout=120, env=env)  # a process, without start-up
        except subprocess.TimeoutExpired as e:  # that row fails with what it printed; the others still run
            return case, (args, None, f"timed out after 120 s: {e.stderr}")
        return case, (args, proc.returncode, proc.stderr)

    try:
        with ThreadPoolExecutor(max_workers=2) as pool:
            done = dict(pool.map(run, [case for case, bad in BAD.items() if bad.real]))
        for case, bad in BAD.items():
            if not bad.real:
                args = _args(case, bad, url)
                done[case] = (args, *_main(args, cwd))
    finally:
        server.shutdown()
    return done, url, cwd


def test_the_table_is_large_enough():
    assert len(BAD) >= 80


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_gets_one_line(case, ran):
    done, url, cwd = ran
    args, code, stderr = done[case]
    bad = BAD[case]
    where = f"lmrl {shlex.join(args)}\nstderr: {stderr[-3000:]}"
    lines = [line for line in stderr.splitlines() if not line.startswith("lmrl: warning: ")]
    assert code == bad.code, where
    assert "Traceback" not in stderr, where
    assert len(lines) == 1 and lines[0].startswith("lmrl: error: "), where
    assert bad.line.replace("{url}", url) in lines[0], where
    out = cwd / "out" / case.replace(" ", "_")
    if not bad.saves:
        assert not out.exists(), f"{case}: a refused run wrote {sorted(p.name for p in out.iterdir())}"
    else:  # whatever a failed run saved loads, and holds no NaN or inf
        for weights in out.rglob("*.safetensors"):
            assert all(bool(torch.isfinite(t).all()) for t in load_file(weights).values()), weights


# ------------------------------------------------------------------------------- good ends, loudly told


def _lmrl(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    """`lmrl ARGS` as its own process (forked from one that has imported lmrl: tests/forked.py)."""
    return lmrl(*args, cwd=cwd, timeout=180, env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_on_error_zero_counts_non_finite_rewards_and_saves_finite_weights(tmp_path):
    (tmp_path / "rewards.py").write_text(REWARDS_PY)
    proc = _lmrl(tmp_path, "train", *QUICK.split(), "reward.functions=[rewards.py:inf_reward]", "reward.on_error=zero",
                 "train.output_dir=out", "log.console=false")
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [r["reward/inf_reward/errors"] for r in rows] == [1.0, 1.0]
    weights = load_file(tmp_path / "out" / "final" / "model.safetensors")
    assert all(bool(torch.isfinite(t).all()) for t in weights.values())


def test_warnings_and_a_users_config_yaml(tmp_path):
    """A warm-up longer than the run and skipped bad rows are told once each; output_dir may be the folder
    holding the user's config.yaml, which is never overwritten (the resolved config is lmrl_config.yaml)."""
    user_config = "# my run\ntrain:\n  steps: 2\n"
    (tmp_path / "config.yaml").write_text(user_config)
    (tmp_path / "blank.jsonl").write_text(FILES["blank.jsonl"])
    proc = _lmrl(tmp_path, "train", "config.yaml", *QUICK.split(), "data.path=blank.jsonl", "reward.functions=[exact_match]",
                 "data.on_bad_row=skip", "optim.warmup_steps=10", "train.output_dir=.", "log.console=false")
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.splitlines() == [
        "lmrl: warning: data.path: left out 1 bad row of 8 (data.on_bad_row=skip); the first, blank.jsonl line 5: "
        "prompt is only whitespace",
        "lmrl: warning: optim.warmup_steps=10 is longer than the run's 2 optimizer steps: the learning rate never "
        "reaches optim.lr (it ends at 20% of it)",
    ]
    assert (tmp_path / "config.yaml").read_text() == user_config
    assert "steps: 2" in (tmp_path / "lmrl_config.yaml").read_text()


# --------------------------------------------------------------------------------------- the Python API


def test_python_api_bad_inputs_raise_the_same_one_line_errors():
    from lmrl.trainer import Trainer

    with pytest.raises(ConfigError, match=r"^optim\.max_grad_norm: must be > 0, or null for no clipping"):
        load_config(None, ["optim.max_grad_norm=0"])
    cfg = load_config(None, ["train.steps=1", "data.num_eval_prompts=0", "log.console=false"])
    rows = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(10)]
    rows[7] = {"prompt": "\n", "answer": "1"}
    rows[9] = {"question": "1+1="}
    with pytest.raises(DataError, match=r"^train_dataset index 7: prompt is only whitespace \(1 other bad row: index 9\)"):
        Trainer(cfg, train_dataset=rows, reward_funcs=[lambda prompts, completions, **kw: [0.0] * len(completions)])
    with pytest.raises(RewardError, match=r"^reward function 'f' returned inf for completion 1 "):
        def f(prompts, completions, **kw):
            return [0.0, math.inf]
        score([f], ["a", "b"], ["x", "y"])


def test_a_model_with_non_finite_weights_is_refused(tmp_path):
    from lmrl.models.shipped import load_shipped
    from lmrl.trainer import Trainer

    model, tokenizer = load_shipped()
    with torch.no_grad():
        next(model.parameters())[0, 0] = math.inf
    cfg = load_config(None, ["train.steps=1", "log.console=false", f"train.output_dir={tmp_path}"])
    with pytest.raises(ModelError, match=r"^model: the given model has non-finite weights"):
        Trainer(cfg, model=model, tokenizer=tokenizer)


@pytest.mark.parametrize("advantage", ["grpo", "reinforce"])
def test_huge_rewards_learn_like_scaled_small_ones(advantage):
    """Rewards near 1e20 overflowed the float32 group std (every advantage 0); in float64, normalising
    estimators give the advantages of the same rewards scaled down."""
    options = {"advantage": advantage, "whiten_advantages": advantage == "reinforce"}
    small = torch.tensor([0.0, 1.0, 1.0, 0.0, 3.0, 1.0, 0.0, 2.0], dtype=torch.float64)
    mask = torch.ones(8, 3, dtype=torch.bool)
    expected = compute_advantages(small, mask, group_size=4, **options).advantages
    for scale in (1e20, 1e39, 1e100):  # beyond ~1e150 the variance overflows float64 too
        got = compute_advantages(small * scale, mask, group_size=4, **options).advantages
        assert got.dtype == torch.float32 and bool(torch.isfinite(got).all())
        torch.testing.assert_close(got, expected)


def test_advantages_beyond_float32_are_a_reward_error():
    with pytest.raises(RewardError, match=r"^advantages overflow float32: rewards up to 1e\+39 with algorithm\.advantage=rloo"):
        compute_advantages(torch.tensor([0.0, 1e39], dtype=torch.float64), torch.ones(2, 2, dtype=torch.bool), 2,
                           advantage="rloo")
