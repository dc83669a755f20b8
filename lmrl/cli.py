"""`lmrl train | eval | report`: the command line."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import traceback
import warnings
from pathlib import Path

from lmrl import __version__
from lmrl.errors import LmrlError, print_line

EXAMPLES = """\
examples:
  lmrl train                                   GRPO on the shipped tiny model and addition task (a few minutes on a CPU)
  lmrl train algorithm=dapo train.steps=50     another algorithm, any field overridden with key=value
  lmrl train examples/gsm8k_qwen.yaml          a YAML config, then overrides on top
  lmrl train --help-config                     every config field with its default and meaning
  lmrl train --nproc 2 rollout.prompts_per_step=32
                                               one job on 2 processes (torchrun; docs/scaling.md)
  lmrl train train.save_every=50 train.resume=auto
                                               checkpoint every 50 steps; rerun the same command to resume
  lmrl eval --model runs/tiny-addition/final --task addition --k 8
  lmrl report runs/grpo runs/rloo              report.html: the two runs' curves overlaid, samples, configs
  lmrl eval runs/tiny-addition --k 8             a run's final model, with the run's own task and rewards
  lmrl eval --data heldout.jsonl --reward rw.py:exact --model runs/x/final
                                               any prompt file, scored by the reward functions given
"""


class _Parser(argparse.ArgumentParser):
    """argparse, with its usage errors as one `lmrl: error:` line like every other error."""

    def error(self, message: str):
        print(f"lmrl: error: {message} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(2)


def _at_least(low: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low} (got {value})")
        return value

    return parse


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0 (got {text})")
    return value


def main(argv: list[str] | None = None) -> int:
    code = _main(argv)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # a rank under torchrun ends here, its output flushed and its process group left: static destructors
        # run at a normal exit can abort ("terminate called without an active exception", seen about once in
        # 20 runs on a loaded machine) and turn a finished run's exit 0 into a SIGABRT
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _parser() -> argparse.ArgumentParser:
    """The command line: `lmrl train | train-rm | eval | report | serve`."""
    parser = _Parser(
        prog="lmrl", description="Reinforcement-learning post-training of language models.",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"lmrl {__version__}")
    sub = parser.add_subparsers(dest="command")

    tr = sub.add_parser("train", help="train a policy", epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    tr.add_argument("args", nargs="*", help="an optional CONFIG.yaml, then key=value overrides")
    tr.add_argument("--help-config", action="store_true", help="list every config field and exit")
    tr.add_argument("--dry-run", action="store_true", help="validate and print the config, then exit")
    tr.add_argument("--nproc", type=_at_least(1), default=None, metavar="N",
                    help="train on N processes of this machine (torchrun --standalone --nproc_per_node N)")

    rm = sub.add_parser("train-rm", help="train a reward model on preference pairs (chosen / rejected)",
                        epilog=RM_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    rm.add_argument("args", nargs="*", help="an optional CONFIG.yaml, then key=value overrides")
    rm.add_argument("--help-config", action="store_true", help="list every config field and exit")
    rm.add_argument("--nproc", type=_at_least(1), default=None, metavar="N",
                    help="train on N processes of this machine (torchrun --standalone --nproc_per_node N)")

    ev = sub.add_parser("eval", help="held-out accuracy and pass@k of a model on a task or dataset", epilog=EXAMPLES,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    ev.add_argument("run", nargs="?", default=None,
                    help="a run directory: evaluate its final/ model with the run's own task (or data) and rewards")
    ev.add_argument("--model", default=None, help="model directory or hub id (default: the run's final/, else 'tiny-addition')")
    ev.add_argument("--task", default=None, help="built-in task name (default: the model's own: digits for tiny-vision, calculator for tiny-calculator; else addition)")
    ev.add_argument("--data", default=None,
                    help="evaluate every row of this file (.jsonl / .json / .parquet, a save_to_disk directory, a hub name)")
    ev.add_argument("--split", default=None, help="the split of --data, when it has splits (a DatasetDict, a hub dataset)")
    ev.add_argument("--reward", action="append", default=None,
                    help="a reward function for --data, as in reward.functions: math, exact_match, rw.py:fn, ... (repeatable)")
    ev.add_argument("--k", type=_at_least(1), default=1, help="samples per prompt for pass@k (temperature sampling)")
    ev.add_argument("--temperature", type=_positive_float, default=1.0, help="sampling temperature of pass@k")
    ev.add_argument("--num-prompts", type=_at_least(1), default=200, help="held-out prompts to evaluate")
    ev.add_argument("--max-new-tokens", type=_at_least(1), default=None, help="longest completion in tokens")

    rp = sub.add_parser("report", help="write report.html: curves, samples and config of one or several runs")
    rp.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run directories; several overlay their curves")
    rp.add_argument("--out", default=None,
                    help="the HTML file to write (default: RUN_DIR/report.html for one run, ./report.html for several)")

    sv = sub.add_parser("serve", help="serve a model for generation: OpenAI completions and lmrl's weight sync",
                        epilog=SERVE_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    sv.add_argument("args", nargs="*", help="an optional CONFIG.yaml, then key=value overrides (model.*, rollout.*)")
    sv.add_argument("--host", default="127.0.0.1", help="the address to listen on (0.0.0.0: every interface)")
    sv.add_argument("--port", type=int, default=8000, help="the port (0: any free one; the ready line says which)")
    sv.add_argument("--api-key", default=None, metavar="KEY",
                    help="wanted from every request as 'Authorization: Bearer KEY' (better: the LMRL_API_KEY environment "
                         "variable, which other users cannot read in the process list); needed beyond loopback")
    sv.add_argument("--weights-secret", default=None, metavar="SECRET",
                    help="wanted from a weight push as the X-Lmrl-Weights-Secret header (better: LMRL_WEIGHTS_SECRET); "
                         "without one, the server takes no weights (an inference server)")
    sv.add_argument("--max-body-mb", type=_positive_float, default=8.0, help="the largest JSON request body, in MB")
    sv.add_argument("--max-n", type=_at_least(0), default=64, help="the most completions per prompt (n); 0: no limit")
    sv.add_argument("--max-sequences", type=_at_least(0), default=2048,
                    help="the most sequences (prompts x n) of one request; 0: no limit")

    for p in (tr, rm, ev, rp, sv):
        p.add_argument("--traceback", action="store_true",
                       help="on an error, print the full Python traceback (or set LMRL_TRACEBACK=1)")

    return parser


def _main(argv: list[str] | None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    try:
        if args.command == "train":
            return _train(args)
        if args.command == "train-rm":
            return _train_rm(args)
        if args.command == "report":
            return _report(args)
        if args.command == "serve":
            return _serve(args)
        return _eval(args)
    except (LmrlError, ValueError, OSError, ImportError) as e:
        # what a user can act on is one line, not a traceback (--traceback shows it)
        if args.traceback or os.environ.get("LMRL_TRACEBACK", "") not in ("", "0"):
            traceback.print_exc()
        line = _one_line(e)
        if getattr(e, "every_rank", False) and os.environ.get("RANK", "0") != "0":
            return e.exit_code  # every rank raised it (stopped after the same checkpoint, ...): rank 0 says so
        if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not line.startswith("rank "):  # under torchrun: which rank
            line = f"rank {os.environ.get('RANK', '?')}: {line}"
        print_line(f"lmrl: error: {line}")
        return getattr(e, "exit_code", 2)
    except KeyboardInterrupt:  # lmrl eval, or train before its loop installs its own handler
        print("lmrl: interrupted", file=sys.stderr)
        return 130
    finally:
        _leave_process_group()


def _leave_process_group() -> None:
    """Under torchrun, leave the process group before exiting (its threads stop with it). A single process leaves
    alone the group a vLLM engine made for itself: the engine leaves it as it shuts down."""
    if "torch.distributed" in sys.modules and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


SERVE_EXAMPLES = """examples:
  lmrl serve                                           the shipped model, a vLLM engine, on 127.0.0.1:8000
  lmrl serve model.name_or_path=./my-model --host 0.0.0.0 --port 8000
  lmrl serve model.name_or_path=./my-model rollout.backend=lmrl    lmrl's decode instead of vLLM
  lmrl train rollout.backend=vllm-server rollout.vllm.server_url=http://gpu-node:8000
"""


def _serve(args) -> int:
    """A generation server (`lmrl.rollout.server`) until SIGINT / SIGTERM; prints the ready line first."""
    from lmrl.config import load_config
    from lmrl.rollout.remote import READY, die_with_parent
    from lmrl.rollout.server import GenerationServer, Limits, check_exposure

    die_with_parent()
    api_key = args.api_key or os.environ.get("LMRL_API_KEY") or None
    secret = args.weights_secret or os.environ.get("LMRL_WEIGHTS_SECRET") or None
    check_exposure(args.host, api_key)  # before the model loads
    cfg = load_config(*_config_source(args))
    from lmrl.generators import serving_generator

    served = serving_generator(cfg)
    generator = served.generator
    limits = Limits(max_body_bytes=int(args.max_body_mb * 2**20), max_n=args.max_n, max_sequences=args.max_sequences,
                    max_prompt_length=cfg.rollout.max_prompt_length, max_new_tokens=cfg.rollout.max_new_tokens,
                    context=served.context, vocab_size=served.vocab_size, max_weights_bytes=served.push_bytes)
    server = GenerationServer(generator, served.tokenizer, cfg.model.name_or_path, host=args.host, port=args.port,
                              api_key=api_key, weights_secret=secret, limits=limits,
                              tool_format=cfg.model.tool_call_format)
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown, daemon=True).start())
    print(READY + server.url, flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        getattr(generator, "close", lambda: None)()
    return 0


def _config_source(args) -> tuple[str | None, list[str]]:
    """`train` / `serve`'s positional arguments: an optional CONFIG.yaml first, then key=value overrides."""
    overrides = list(args.args)
    path = overrides.pop(0) if overrides and "=" not in overrides[0] else None
    return path, overrides


def _train(args) -> int:
    from lmrl.config import config_summary, describe_fields, load_config

    if args.help_config:
        print(describe_fields())
        return 0
    cfg = load_config(*_config_source(args))  # fails here, before any model loads
    if cfg.asynchronous and "torch" not in sys.modules:  # OpenMP reads it once, as torch loads
        # two processes share the cores: OpenMP threads that wait sleep instead of spinning on a core the other
        # process needs (measured on 2 cores: docs/async.md)
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    if args.nproc and args.nproc > 1 and not args.dry_run and "WORLD_SIZE" not in os.environ:
        from lmrl.distributed import World

        World(rank=0, size=args.nproc).shard(cfg.rollout.prompts_per_step)  # one line here, not one per rank
        _exec_torchrun(args)
    main_rank = os.environ.get("RANK", "0") == "0"  # under torchrun, rank 0 alone prints and checks the directory
    if main_rank:
        print("resolved config:\n" + _indent(config_summary(cfg)))
    from lmrl.build import SlowBf16Warning, slow_bf16_warning

    if (note := slow_bf16_warning(cfg)) is not None and main_rank:
        print_line(f"lmrl: warning: {note}")
    if args.dry_run:  # a run prints these when it starts
        from lmrl.config import config_warnings

        for line in config_warnings(cfg):
            print_line(f"lmrl: warning: {line}")
        return 0
    from lmrl.checkpoint import RunLock, plan_run

    # a directory in use or holding a run, or a resume that cannot work, fails before any model loads
    # (the trainer checks both again, holding the lock); a directory that does not exist is not made here,
    # so that a run refused before training leaves nothing behind
    if main_rank and Path(cfg.train.output_dir).is_dir():
        with RunLock(cfg.train.output_dir):
            plan_run(cfg)
    elif main_rank:
        plan_run(cfg)
    from lmrl.trainer import Trainer

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SlowBf16Warning)  # printed above, once
        trainer = Trainer(cfg)
    result = trainer.train()
    if result.evals and main_rank:
        first, last = result.evals[0], result.evals[-1]
        kept, best = "", result.output_dir / "best"
        if cfg.train.keep_best and (best / "best.json").is_file():  # train.keep_best: the evaluation it kept
            b = json.loads((best / "best.json").read_text())
            kept = f"; best {b['eval/accuracy']:.1%} at step {b['step']} saved to {best}"
        print(f"held-out accuracy: {first['eval/accuracy']:.1%} -> {last['eval/accuracy']:.1%} "
              f"in {last['time/elapsed']:.0f} s; model saved to {result.output_dir / 'final'}{kept}")
    return 0


RM_EXAMPLES = """examples:
  lmrl train-rm data.path=pairs.jsonl model.name_or_path=Qwen/Qwen2.5-0.5B train.output_dir=runs/rm
                                               a reward model from a causal LM (a new score head)
  lmrl train-rm rm.yaml data.eval_fraction=0.1 held-out pair accuracy as it trains
  lmrl train-rm --help-config                  every field with its default and meaning
then score with it:  reward.functions=[{fn: reward_model, path: runs/rm/final}]
"""


def _train_rm(args) -> int:
    from lmrl.config import load_reward_config

    if args.help_config:
        from lmrl.config.describe import describe_fields

        print(describe_fields(_reward_config_type()))
        return 0
    cfg = load_reward_config(*_config_source(args))  # fails here, before any model loads
    from lmrl.checkpoint import RunLock, plan_run

    main_rank = os.environ.get("RANK", "0") == "0"
    if main_rank and Path(cfg.train.output_dir).is_dir():  # a directory in use or holding a run: before any model loads
        with RunLock(cfg.train.output_dir):
            plan_run(cfg)
    elif main_rank:
        plan_run(cfg)
    if args.nproc and args.nproc > 1 and "WORLD_SIZE" not in os.environ:
        _exec_torchrun(args, "train-rm")
    from lmrl.reward_trainer import RewardTrainer

    result = RewardTrainer(cfg).train()
    last = result.evals[-1] if result.evals else None
    held = f"held-out pair accuracy {last['eval/accuracy']:.1%}; " if last else ""
    if main_rank:
        print(f"{held}reward mean {result.stats['mean']:.3f} std {result.stats['std']:.3f}; "
              f"model saved to {result.output_dir / 'final'}")
    return 0


def _reward_config_type():
    from lmrl.config import RewardTrainingConfig

    return RewardTrainingConfig


def _eval(args) -> int:
    from lmrl.config import build_config
    from lmrl.errors import DataError
    from lmrl.trainer import Trainer

    raw, source = _eval_config(args)
    cfg = build_config(raw)
    inputs = _verifiers_eval(cfg)
    if inputs:
        source = f"{args.run}'s environment's tasks ({cfg.env.name})"
    trainer = Trainer(cfg, console=False, **inputs)
    rows = trainer.data.eval_rows
    if not rows:  # (a file without rows stops in the loader, naming it)
        raise DataError(f"{source}: nothing to evaluate: {_why_no_eval_rows(cfg)}")
    result = trainer.evaluate()
    line = f"accuracy (greedy) {result['eval/accuracy']:.1%}  mean reward {result['eval/reward']:.3f}"
    if args.k > 1:
        pk = trainer.pass_at_k(args.k, args.temperature)
        line += f"  pass@{args.k} (T={args.temperature}) {pk:.1%}"
    print(f"{len(rows)} prompts of {source}: {line}")
    return 0


def _report(args) -> int:
    from lmrl.report import write_report

    path = write_report(args.runs, args.out)
    print(f"wrote {path} (open it in a browser: it needs no server and no network)")
    return 0


def _eval_config(args) -> tuple[dict, str]:
    """The config `lmrl eval` evaluates with, and the name of the prompts' source for its lines."""
    from lmrl.config import read_yaml
    from lmrl.errors import ConfigError

    if args.data is None and args.reward:
        raise ConfigError("--reward: reward functions apply to --data FILE (a task and a run bring their own)")
    if args.run is not None:
        run = Path(args.run)
        if not (run / "lmrl_config.yaml").is_file():
            raise ConfigError(f"{args.run}: not a run directory (no lmrl_config.yaml in it)")
        if args.model is None and not (run / "final").is_dir():
            raise ConfigError(f"{args.run}: the run has no final/ model (it did not finish); "
                              "give a checkpoint with --model DIR/checkpoint-N")
        raw = read_yaml(run / "lmrl_config.yaml")
        raw["model"] = {**raw.get("model", {}), "name_or_path": args.model or str(run / "final"), "lora": None}
        for section in ("train", "optim"):
            raw.pop(section, None)  # the run's steps, output directory and optimizer play no part here
        if (raw.get("algorithm") or {}).get("teacher"):  # nor a distillation's teacher: not loaded, not needed
            raw["algorithm"] = {**raw["algorithm"], "teacher": None}
        source = f"{args.run}'s held-out prompts"
    else:
        raw = {"model": {"name_or_path": args.model or "tiny-addition"}}
        source = f"task {args.task or _preset_task(raw['model']['name_or_path'])}"
    if args.task and (args.data or args.run):
        raise ConfigError("--task: give a task, --data or a run directory, not several")
    data = dict(raw.get("data") or {})
    if args.data is not None:
        if args.run is None and not args.reward:
            raise ConfigError("--reward: evaluating --data needs a reward function, e.g. --reward exact_match "
                              "or --reward rewards.py:my_reward")
        split = args.split or "test"  # a plain file has no splits and ignores it
        data = {"task": None, "path": args.data, "split": split, "eval_path": args.data, "eval_split": split}
        source = args.data + (f":{args.split}" if args.split else "")
        if args.reward:  # they replace the run's functions or recipes
            raw["reward"] = {**(raw.get("reward") or {}), "functions": args.reward, "recipes": {}}
        elif not any((raw.get("reward") or {}).get(key) for key in ("functions", "recipes")):
            raise ConfigError(f"--reward: {args.run} was scored by its task's own reward "
                              f"(data.task={(raw.get('data') or {}).get('task')}); give --reward for --data")
    elif args.run is not None and str(data.get("path") or "").startswith("<"):
        raise ConfigError(f"{args.run}: the run's prompts were passed from Python ({data['path']}); "
                          "evaluate a file with --data FILE")
    elif args.split:
        raise ConfigError("--split: a split of --data FILE; give --data too")
    elif args.run is None:
        data = {"task": args.task or _preset_task(raw["model"]["name_or_path"])}
    raw["data"] = {**data, "num_eval_prompts": args.num_prompts}
    raw["log"] = {"console": False, "jsonl": False}
    if args.max_new_tokens:
        raw["rollout"] = {**(raw.get("rollout") or {}), "max_new_tokens": args.max_new_tokens}
    return raw, source


def _preset_task(model: str) -> str:
    """The built-in task a shipped model is made for (its preset's data.task: `digits` for tiny-vision), else
    addition."""
    from lmrl.config.presets import MODEL_PRESETS

    return MODEL_PRESETS.get(model, {}).get("data", {}).get("task", "addition")


def _verifiers_eval(cfg) -> dict:
    """A verifiers run's prompts to evaluate: its environment's tasks, as `load_environment()` gives them now (a
    verifiers Env has one taskset, no held-out split); greedy episodes through its own rollout and rubric."""
    if not (cfg.env.name or "").startswith("verifiers:") or cfg.data.path is not None or cfg.data.eval_path is not None:
        return {}
    from lmrl.build import make_environment

    env = make_environment(cfg)
    return {"env": env, "eval_dataset": env.rows()}


def _why_no_eval_rows(cfg) -> str:
    d = cfg.data
    if d.path is not None and d.eval_path is None:
        return "it has no held-out prompts (data.eval_path is unset); evaluate a file with --data FILE"
    return "every row was left out (data.on_bad_row=skip)"


def _exec_torchrun(args, command: str = "train") -> None:
    """Become `torchrun --standalone --nproc_per_node N -m lmrl.cli COMMAND ARGS` (this process is replaced, so
    signals reach torchrun, which passes them to every rank). torchrun kills the ranks `--shutdown_timeout`
    seconds (30 by default) after passing a signal on; they get 10 minutes to finish the step and its checkpoint."""
    from torch.distributed.run import get_args_parser

    options = {o for action in get_args_parser()._actions for o in action.option_strings}
    grace = ["--shutdown_timeout=600"] if "--shutdown_timeout" in options else []  # (an option of recent torchruns)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}", *grace,
           "-m", "lmrl.cli", command, *args.args, *(["--traceback"] if args.traceback else [])]
    sys.stdout.flush()
    os.execv(sys.executable, cmd)


def _one_line(e: BaseException) -> str:
    if isinstance(e, OSError) and not isinstance(e, LmrlError) and e.filename is not None:
        return f"{e.filename}: {e.strerror or e}"  # a disk error: the path and what the system said
    return " ".join(str(e).split())


def _indent(text: str) -> str:
    return "\n".join("  " + line for line in text.splitlines())


if __name__ == "__main__":
    sys.exit(main())
