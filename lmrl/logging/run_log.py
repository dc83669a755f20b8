"""What a run writes about itself while it trains: each step's metrics (metrics.jsonl and the chosen sinks), lines
on the console, the sample tables (samples.jsonl) and, at the end, report.html (`lmrl.report`). Rank 0 writes;
the other ranks' calls do nothing."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from lmrl.errors import print_line
from lmrl.logging.console import Console
from lmrl.logging.sinks import jsonl_row, make_sinks


class RunLog:
    """The run's record and console. `rows` holds every metrics row written, as metrics.jsonl holds them (a
    checkpoint keeps them, so a resumed run's file never has a step twice).

    Args:
        out: the run's output directory.
        console: the live console (`lmrl.logging.Console`).
        main: this process is rank 0, the one that writes.
        log: the config's `log` section (which sinks).
    """

    def __init__(self, out: Path, console: Console, main: bool, log: Any):
        self.out, self.console, self.main, self.cfg = out, console, main, log
        self.rows: list[dict[str, Any]] = []
        self.sinks: list[Any] = []

    @contextlib.contextmanager
    def open(self, start_step: int, config: dict[str, Any]) -> Iterator[None]:
        """The sinks, open while inside (a resumed run's continue its curves after `start_step`); at the end, also
        after a signal or a failure, they close and report.html is written."""
        if self.main:
            self.sinks = make_sinks(self.out, self.cfg.jsonl, self.cfg.tensorboard, self.cfg.wandb, config,
                                    previous=self.rows, purge_step=start_step + 1 if start_step else None)
        try:
            yield
        finally:
            for sink in self.sinks:
                sink.close()
            self.sinks = []
            self.write_report()

    def log(self, metrics: dict[str, float], step: int) -> dict[str, float]:
        """One step's metrics to every sink and the console; returns them as floats."""
        metrics = {k: float(v) for k, v in metrics.items()}
        self.rows.append(jsonl_row(metrics, step))
        for sink in self.sinks:
            sink.log(metrics, step)
        self.console.step(step, metrics)
        return metrics

    def samples(self, step: int, prompts: list[str], completions: list[str], scores: list[float],
                advantages: list[float], extra: dict[str, list[Any]]) -> None:
        """A table of sample completions on the console, and in samples.jsonl for `lmrl report`."""
        self.console.samples(step, prompts, completions, scores, advantages, extra)
        if not (self.main and self.cfg.jsonl):
            return
        with (self.out / "samples.jsonl").open("a") as f:
            for i, (p, c, s, a) in enumerate(zip(prompts, completions, scores, advantages)):
                row = {"step": step, "prompt": p, "completion": c, "score": s, "advantage": a}
                row |= {name: values[i] for name, values in extra.items()}
                f.write(json.dumps(row, default=str) + "\n")

    def write_report(self) -> None:
        """report.html in the output directory (`lmrl.report`), from the files the run wrote; a report that
        cannot be written is a warning, never the run's failure."""
        if not (self.main and self.cfg.jsonl):
            return
        from lmrl.report import write_report

        try:
            write_report([self.out])
        except Exception as e:  # noqa: BLE001 - the run's result stands without its report
            print_line(f"lmrl: warning: {self.out / 'report.html'} not written: {type(e).__name__}: {e}")

    def note(self, line: str) -> None:
        """A line about how the run runs (rank 0 alone), printed even without the live console."""
        if not self.main:
            return
        if self.console.enabled:
            self.console.print(line, markup=False, highlight=False)
        else:
            print(line, flush=True)

    def warn(self, line: str) -> None:
        if not self.main:
            return
        if self.console.enabled:
            self.console.print(f"lmrl: warning: {line}", style="yellow", markup=False, highlight=False)
        else:
            print_line(f"lmrl: warning: {line}")
