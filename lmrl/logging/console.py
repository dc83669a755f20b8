"""The live console: a progress bar with ETA, one metrics line per step, sample tables."""

from __future__ import annotations

from rich.console import Console as RichConsole
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

# (metric key, short label, format) shown on each step's line, when present
STEP_LINE = [
    ("objective/scores", "reward", "{:.3f}"),
    ("eval/accuracy", "eval acc", "{:.1%}"),
    ("objective/kl", "kl", "{:.4f}"),
    ("distill/reverse_kl", "rkl", "{:.4f}"),  # on-policy distillation: per token, toward 0 as the student learns
    ("policy/entropy_avg", "entropy", "{:.3f}"),
    ("policy/clipfrac_avg", "clipfrac", "{:.3f}"),
    ("loss/policy_avg", "loss", "{:+.4f}"),
    ("val/response_length", "len", "{:.1f}"),
    ("rm/loss", "loss", "{:.4f}"),  # a reward model's run (lmrl train-rm)
    ("rm/accuracy", "acc", "{:.1%}"),
    ("rm/margin", "margin", "{:+.3f}"),
    ("eval/loss", "eval loss", "{:.4f}"),
    ("async/staleness_mean", "stale", "{:.2f}"),  # an asynchronous run: versions behind the policy being updated
    ("time/step", "s/step", "{:.2f}"),
]


class Console:
    def __init__(self, enabled: bool = True, total_steps: int = 0, every: int = 1):
        self.enabled, self.every = enabled, max(1, every)
        self.rich = RichConsole(stderr=False, highlight=False)
        self.progress = Progress(
            TextColumn("[bold]train"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("steps"),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            console=self.rich,
            transient=True,
            disable=not enabled,
        )
        self._task = self.progress.add_task("train", total=total_steps)

    def __enter__(self) -> Console:
        self.progress.start()
        return self

    def __exit__(self, *exc) -> None:
        self.progress.stop()

    def start_at(self, step: int) -> None:
        """A resumed run's progress starts where its checkpoint was."""
        self.progress.update(self._task, completed=step)

    def print(self, *args, **kwargs) -> None:
        """Print above the progress bar. Into a file or pipe (a log, a scheduler's output) a line stays one line,
        however long: rich would wrap it at 80 columns, splitting what a reader greps for."""
        if self.enabled:
            kwargs.setdefault("soft_wrap", not self.rich.is_terminal)
            self.progress.console.print(*args, **kwargs)

    def step(self, step: int, metrics: dict[str, float]) -> None:
        self.progress.update(self._task, completed=step)
        if step % self.every and "eval/accuracy" not in metrics:
            return
        parts = [f"step {step:>4}"]
        for key, label, fmt in STEP_LINE:
            if key in metrics:
                parts.append(f"{label} {fmt.format(metrics[key])}")
        self.print("  ".join(parts))

    def samples(self, step: int, prompts: list[str], completions: list[str], scores: list[float],
                advantages: list[float], extra: dict[str, list] | None = None) -> None:
        """A table of sample completions; `extra` adds a column per name (the reward functions' log_extra)."""
        extra = extra or {}
        table = Table(title=f"samples at step {step}", show_lines=True)
        table.add_column("prompt", overflow="fold", max_width=40)
        table.add_column("completion", overflow="fold", max_width=60)
        table.add_column("score", justify="right")
        table.add_column("advantage", justify="right")
        for name in extra:
            table.add_column(name, overflow="fold", max_width=30)
        for i, (p, c, s, a) in enumerate(zip(prompts, completions, scores, advantages)):
            table.add_row(p, c, f"{s:.3f}", f"{a:+.3f}", *(str(values[i]) for values in extra.values()))
        self.print(table)
