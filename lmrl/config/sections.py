"""The config's sections but one (`algorithm` has its own module): model, data, rollout, reward, optim, train,
guard, log, env and sandbox. Each field's type holds its range and its docstring says what it does; checks
that involve one section only live here, checks between sections on `Config` (lmrl.config.schema).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from lmrl.config.base import (
    MAX_SEED,
    Dtype,
    NonEmptyStr,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    Section,
)
from lmrl.sandbox import SandboxLimits


class LoraConfig(Section):
    r: PositiveInt = 16
    """LoRA rank."""
    alpha: PositiveFloat = 32
    """LoRA scaling numerator (the update is scaled by alpha / r)."""
    dropout: Annotated[float, Field(ge=0, lt=1)] = 0.0
    """Dropout on the LoRA input, in [0, 1)."""
    target_modules: Annotated[list[NonEmptyStr], Field(min_length=1)] | NonEmptyStr = "all-linear"
    """Module names to adapt, or "all-linear"."""


class ModelConfig(Section):
    name_or_path: NonEmptyStr = "tiny-addition"
    """Policy model: a local directory, a hub id, or "tiny-addition" (the model shipped with lmrl)."""
    dtype: Dtype = "float32"
    """Weights' dtype. float32 is the safe default on CPU; bfloat16 halves memory on GPUs."""
    device: Annotated[str, Field(pattern=r"^(auto|cpu|cuda(:\d+)?)$")] = "auto"
    """"auto" (cuda when available, else cpu), "cpu", "cuda", "cuda:1", ..."""
    trust_remote_code: bool = False
    """Allow model code from the hub repository (only for models you trust)."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass: less memory, ~30% more compute."""
    lora: LoraConfig | None = None
    """Train LoRA adapters (needs `pip install lmrl[peft]`) instead of all weights."""
    critic_name_or_path: NonEmptyStr | None = None
    """PPO critic: a separate model; None copies the policy's backbone and adds a value head."""
    shared_critic: bool = False
    """PPO: the value head sits on the policy's own backbone instead of a separate critic (TRL's
    AutoModelForCausalLMWithValueHead, trlx): one forward and backward serve both losses, and the value
    loss trains the backbone too (vf_coef weighs it). No second copy of the weights."""
    chat_template: bool | None = None
    """Apply the tokenizer's chat template to chat-style prompts (None: when prompts are message lists)."""
    tool_call_format: Literal["auto", "hermes", "llama3", "mistral"] = "auto"
    """How the model writes tool calls, parsed into `tool_calls` by `lmrl serve` and the agent gateway: "hermes"
    (Qwen's `<tool_call>{...}</tool_call>`), "llama3" (Llama 3's JSON reply), "mistral" (`[TOOL_CALLS][...]`); "auto"
    reads it from the tokenizer's chat template (hermes when it shows none)."""
    dropout: bool = False
    """Keep the dropout the model's config sets (GPT-2, OPT: 0.1) in the trained forward. False: dropout is off in
    the policy, the reference and the critic (every dropout module, and the rates their configs hold), so the
    trained forward computes the distribution the sampler drew from: at the first step the importance weight is 1
    and the KL to the reference 0 (TRL's disable_dropout=True). A saved model's config keeps its own rates. LoRA's
    dropout (model.lora.dropout) is not this field's: it applies whenever set."""
    attn_implementation: str | None = None
    """transformers' attention kernel for training forwards: "eager", "sdpa", "flash_attention_2", ...
    (None: transformers' choice). On CPU with bfloat16 autocast, "eager" trains faster than "sdpa"."""
    freeze_vision: bool = True
    """A vision-language policy: keep its vision tower's weights as they are (the projector and the language
    model train). Ignored for a text model."""


class DataConfig(Section):
    task: str | None = "addition"
    """A built-in task (prompts, reward and held-out split), e.g. "addition". Ignored when `path` is set."""
    path: NonEmptyStr | None = None
    """Prompt dataset: a .jsonl / .json / .parquet file, a directory datasets' save_to_disk wrote, or a hub
    dataset name (needs network)."""
    split: str = "train"
    """Split of `path` to train on."""
    streaming: bool = False
    """Read `path` as a stream: rows are read in order as steps ask for them and never held whole (for a
    dataset larger than memory). The first step's rows are checked before the model loads, the others as
    they are read (docs/python.md, streamed datasets)."""
    eval_path: NonEmptyStr | None = None
    """Held-out prompts for evaluation (defaults to the task's held-out split). With `path` and no
    `eval_path` a run has no held-out evaluation: give `eval_path` (the same dataset with `eval_split` works)."""
    eval_split: str = "test"
    """Split of `eval_path` to evaluate on, when it has splits (a DatasetDict, a hub dataset)."""
    prompt_column: NonEmptyStr = "prompt"
    """Column holding the prompt: a string or a list of chat messages."""
    num_eval_prompts: NonNegativeInt = 200
    """How many held-out prompts each evaluation uses (0 = no evaluation)."""
    on_bad_row: Literal["fail", "skip"] = "fail"
    """A row that cannot be trained on (no prompt, a blank or over-long prompt, a column a reward needs
    missing): "fail" stops before the model loads, naming the file and line; "skip" leaves such rows
    out with one warning and their count. Every row is checked up front either way."""

    @model_validator(mode="after")
    def _source(self) -> DataConfig:
        if self.task is None and self.path is None:
            raise ValueError("set data.task (a built-in task) or data.path (a prompt dataset)")
        return self


class VLLMConfig(Section):
    max_model_len: PositiveInt | None = None
    """Longest sequence the engine holds: prompt and completion (with an environment, every turn and
    observation). None: rollout.max_prompt_length plus the completion budget (max_new_tokens, or env.max_tokens)."""
    gpu_memory_utilization: Annotated[float, Field(gt=0, le=1)] = 0.3
    """On a GPU, the share of its memory the engine takes for weights and KV cache, in (0, 1]; training
    needs the rest. Ignored on a CPU (cpu_kv_cache_gb)."""
    cpu_kv_cache_gb: PositiveInt = 1
    """On a CPU, the GiB the engine sets aside for its KV cache: a whole number (vLLM's VLLM_CPU_KVCACHE_SPACE;
    0.25 failed inside the engine's start-up)."""
    sleep: bool = True
    """On a GPU, release the engine's memory (KV cache, weights) while the policy trains and take it back
    before the next generation (vLLM's sleep mode). A CPU has no such mode: ignored there."""
    enforce_eager: bool = False
    """Run the engine's model eagerly, without CUDA graphs (faster start, slower decode). Always eager on a CPU."""
    server_url: NonEmptyStr | None = None
    """rollout.backend=vllm-server: the generation server (`lmrl serve`, e.g. "http://gpu-node:8000") that samples
    and takes the policy's weights after each step. None: lmrl starts one on this machine and stops it with the run."""
    server_api_key_env: NonEmptyStr = "LMRL_API_KEY"
    """rollout.vllm.server_url: the environment variable holding the server's API key (its --api-key), sent with
    every request; unset or empty: none. The variable is named, not the key, so no key lands in a saved config or
    checkpoint. A server the run starts itself gets a new random key."""
    server_weights_secret_env: NonEmptyStr = "LMRL_WEIGHTS_SECRET"
    """rollout.vllm.server_url: the environment variable holding the server's weights secret (its
    --weights-secret), sent with every weight push; unset or empty: none."""
    timeout: PositiveFloat = 600.0
    """Seconds one request to the generation server may take (a step's generation, a weight push)."""


class RolloutConfig(Section):
    prompts_per_step: PositiveInt = 16
    """Prompts sampled per training step."""
    group_size: PositiveInt = 8
    """Completions per prompt (G). Group-relative estimators need G >= 2."""
    max_prompt_length: PositiveInt = 512
    """Longest prompt in tokens; longer prompts are an error (or skipped, data.on_bad_row), never cut."""
    max_new_tokens: PositiveInt = 256
    """Longest completion in tokens."""
    temperature: PositiveFloat = 1.0
    """Sampling temperature (> 0); log-probs in training use the same temperature."""
    top_p: Annotated[float, Field(gt=0, le=1)] = 1.0
    """Nucleus sampling threshold in (0, 1] (1.0 = off)."""
    top_k: NonNegativeInt = 0
    """Top-k sampling (0 = off)."""
    stop: list[NonEmptyStr] = []
    """Stop strings that end a completion besides EOS."""
    batch_size: PositiveInt | None = None
    """Most sequences generated in one batch (None = all at once)."""
    dtype: Literal["float32", "bfloat16", "float16"] | None = None
    """Weights the sampler uses. None: the policy itself. Another dtype: a copy of the policy in that
    dtype, refreshed from the policy before every generation; truncated importance sampling
    (algorithm.tis_cap, 2.0 unless set) corrects for the difference between its probabilities and
    the trainer's."""
    backend: Literal["lmrl", "vllm", "vllm-server"] = "lmrl"
    """What generates: "lmrl", lmrl's own decode loop (the default; on a CPU as fast as an engine); "vllm", a vLLM
    engine in the trainer's process (pip install 'lmrl[vllm]'); or "vllm-server", a generation server in another
    process or on another machine (`lmrl serve`; rollout.vllm.server_url). An engine takes the policy's weights
    before each step's generation, and truncated importance sampling (algorithm.tis_cap, 2.0 unless set) corrects
    for the difference between its probabilities and the trainer's (docs/generation.md)."""
    vllm: VLLMConfig = VLLMConfig()
    """The vLLM engine's settings (rollout.backend=vllm)."""
    partial: bool | Literal["keep_cache"] = False
    """Partial rollouts (with train.max_staleness and lmrl's decode): sequences in flight take new weights at their
    next token instead of ending on the old ones; each token keeps the version and the log-prob it was sampled with,
    and the decoupled objective weights each by its own (docs/async.md). true: their tokens so far are prefilled again
    under the new weights (AReaL's and verl's partial rollouts: every log-prob exactly the new weights'); "keep_cache":
    the keys and values cached so far are kept, nothing is prefilled again, and the new weights' tokens attend to keys
    the older weights computed (PipelineRL's in-flight weight updates: cheaper)."""
    cuda_graph: bool = True
    """On a GPU, decode with fixed shapes (a KV cache of the whole rollout) and replay each step as one
    CUDA graph, where the model allows it (full attention, sdpa or eager kernel); the run says which
    decode path it took and why. Ignored on a CPU."""

    @field_validator("partial", mode="before")
    @classmethod
    def _partial(cls, value: Any) -> Any:
        if value not in (True, False, "keep_cache"):
            raise ValueError(f"partial: true, false or keep_cache (got {value!r})")
        return value


class RewardConfig(Section):
    functions: list[str | dict[str, Any]] = []
    """Reward functions; empty = the task's reward. Each entry is a built-in name (math, exact_match,
    format, regex, length, remote, reward_model), "file.py:function", "module:function", or a mapping
    {fn: NAME, weight: 0.5, OPTION: VALUE} (e.g. {fn: remote, url: "http://host:8000/score"}); `call: queries`
    calls a user function as OpenRLHF and LightRFT do, reward_func(queries, prompts, labels)."""
    weights: list[float] | None = None
    """One weight per function (default: each entry's own weight, else 1.0)."""
    recipes: dict[NonEmptyStr, list[str | dict[str, Any]]] = {}
    """Reward recipes (LightRFT): label -> reward functions, written as in `functions`, for the rows whose
    `recipe_column` holds that label (e.g. {math: [math], code: [{fn: code, weight: 0.5}]}); a recipe named
    `default` scores rows whose label has none. Each function runs once per batch, on its recipes' rows.
    Use instead of `functions`."""
    recipe_column: NonEmptyStr = "data_source"
    """The dataset column whose value picks each row's recipe (verl's data_source; LightRFT: label)."""
    timeout: PositiveFloat = 60.0
    """Seconds one reward call may take before it counts as failed (> 0)."""
    on_error: Literal["fail", "zero"] = "fail"
    """What a failing reward function does: stop training, or score 0 and count it in metrics."""
    missing_eos_penalty: float | None = None
    """Subtract this from the score of completions that never produced EOS (TRL)."""
    overlong_buffer: PositiveInt | None = None
    """DAPO soft overlong penalty: the last `overlong_buffer` tokens before max_new_tokens cost up to 1."""
    drop_truncated: bool = False
    """Leave completions cut at max_new_tokens out of the loss."""
    clip: PositiveFloat | tuple[float, float] | None = None
    """Clip scores to [-clip, clip], or to [low, high] given a pair (REINFORCE++; OpenRLHF's reward_clip_range;
    None = no clipping)."""
    normalize: bool = False
    """Normalise scores to mean 0, std 1 over the batch (REINFORCE++)."""
    verifier: list[str | dict[str, Any]] | None = None
    """Functions that verify held-out answers (written as in `functions`, e.g. [math] or [{fn: exact_match}]), for a
    run whose reward is learned (reward_model, judge): each evaluation then logs `eval/accuracy` as the fraction the
    verifier scores > 0 and `eval/learned_reward` (the learned functions' mean score) beside it, and
    guard.hacking_drop warns when the one rises while the other falls. None: the task's own reward when the reward
    is learned and data.task gives the prompts; []: no verifier (eval/accuracy is the run's reward > 0)."""

    @field_validator("clip", mode="before")
    @classmethod
    def _clip_shape(cls, value: Any) -> Any:
        if isinstance(value, (list, tuple)) and len(value) != 2:
            raise ValueError(f"clip: expected a number c (for [-c, c]) or a pair [low, high], got {list(value)}")
        return value

    @field_validator("recipes", mode="before")
    @classmethod
    def _labels(cls, value: Any) -> Any:
        for label in value if isinstance(value, dict) else ():
            if not isinstance(label, str):
                raise ValueError(f"recipes: a label must be a string (quote it: '{label}'), got {label!r}")
        return value

    @field_validator("clip")
    @classmethod
    def _clip_range(cls, value: float | tuple[float, float] | None) -> float | tuple[float, float] | None:
        if isinstance(value, tuple) and not value[0] < value[1]:
            raise ValueError(f"clip: [low, high] needs low < high (got {list(value)})")
        return value

    @model_validator(mode="after")
    def _recipes(self) -> RewardConfig:
        if self.recipes and self.functions:
            raise ValueError("recipes: set reward.functions (every row) or reward.recipes (a recipe per "
                             f"{self.recipe_column}), not both")
        if self.recipes and self.weights is not None:
            raise ValueError("weights: go with reward.functions; give each reward.recipes entry its own weight, "
                             "e.g. {fn: math, weight: 0.5}")
        for label, entries in self.recipes.items():
            if not entries:
                raise ValueError(f"recipes: recipe {label!r} has no reward functions")
        return self

    def shaping_options(self) -> dict[str, Any]:
        """The fields `lmrl.experience.shape_scores` takes, as its keyword arguments of the same names."""
        return {name: getattr(self, name) for name in ("missing_eos_penalty", "overlong_buffer", "clip", "normalize",
                                                       "drop_truncated")}



class OptimConfig(Section):
    lr: PositiveFloat = 1e-6
    """Policy learning rate (AdamW)."""
    critic_lr: PositiveFloat = 1e-5
    """Critic learning rate (PPO)."""
    weight_decay: NonNegativeFloat = 0.0
    """AdamW weight decay."""
    betas: tuple[Annotated[float, Field(ge=0, lt=1)], Annotated[float, Field(ge=0, lt=1)]] = (0.9, 0.999)
    """AdamW betas, each in [0, 1)."""
    warmup_steps: NonNegativeInt = 0
    """Linear warm-up, in optimizer steps (0 = none)."""
    schedule: Literal["constant", "linear", "cosine"] = "constant"
    """Learning-rate schedule after warm-up."""
    max_grad_norm: float | None = 1.0
    """Clip the global gradient norm to this (> 0); null = no clipping (0 is refused: it would clip every
    gradient to zero, although HF Trainer reads it as "off")."""
    micro_batch_size: PositiveInt = 64
    """Sequences per forward/backward; gradients accumulate over a minibatch (memory knob, same result)."""
    micro_batch_tokens: PositiveInt | None = None
    """Tokens per forward/backward as well (None = rows only): a micro-batch ends before the row that would take it
    past this many real tokens, a prompt counted once for its completions, padding never (a row over it alone is
    a micro-batch of its own). With train.packing, what a forward costs follows its tokens, not its longest row:
    verl's ppo_max_token_len_per_gpu. Under torchrun the ranks then trade whole groups before the update so that each
    trains on about as many tokens (with algorithm.num_minibatches > 1 a rank's minibatches are drawn from what it
    holds then). The same update whatever the split."""

    @field_validator("max_grad_norm")
    @classmethod
    def _clip_norm(cls, value: float | None) -> float | None:
        if value is not None and value <= 0:
            raise ValueError(f"max_grad_norm: must be > 0, or null for no clipping (got {value!r}; "
                             f"{value!r} would clip every gradient to zero)")
        return value


class TrainConfig(Section):
    steps: PositiveInt = 100
    """Training steps (one step = one batch of experience)."""
    seed: Annotated[int, Field(ge=0, le=MAX_SEED)] = 0
    """Seed of every random choice: data order, sampling, initialisation (0 to 2**32 - 1)."""
    output_dir: NonEmptyStr = "runs/lmrl"
    """Where metrics, checkpoints and the final model go."""
    eval_every: NonNegativeInt = 10
    """Evaluate on held-out prompts every this many steps (0 = only at start and end)."""
    save_every: NonNegativeInt = 0
    """Save a resumable checkpoint every this many steps, and at the last step (0 = none: only `final/`,
    and a checkpoint when a signal or a failing reward stops the run)."""
    keep_last: PositiveInt | None = None
    """Keep only the newest this many checkpoints (None = keep all)."""
    keep_best: bool = False
    """Write `best/` (the model as in a checkpoint) at each evaluation whose eval/accuracy beats every earlier one,
    the step-0 evaluation of the starting model included: early stopping on the held-out verifier, without the
    run stopping. A run that never beats its start writes none."""
    resume: str | None = None
    """Continue a run: "auto" from the newest complete checkpoint in output_dir (starts afresh when there
    is none), or a checkpoint directory's path. Only steps, cadences, keep_last, keep_best, max_minutes, threads,
    parallel, output_dir, generator_threads, generator_device, rollout.cuda_graph, rollout.vllm.*, reward.timeout and
    log.* may differ from the checkpoint's config."""
    overwrite: bool = False
    """Start afresh in an output_dir that holds an earlier run, deleting that run's files."""
    max_minutes: PositiveFloat | None = None
    """Stop (after an evaluation and a save) once this much wall time has passed (None = no limit)."""
    autocast_bf16: bool = False
    """Run forwards under bfloat16 autocast (weights stay in their dtype)."""
    threads: PositiveInt | None = None
    """torch CPU threads (None = torch's default: the cores this process may use)."""
    async_steps: NonNegativeInt = 0
    """Asynchronous rollouts: a generator process samples and scores the batches of the next this many steps
    while the trainer trains on this one; the batch of step s is sampled by the policy after step s - 1 - k,
    corrected by the decoupled objective (algorithm.tis_cap is 2.0 unless set). 0 = the synchronous loop.
    docs/async.md."""
    max_staleness: NonNegativeInt | None = None
    """Bounded staleness: a generator process samples without pause with the newest weights it holds, hands each
    group over the step it ends, and a step trains on the first rollout.prompts_per_step groups ready, none sampled
    by a policy more than this many versions before the one being updated (older ones are dropped and counted,
    async/dropped_groups). Runs then depend on timing, not on the seed alone. None = off. docs/async.md."""
    generator_threads: PositiveInt | None = None
    """With async_steps or max_staleness: torch CPU threads of the generator process (None = 1 where it is forked: on
    Linux with the trainer on the CPU, one process; else half the cores this process may use, at least 1; more than
    1 starts it spawned; docs/async.md)."""
    generator_device: str | None = None
    """With async_steps or max_staleness: the generator process's device, e.g. cuda:1 (None = model.device)."""
    logprob_chunk_size: PositiveInt | None = 128
    """Rows of the [B*T, V] logits turned into float32 log-probs at once (None = all): bounds memory at large V."""
    share_prompt: bool = True
    """Update and reference forwards run each distinct prompt once for all its completions (Llama / Qwen2)."""
    packing: bool = True
    """Experience forwards and the update run each micro-batch's real tokens only: no padding in the projections,
    MLP or LM head, a prompt once for its completions (Llama / Qwen2 / Qwen3 with share_prompt; other models drop
    only the columns no row uses). false pads each micro-batch to the batch's longest prompt and response. The same
    loss and gradients to float rounding; docs/performance.md has what it buys."""
    parallel: Literal["auto", "ddp", "fsdp"] = "auto"
    """Under torchrun: "ddp" keeps the whole policy on every rank and sums gradients; "fsdp" shards the
    policy, reference and critic per decoder layer (FSDP2), gathering a layer's weights when it runs and
    the whole policy for generation; "auto" takes fsdp for a policy of 1e9 parameters or more
    (`lmrl.distributed.FSDP_AUTO_PARAMS`), whose AdamW state no longer fits every GPU; one process ignores it."""

    @field_validator("resume", mode="before")
    @classmethod
    def _resume(cls, value: Any) -> Any:
        if isinstance(value, bool):  # train.resume=true reads as "auto"
            return "auto" if value else None
        if isinstance(value, str) and not value.strip():
            raise ValueError("resume: expected \"auto\", true or a checkpoint directory, got an empty string")
        return value


class GuardConfig(Section):
    max_skipped_steps: PositiveInt = 3
    """Steps in a row whose loss or gradient was not finite (each is skipped: no weight changes) before
    the run stops, keeping its last good checkpoint."""
    max_unscored_steps: PositiveInt = 3
    """Steps in a row where no reward function scored any completion (all None) before the run stops."""
    max_failed_steps: PositiveInt = 3
    """Steps in a row where a reward function failed for every completion it was called on (a judge that answers
    garbage or cannot be reached, under reward.on_error=zero, which scores those completions 0) before the run stops;
    the first such step is warned."""
    max_empty_steps: PositiveInt = 3
    """Steps in a row whose update had nothing to learn from because every completion was left out of the
    loss (reward.drop_truncated with every completion truncated) before the run stops."""
    collapse_entropy: NonNegativeFloat = 0.02
    """Collapse warning: the policy's per-token entropy (nats) is below this ..."""
    collapse_drop: Annotated[float, Field(gt=0, le=1)] = 0.5
    """... and held-out accuracy (or, without evaluation, the mean reward of the last 10 steps) fell by
    this fraction of its best. Warned once and recorded as `guard/collapse`; the run goes on."""
    max_sampler_diff: PositiveFloat | None = None
    """The sync check. At every step whose batch the current policy sampled (each step of a synchronous run), a
    sampler that holds its own copy of the weights (rollout.backend vllm or vllm-server, the generator process, a
    rollout.dtype copy) and the trainer may differ by at most this in their log-probs of the sampler's tokens, in
    nats per token on average (`val/sampler_logprob_diff`); above it
    the run stops after a checkpoint, in one line: the sampler is not computing the policy (weights that did not
    reach it, or a kernel that computes the model otherwise), and every step would train on another model's
    samples. None: 0.001 when both compute in float32 (a synced engine differs by ~1e-6 there), 0.1 otherwise."""
    sampler_kl_warn: PositiveFloat = 0.05
    """`val/sampler_kl` above this (the sampler drifting from the trainer on later steps) is warned once."""
    hacking_drop: Annotated[float, Field(gt=0, le=1)] = 0.1
    """The reward-hacking warning, for a run whose reward is learned and whose evaluation verifies (reward.verifier):
    warned once, and `guard/reward_hacking` is 1 at each evaluation where, against the evaluation guard.hacking_window
    evaluations before it (the first when fewer), `eval/learned_reward` rose while `eval/accuracy` fell by at least
    this much (absolute: 0.1 is 10 points; the accuracy of 200 held-out prompts moves ~3 points by chance)."""
    hacking_window: PositiveInt = 3
    """Evaluations back that the reward-hacking warning compares with (3: 30 steps at train.eval_every=10)."""
    sync_probe_every: NonNegativeInt = 10
    """The sync check of an asynchronous run (train.async_steps), whose batches a policy a version or more behind
    sampled: every this many steps, the weights the trainer publishes are checked once the generator process has
    taken them, on one sequence of the step's batch (its log-probs at temperature 1 from the trainer as it
    publishes and from the sampler as it takes them, `val/sampler_probe_diff`), against guard.max_sampler_diff.
    0: only the first step is checked. (A generation server does not score sequences: not probed.)"""


class LogConfig(Section):
    console: bool = True
    """Live console: progress with ETA and a metrics line per step."""
    jsonl: bool = True
    """Write metrics.jsonl, samples.jsonl and, at the end, report.html in the output directory (false: none of them)."""
    tensorboard: bool = False
    """Write TensorBoard events (needs `pip install lmrl[tensorboard]`)."""
    wandb: bool = False
    """Log to Weights & Biases (needs `pip install lmrl[wandb]`)."""
    every: PositiveInt = 1
    """Print a metrics line every this many steps (evaluation steps always print)."""
    samples_every: NonNegativeInt = 10
    """Show a table of sample completions every this many steps (0 = never)."""
    num_samples: PositiveInt = 4
    """Rows in each sample table."""


class EnvConfig(Section):
    """Multi-turn episodes (`lmrl.envs`): the model acts, the environment answers, for several turns."""

    name: NonEmptyStr | None = None
    """None: one completion per prompt (no environment). "tools": the built-in tool environment (the model
    calls `env.tools`; a turn without a tool call ends the episode). "file.py:Class" or "module:Class": your
    environment, called with each dataset row to start an episode. "agent": each episode is a run of
    `env.command`, a program that talks to lmrl's gateway with an OpenAI client (docs/agents.md). "verifiers:MODULE":
    the verifiers environment MODULE.load_environment() returns (a module or file.py; pip install 'lmrl[agents]'):
    its tasks are the prompts, its rollout runs against the gateway, its rubric is the reward."""
    command: NonEmptyStr | None = None
    """The agent program of env.name=agent, e.g. "python my_agent.py" (split as a shell would, run without one)."""
    timeout: PositiveFloat = 120.0
    """Seconds one agent episode may run (env.name=agent or verifiers:MODULE) before it is stopped and counted as failed."""
    max_parallel: PositiveInt | None = None
    """Most agent episodes running at once (env.name=agent or verifiers:MODULE); the rest of the batch waits its turn.
    None: with a program per episode (env.agent_mode=episode), two per core this process may use, at most 32 (each is
    an interpreter; the run says what it picked); otherwise 32."""
    agent_mode: Literal["episode", "batch", "persistent", "serve"] = "episode"
    """env.name=agent: "episode" starts env.command once per episode; "batch" once per batch of episodes (a step's,
    an evaluation's), every episode's base URL, key and row in the JSONL file $LMRL_EPISODES names; "persistent"
    once per run, each batch's file path a line on its stdin. env.timeout is then the batch's. "serve": lmrl starts
    no program; programs you run ask for episodes at the gateway's /lmrl/work with the run key that
    <train.output_dir>/agent.json holds (docs/agents.md)."""
    agent_host: NonEmptyStr = "127.0.0.1"
    """env.agent_mode=serve: where the gateway listens. Beyond loopback it needs the run key set by you, in the
    LMRL_AGENT_KEY environment variable."""
    agent_port: Annotated[int, Field(ge=0, le=65535)] = 0
    """env.agent_mode=serve: the gateway's port; 0 takes a free one (agent.json and the log line say which)."""
    agent_url: NonEmptyStr | None = None
    """env.agent_mode=serve: the gateway as programs reach it (e.g. "http://trainer.lan:8123", a proxy's or a
    tunnel's), written into agent.json and every episode's base_url; None: the address it listens on."""
    max_turns: PositiveInt = 4
    """Most model turns per episode."""
    max_tokens: PositiveInt | None = None
    """Most response tokens per episode, observations included; None: max_turns x rollout.max_new_tokens."""
    tools: list[NonEmptyStr] = []
    """Tools of the "tools" environment: "python" (the built-in, sandboxed), "file.py:function", "module:function"."""
    tool_call_pattern: NonEmptyStr | None = None
    """Regex finding a tool call: a group `json` holding {"name", "arguments"}, or a group `name` with a group
    `arguments` (a JSON object) and / or one group per argument. None: Hermes / Qwen `<tool_call>{...}</tool_call>`."""
    response_format: NonEmptyStr = "<tool_response>\n{output}\n</tool_response>\n"
    """How a tool's output is shown to the model: a string with {output}, or "chat" (a `tool` message rendered
    with the chat template)."""

    @field_validator("tool_call_pattern")
    @classmethod
    def _pattern(cls, value: str | None) -> str | None:
        import re

        if value is None:
            return value
        try:
            groups = re.compile(value).groupindex
        except re.error as e:
            raise ValueError(f"not a valid regex ({e})") from None
        if "json" not in groups and "name" not in groups:
            raise ValueError("needs a group named json, or a group named name (and arguments, or one group per argument)")
        return value

    @field_validator("agent_url")
    @classmethod
    def _url(cls, value: str | None) -> str | None:
        import re

        if value is not None and not re.fullmatch(r"https?://[^/\s]+", value):
            raise ValueError(f"expected http://HOST:PORT or https://HOST:PORT (no path), got {value!r}")
        return value

    @field_validator("response_format")
    @classmethod
    def _format(cls, value: str) -> str:
        if value != "chat" and "{output}" not in value:
            raise ValueError(f'expected "chat" or a string with {{output}}, got {value!r}')
        return value

    @model_validator(mode="after")
    def _tools_need_the_tools_env(self) -> EnvConfig:
        if self.name == "tools" and not self.tools:
            raise ValueError('tools: the "tools" environment needs at least one tool, e.g. env.tools=[python]')
        if self.tools and self.name != "tools":
            raise ValueError("tools: tools are for env.name=tools")
        if self.agent_mode == "serve" and self.command:
            raise ValueError("command: env.agent_mode=serve starts no program (yours ask for work); drop env.command")
        if (self.agent_host != "127.0.0.1" or self.agent_port or self.agent_url) and self.agent_mode != "serve":
            raise ValueError("agent_host: env.agent_host, env.agent_port and env.agent_url are for env.agent_mode=serve")
        if self.name == "agent" and not self.command and self.agent_mode != "serve":
            raise ValueError('command: the "agent" environment needs env.command, e.g. env.command="python my_agent.py"')
        if self.command and self.name != "agent":
            raise ValueError("command: env.command is for env.name=agent")
        if self.agent_mode != "episode" and self.name != "agent":
            raise ValueError("agent_mode: env.agent_mode is for env.name=agent")
        return self


class SandboxConfig(Section):
    """Limits for model-written code (the `python` tool, the `code` reward); see `lmrl.sandbox`. The defaults
    are `lmrl.sandbox.SandboxLimits`'s."""

    timeout: PositiveFloat = SandboxLimits.timeout
    """Wall-clock seconds per program before it and everything it started are killed."""
    cpu_seconds: PositiveInt = SandboxLimits.cpu_seconds
    """CPU seconds per process (RLIMIT_CPU)."""
    memory_mb: PositiveInt = SandboxLimits.memory_mb
    """Address space per process in MiB (RLIMIT_AS); Python itself needs about 30."""
    processes: PositiveInt = SandboxLimits.processes
    """Processes a program may have at once, itself included (RLIMIT_NPROC; as root programs run as nobody)."""
    file_mb: PositiveInt = SandboxLimits.file_mb
    """Largest file a program may write, in MiB (RLIMIT_FSIZE)."""
    disk_mb: PositiveInt = SandboxLimits.disk_mb
    """Size of each program's private tmpfs work directory, in MiB."""
    open_files: PositiveInt = SandboxLimits.open_files
    """File descriptors per process (RLIMIT_NOFILE)."""
    output_bytes: PositiveInt = SandboxLimits.output_bytes
    """Bytes kept of stdout and of stderr each; a program that writes more is stopped."""
    max_parallel: PositiveInt = SandboxLimits.max_parallel
    """Programs run at once."""
    allow_network_fallback: bool = SandboxLimits.allow_network_fallback
    """Where namespaces are unavailable (no root, no unprivileged user namespaces), run model code anyway,
    without network, mount and pid isolation. Off: the run refuses to start with one line."""
    python: NonEmptyStr | None = SandboxLimits.python
    """Interpreter programs run with (standard library only). None: this Python, or /usr/bin/python3 when
    the sandbox user cannot read this one's files."""

    def limits(self) -> SandboxLimits:
        """These settings as `lmrl.sandbox.SandboxLimits`."""
        return SandboxLimits(**self.model_dump())

