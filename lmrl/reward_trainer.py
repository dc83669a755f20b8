"""`lmrl train-rm` / `lmrl.RewardTrainer`: a reward model trained on preference pairs (Bradley-Terry).

    trainer = RewardTrainer(RewardTrainingConfig(data={"path": "pairs.jsonl"}, train={"output_dir": "runs/rm"}))
    trainer.train()          # runs/rm/final: loadable by `{fn: reward_model, path: runs/rm/final}`

A step, as TRL's RewardTrainer takes it, with these departures:

1. The model is `AutoModelForSequenceClassification(num_labels=1)` of any causal LM (a new score head, drawn
   with train.seed) or of a reward model; `pad_token_id` is set so that it pools each row's last real token.
2. Each pair is rendered, tokenized and cut exactly as `RewardModelScorer` scores (`lmrl.data.pairs`), chosen and
   rejected in one forward: the trained model is asked the very ids it learned on. The tokens a pair's two sides start
   with are computed once for both (train.share_prompt, Llama / Qwen2), not twice as in TRL's right-padded batch.
3. The loss and metrics are `lmrl.algorithms.bradley_terry_loss` / `preference_metrics`; micro-batches of one
   step divide by the step's pair count, so gradient accumulation equals one big batch.
4. The order of pairs is a pure function of (seed, step), so a resumed run trains on what the interrupted
   one would have; dropout is off (TRL's `disable_dropout`), so a step is a function of weights and data.
5. In final/, beside the model, the run writes `reward_stats.json`: the trained model's reward mean and std over the
   training pairs, for scoring that normalises.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from lmrl.algorithms import bradley_terry_loss, preference_metrics
from lmrl.checkpoint import (
    RunLock,
    all_finite,
    atomic_directory,
    clear_run,
    load_model_state,
    plan_run,
    remove_partial,
    rng_state,
    save_model_state,
    set_rng_state,
)
from lmrl.config.describe import config_to_yaml
from lmrl.config.reward_training import RewardTrainingConfig
from lmrl.data.pairs import EncodedPairs, Pairs, encode_pairs, load_pairs
from lmrl.distributed import World, init_world
from lmrl.errors import Interrupted, LmrlError, ModelError, RunError, print_line
from lmrl.logging.console import Console
from lmrl.logging.sinks import jsonl_row, make_sinks
from lmrl.models.loading import (
    DTYPES,
    disable_dropout,
    dropout_as_loaded,
    quiet_progress_bars,
    resolve_device,
)
from lmrl.models.shared_prompt import shared_prefix_rewards
from lmrl.models.shipped import SHIPPED_MODELS
from lmrl.rewards.reward_model import encode_scored, pad_right

STATS_FILE = "reward_stats.json"
_EPOCH_STRIDE = 1_000_003  # distinct seeds never share an epoch's order (as lmrl.data.prompts)


@dataclass
class RewardTrainResult:
    """What a run did: its directory, steps, every metrics row, the evaluations and the final reward stats."""

    output_dir: Path
    steps: int = 0
    history: list[dict[str, float]] = field(default_factory=list)
    evals: list[dict[str, float]] = field(default_factory=list)
    stats: dict[str, float] = field(default_factory=dict)


class RewardTrainer:
    """Trains a reward model on preference pairs. `cfg` is a `RewardTrainingConfig` or its dict; `train_pairs` /
    `eval_pairs` (lists of row dicts) replace data.path / data.eval_path; `model` and `tokenizer` replace
    model.name_or_path (a sequence-classification model with num_labels=1)."""

    def __init__(self, cfg: RewardTrainingConfig | dict[str, Any] | None = None, *, train_pairs: list | None = None,
                 eval_pairs: list | None = None, model: torch.nn.Module | None = None, tokenizer: Any = None,
                 console: bool | None = None) -> None:
        raw = cfg.model_dump() if isinstance(cfg, RewardTrainingConfig) else dict(cfg or {})
        if train_pairs is not None:  # the config stays valid and says where the pairs came from
            raw["data"] = {**raw.get("data", {}), "path": "<train_pairs>"}
        self.cfg = cfg = RewardTrainingConfig(**raw)
        d, t = cfg.data, cfg.train
        if t.threads:
            torch.set_num_threads(t.threads)
        # 1. the pairs, checked before any model loads
        self.pairs = self._read(train_pairs, d.path, d.split, "data.path")
        held = self._read(eval_pairs, d.eval_path, d.eval_split, "data.eval_path") if (
            eval_pairs is not None or d.eval_path) else None
        # 2. the model and tokenizer; under torchrun, this rank's device
        self.world: World = init_world()
        self.device = torch.device(self.world.device) if self.world.distributed else resolve_device(cfg.model.device)
        self.tokenizer = tokenizer if tokenizer is not None else _load_tokenizer(cfg)
        self.model = (model if model is not None else _load_model(cfg, self.tokenizer)).to(self.device)
        self.pad_id = _set_pad(self.model, self.tokenizer)
        disable_dropout(self.model)
        # 3. token ids, exactly as the scorer encodes them; the held-out draw
        encoded = encode_pairs(self.pairs.pairs, self.tokenizer, d.max_length, d.on_too_long, "data.path")
        self.train_set, self.eval_set = _split(encoded, d.eval_fraction, t.seed)
        if held is not None:
            self.eval_set = encode_pairs(held.pairs, self.tokenizer, d.max_length, d.on_too_long, "data.eval_path")
        self.notes = _data_notes(self.pairs, encoded, held)
        # 4. the optimizer and schedule
        params = [p for p in self.model.parameters() if p.requires_grad]
        o = cfg.optim
        # one fused kernel per parameter (as lmrl.build.make_optimizer, and TRL's default adamw_torch_fused)
        fused = bool(params) and all(p.device.type in ("cpu", "cuda") for p in params)
        self.optimizer = torch.optim.AdamW(params, lr=o.lr, weight_decay=o.weight_decay, betas=o.betas, fused=fused or None)
        warm = o.warmup_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: min(1.0, (s + 1) / (warm + 1)))
        self.per_step = t.batch_size * t.gradient_accumulation_steps
        self.steps_per_epoch = math.ceil(len(self.train_set) / self.per_step)
        self.total_steps = t.steps or t.epochs * self.steps_per_epoch
        self.out = Path(t.output_dir)
        self.console_on = (cfg.log.console if console is None else console) and self.world.main
        self.result = RewardTrainResult(self.out)
        self.saved_step = 0  # the last checkpoint's step

    # ------------------------------------------------------------------------------------ the model's rewards
    def rewards(self, chosen: list[list[int]], rejected: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """[b] rewards of the chosen and the rejected sides: one forward of the 2b sequences, each pair's common start
        computed once (train.share_prompt, where the model allows), else right-padded whole."""
        scores = shared_prefix_rewards(self.model, chosen, rejected) if self.cfg.train.share_prompt else None  # [2b]
        if scores is None:
            input_ids, attention_mask = pad_right([*chosen, *rejected], self.pad_id)  # [2b, L]
            logits = self.model(input_ids=input_ids.to(self.device), attention_mask=attention_mask.to(self.device),
                                use_cache=False).logits
            scores = logits.view(-1)  # [2b, 1] -> [2b]
        return scores[: len(chosen)], scores[len(chosen) :]

    @torch.no_grad()
    def score(self, prompts: list[Any], completions: list[str]) -> list[float]:
        """The trained model's reward of each (prompt, completion), encoded as the scorer encodes it."""
        limit = self.cfg.data.max_length if self.cfg.data.on_too_long == "truncate" else None
        ids = [encode_scored(self.tokenizer, p, c, limit) for p, c in zip(prompts, completions, strict=True)]
        input_ids, attention_mask = pad_right(ids, self.pad_id)
        logits = self.model(input_ids=input_ids.to(self.device), attention_mask=attention_mask.to(self.device)).logits
        return logits.view(-1).float().cpu().tolist()

    # ---------------------------------------------------------------------------------------------- the loop
    def train(self) -> RewardTrainResult:
        """Train train.steps (or train.epochs) optimizer steps, evaluating and checkpointing as configured; write
        OUTPUT/final and OUTPUT/final/reward_stats.json."""
        t, log = self.cfg.train, self.cfg.log
        main = self.world.main
        self.out.mkdir(parents=True, exist_ok=True)
        with RunLock(self.out) if main else contextlib.nullcontext():
            start = self._begin()
            self.saved_step = start
            sinks = make_sinks(self.out, log.jsonl, False, False, {}, previous=self.result.history) if main else []
            console = Console(self.console_on, self.total_steps, log.every)
            try:
                with console, _started(), self._signals():
                    console.start_at(start)
                    for line in self.notes if main else []:
                        print_line(line)
                    for step in range(start + 1, self.total_steps + 1):
                        tic = time.perf_counter()
                        metrics = self.train_step(step)  # 1-3. forward, loss, update
                        metrics["time/step"] = time.perf_counter() - tic
                        if self.eval_set and ((t.eval_every and step % t.eval_every == 0) or step == self.total_steps):
                            metrics |= self.evaluate()  # 4. held-out pairs
                            self.result.evals.append({"step": step, **metrics})
                        self._log(sinks, console, metrics, step)
                        if t.save_every and step % t.save_every == 0:
                            self.save_checkpoint(step)  # 5. checkpoint
                        if self._stopping():
                            raise self._interrupted(step)
            finally:
                for sink in sinks:
                    sink.close()
            with _started():
                self.result.steps = self.total_steps
                self.result.stats = self.reward_stats()
                self.save(self.out / "final")
        return self.result

    def train_step(self, step: int) -> dict[str, float]:
        """One optimizer step over the step's pairs, in micro-batches of train.batch_size; returns its metrics."""
        t, o = self.cfg.train, self.cfg.optim
        self.model.train()
        indices = self.step_indices(step)
        mine = _share(indices, self.world)  # under torchrun: this rank's contiguous part of the step's pairs
        chosen_all, rejected_all = [torch.zeros(0)], [torch.zeros(0)]
        for start in range(0, len(mine), t.batch_size):
            batch = self.train_set.subset(mine[start : start + t.batch_size])
            chosen, rejected = self.rewards(batch.chosen, batch.rejected)
            margin = torch.tensor(batch.margins, device=self.device) if batch.has_margin else None
            loss = bradley_terry_loss(chosen, rejected, margin, t.center_rewards_coefficient, normalizer=len(indices))
            loss.backward()  # the step's loss is the sum of its micro-batches' (normalizer: the step's pairs)
            chosen_all.append(chosen.detach().float().cpu())
            rejected_all.append(rejected.detach().float().cpu())
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.world.sum_gradients(params)  # each rank's loss divided by the step's pairs: the sum is the step's gradient
        norm = torch.nn.utils.clip_grad_norm_(params, o.max_grad_norm if o.max_grad_norm else math.inf)
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        if not all_finite([self.model]):  # one fused norm: a step that broke the model stops here, not steps later
            raise RunError(f"step {step}: the weights are not finite after the update (optim.lr={o.lr:g} too high?); "
                           f"the run stops ({self._last_good()})")
        # the whole step's rewards, every rank's in rank order: the step's order
        chosen, rejected = (torch.cat(self.world.gather(torch.cat(xs))) for xs in (chosen_all, rejected_all))
        margins = torch.tensor(self.train_set.subset(indices).margins) if self.train_set.has_margin else None
        with torch.no_grad():
            total = bradley_terry_loss(chosen, rejected, margins, t.center_rewards_coefficient)
        if not math.isfinite(total.item()):  # before it is logged as a plausible number, or checkpointed
            raise RunError(f"step {step}: the loss is not finite; the run stops ({self._last_good()})")
        return {"rm/loss": total.item(), **preference_metrics(chosen, rejected).as_dict("rm/"),
                "rm/grad_norm": float(norm), "rm/lr": lr, "rm/epoch": (step - 1) / self.steps_per_epoch}

    def step_indices(self, step: int) -> list[int]:
        """The training pairs of `step` (1-based): a pure function of (seed, step), so a resumed run draws them too."""
        epoch, k = divmod(step - 1, self.steps_per_epoch)
        g = torch.Generator().manual_seed(self.cfg.train.seed * _EPOCH_STRIDE + epoch)
        order = torch.randperm(len(self.train_set), generator=g).tolist()
        return order[k * self.per_step : (k + 1) * self.per_step]

    @torch.no_grad()
    def evaluate(self, pairs: EncodedPairs | None = None, prefix: str = "eval/") -> dict[str, float]:
        """Loss and pair metrics over the held-out pairs (or `pairs`)."""
        pairs = pairs if pairs is not None else self.eval_set
        chosen, rejected = self._all_rewards(pairs)
        margin = torch.tensor(pairs.margins) if pairs.has_margin else None
        loss = bradley_terry_loss(chosen, rejected, margin, self.cfg.train.center_rewards_coefficient)
        return {f"{prefix}loss": loss.item(), **preference_metrics(chosen, rejected).as_dict(prefix)}

    @torch.no_grad()
    def reward_stats(self) -> dict[str, float]:
        """The trained model's reward mean and std over every training pair's two sides (both scored)."""
        chosen, rejected = self._all_rewards(self.train_set)
        m = preference_metrics(chosen, rejected)
        return {"mean": m.reward_mean, "std": m.reward_std, "accuracy": m.accuracy, "pairs": len(self.train_set)}

    def _all_rewards(self, pairs: EncodedPairs) -> tuple[torch.Tensor, torch.Tensor]:
        self.model.eval()
        size = self.cfg.train.batch_size
        parts = [self.rewards(pairs.chosen[i : i + size], pairs.rejected[i : i + size]) for i in range(0, len(pairs), size)]
        return torch.cat([c.float().cpu() for c, _ in parts]), torch.cat([r.float().cpu() for _, r in parts])

    # ------------------------------------------------------------------------------ saving and resuming
    def save(self, directory: str | Path) -> None:
        """A directory `RewardModelScorer.from_pretrained` loads (model, tokenizer, lmrl_config.yaml, reward_stats.json),
        written atomically."""
        if not all_finite([self.model]):
            raise RunError(f"{directory}: the weights are not finite; refusing to save them")
        stats = self.result.stats or self.reward_stats()
        stats |= {"max_length": self.cfg.data.max_length if self.cfg.data.on_too_long == "truncate" else None}
        with atomic_directory(Path(directory), self.world) as tmp:
            if self.world.main:
                self._save_model_files(tmp)
                (tmp / STATS_FILE).write_text(json.dumps(stats, indent=1) + "\n")
                self._check_saved(tmp, Path(directory))

    def _check_saved(self, directory: Path, target: Path) -> None:
        """The saved directory encodes and pools as the trainer did: its tokenizer gives the first pair's ids, and its
        config the pad id that marks the last real token. A model that would score other ids than it learned on is
        refused here, in one line, rather than found later as plausible rewards of the wrong texts."""
        from transformers import AutoConfig, AutoTokenizer

        saved_pad = AutoConfig.from_pretrained(directory).pad_token_id
        if saved_pad != self.pad_id:
            raise RunError(f"{target}: the saved config's pad_token_id is {saved_pad}, the trainer pooled by "
                           f"{self.pad_id}; the scorer would read other tokens as each text's last")
        if not self.pairs.pairs:
            return
        pair, tokenizer = self.pairs.pairs[0], AutoTokenizer.from_pretrained(directory)
        limit = self.cfg.data.max_length if self.cfg.data.on_too_long == "truncate" else None
        if encode_scored(tokenizer, pair.prompt, pair.chosen, limit) != encode_scored(
                self.tokenizer, pair.prompt, pair.chosen, limit):
            raise RunError(f"{target}: its tokenizer encodes {pair.where} otherwise than the trainer's did; the "
                           "scorer would be asked other token ids than the model learned on")

    def _save_model_files(self, directory: Path) -> None:
        with quiet_progress_bars(), dropout_as_loaded(self.model):  # the config's dropout as the user gave it
            if hasattr(self.model, "peft_config"):  # the adapters and the score head, then the merged model
                self.model.save_pretrained(directory / "adapter")
                self.model = self.model.merge_and_unload()  # the end of the run: what it scores from now on
            self.model.save_pretrained(directory)
        self.tokenizer.save_pretrained(directory)
        (directory / "lmrl_config.yaml").write_text(config_to_yaml(self.cfg))

    def save_checkpoint(self, step: int) -> Path:
        """The weights, optimizer, schedule and RNGs after `step`, checksummed (`lmrl.checkpoint`)."""
        path = self.out / f"checkpoint-{step}"
        if not all_finite([self.model]):
            raise RunError(f"step {step}: the weights are not finite (optim.lr={self.cfg.optim.lr:g} too high?); "
                           "no checkpoint written")
        state = {"step": step, "scheduler": self.scheduler.state_dict(), "evals": self.result.evals}
        with atomic_directory(path, self.world) as tmp:  # every rank writes its RNGs; the state is a collective
            save_model_state(tmp / "state", {"model": self.model}, self.optimizer)
            torch.save(rng_state({}), tmp / f"rng_state_{self.world.rank}.pt")
            if not self.world.main:
                self.saved_step = step
                return path
            (tmp / "trainer_state.json").write_text(json.dumps(state, indent=1) + "\n")
            (tmp / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in self.result.history))
            (tmp / "lmrl_config.yaml").write_text(config_to_yaml(self.cfg))
        self.saved_step = step
        return path

    @contextlib.contextmanager
    def _signals(self):
        """SIGINT / SIGTERM stop the run after the step in progress, with its checkpoint; a second one exits at once."""
        self.stop_signal = None
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def on_signal(signum: int, frame) -> None:
            name = signal.Signals(signum).name
            if self.stop_signal is not None:
                print_line(f"lmrl: {name} again: exiting now, without a checkpoint")
                os._exit(128 + signum)
            self.stop_signal = signum
            if self.world.main:
                print_line(f"lmrl: {name} received: stopping after this step's checkpoint ({name} again to exit at once)")

        previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
        for s in previous:
            signal.signal(s, on_signal)
        try:
            yield
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)

    def _stopping(self) -> bool:
        """A signal asked the run to stop; under torchrun the ranks agree after each step, so they stop together."""
        if self.world.distributed:
            self.stop_signal = self.world.most(self.stop_signal or 0) or None
        return self.stop_signal is not None

    def _interrupted(self, step: int) -> Interrupted:
        path = self.out / f"checkpoint-{step}"
        if self.saved_step != step:
            path = self.save_checkpoint(step)
        name = signal.Signals(self.stop_signal).name
        return Interrupted(f"{name}: stopped after step {step}; checkpoint {path} written; add train.resume=auto "
                           "to the same command to continue", self.stop_signal)

    def _last_good(self) -> str:
        if self.saved_step:
            return f"the last checkpoint is {self.out / f'checkpoint-{self.saved_step}'}"
        return "no checkpoint was written"

    def _begin(self) -> int:
        """Under the run's lock: clean partial checkpoints, clear an overwritten run or resume; returns the step
        to continue after."""
        main = self.world.main
        if main:
            remove_partial(self.out)
        plan = plan_run(self.cfg)  # train.resume / train.overwrite, as `lmrl train` plans them
        for line in plan.warnings if main else []:
            print_line(f"lmrl: warning: {line}")
        self.world.barrier()  # every rank planned before rank 0 changes anything
        if plan.clear and main:
            clear_run(self.out)
        step = 0
        if plan.checkpoint is not None:
            path = plan.checkpoint
            load_model_state(path / "state", {"model": self.model}, self.optimizer)
            state = json.loads((path / "trainer_state.json").read_text())
            self.scheduler.load_state_dict(state["scheduler"])
            rng = path / f"rng_state_{self.world.rank}.pt"
            set_rng_state(torch.load(rng if rng.is_file() else path / "rng_state_0.pt", weights_only=True), {})
            self.result.history = [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()
                                   if line.strip()]
            self.result.evals = list(state["evals"])
            step = int(state["step"])
        if main:
            (self.out / "lmrl_config.yaml").write_text(config_to_yaml(self.cfg))
        return step

    def _log(self, sinks: list, console: Console, metrics: dict[str, float], step: int) -> None:
        metrics = {k: float(v) for k, v in metrics.items()}
        self.result.history.append(jsonl_row(metrics, step))
        for sink in sinks:
            sink.log(metrics, step)
        console.step(step, metrics)

    def _read(self, rows: list | None, path: str | None, split: str, key: str) -> Pairs:
        d = self.cfg.data
        source = rows if rows is not None else path
        return load_pairs(source, split=split, prompt_column=d.prompt_column, margin_column=d.margin_column,
                          on_bad_row=d.on_bad_row, field=key, name="train_pairs" if key == "data.path" else "eval_pairs")


# -------------------------------------------------------------------------------------------------- helpers
def _model_path(cfg: RewardTrainingConfig) -> str:
    name = cfg.model.name_or_path
    return str(SHIPPED_MODELS[name]) if name in SHIPPED_MODELS else name


def _load_tokenizer(cfg: RewardTrainingConfig) -> Any:
    from transformers import AutoTokenizer

    path = _model_path(cfg)
    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=cfg.model.trust_remote_code)
    except (OSError, ValueError) as e:
        raise ModelError(f"model.name_or_path: cannot load tokenizer {path!r}: {_first_line(e)}") from e


def _load_model(cfg: RewardTrainingConfig, tokenizer: Any) -> torch.nn.Module:
    """`AutoModelForSequenceClassification(num_labels=1)`; a causal LM gets a new score head drawn with train.seed."""
    from transformers import AutoModelForSequenceClassification

    path, m = _model_path(cfg), cfg.model
    kwargs: dict[str, Any] = {"num_labels": 1, "trust_remote_code": m.trust_remote_code,
                              "dtype": "auto" if m.dtype == "auto" else DTYPES[m.dtype]}
    torch.manual_seed(cfg.train.seed)  # the new head's weights
    try:
        with quiet_progress_bars(), _quiet_new_head():
            model = AutoModelForSequenceClassification.from_pretrained(path, **kwargs)
    except (OSError, ValueError) as e:
        raise ModelError(f"model.name_or_path: cannot load {path!r} as a reward model: {_first_line(e)}") from e
    if m.lora is not None:
        from lmrl.models.lora import apply_lora

        model = apply_lora(model, m.lora, task_type="SEQ_CLS")  # the score head trains in full
    return model


@contextlib.contextmanager
def _quiet_new_head():
    """transformers warns that the score head is newly initialised: that is what training it is for."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


def _set_pad(model: torch.nn.Module, tokenizer: Any) -> int:
    """The pad id the model pools by (config.pad_token_id): the tokenizer's pad, else its EOS."""
    if getattr(model.config, "num_labels", 1) != 1:
        raise ModelError(f"model: a reward model needs num_labels=1, got {model.config.num_labels}")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad is None:
        raise ModelError("model.name_or_path: the tokenizer has neither a pad nor an EOS token")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.config.pad_token_id = int(pad)
    return int(pad)


@contextlib.contextmanager
def _started():
    """Inside, the run has started: an error it raises exits 1, not 2 (docs/bad-inputs.md)."""
    try:
        yield
    except LmrlError as e:
        if not isinstance(e, Interrupted):  # a signal's exit code says which signal
            e.exit_code = 1
        raise


def _share(indices: list[int], world: World) -> list[int]:
    """This rank's contiguous part of `indices` (the first ranks take one more when they do not split evenly)."""
    per, extra = divmod(len(indices), world.size)
    start = world.rank * per + min(world.rank, extra)
    return indices[start : start + per + (world.rank < extra)]


def _split(encoded: EncodedPairs, fraction: float, seed: int) -> tuple[EncodedPairs, EncodedPairs | None]:
    """Training pairs and the held-out fraction, drawn with `seed`."""
    if fraction <= 0:
        return encoded, None
    n_eval = max(1, round(len(encoded) * fraction))
    if n_eval >= len(encoded):
        raise RunError(f"data.eval_fraction={fraction}: holds out all {len(encoded)} pairs; nothing is left to train on")
    order = torch.randperm(len(encoded), generator=torch.Generator().manual_seed(seed)).tolist()
    return encoded.subset(sorted(order[n_eval:])), encoded.subset(sorted(order[:n_eval]))


def _data_notes(pairs: Pairs, encoded: EncodedPairs, held: Pairs | None) -> list[str]:
    notes = []
    if pairs.skipped:
        notes.append(f"lmrl: warning: data.path: {len(pairs.skipped)} bad rows left out (data.on_bad_row=skip), "
                     f"the first: {pairs.skipped[0].where}: {pairs.skipped[0].problem}")
    if encoded.too_long:
        notes.append(f"lmrl: warning: data.path: {encoded.too_long} pairs longer than data.max_length left out "
                     "(data.on_too_long=skip)")
    if encoded.truncated:
        notes.append(f"data.path: {encoded.truncated} pairs cut to their last data.max_length tokens")
    return notes


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__
