"""Where metrics go: one interface, several sinks. JSONL always; TensorBoard and W&B when installed and chosen."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Protocol


class MetricSink(Protocol):
    def log(self, metrics: dict[str, float], step: int) -> None: ...

    def close(self) -> None: ...


def jsonl_row(metrics: dict[str, float], step: int) -> dict:
    """{"step": n, "time": unix seconds, metric: value, ...}; JSON has no NaN / inf: they become null
    rather than an unreadable file."""
    row = {"step": step, "time": round(time.time(), 3)}
    row.update({k: (v if isinstance(v, (int, float)) and math.isfinite(v) else None) for k, v in metrics.items()})
    return row


class JsonlSink:
    """One JSON object per step (`jsonl_row`). A new run starts a new file; a resumed one starts it with
    the rows its checkpoint holds (`previous`), so the file never has a step twice."""

    def __init__(self, path: str | Path, previous: list[dict] | None = None):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("w", buffering=1)
        for row in previous or []:
            self._file.write(json.dumps(row) + "\n")

    def log(self, metrics: dict[str, float], step: int) -> None:
        self._file.write(json.dumps(jsonl_row(metrics, step)) + "\n")

    def close(self) -> None:
        self._file.close()


class TensorBoardSink:
    def __init__(self, log_dir: str | Path, purge_step: int | None = None):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise ImportError("log.tensorboard=true needs TensorBoard: pip install 'lmrl[tensorboard]'") from e
        self._writer = SummaryWriter(str(log_dir), purge_step=purge_step)  # a resumed run drops later events

    def log(self, metrics: dict[str, float], step: int) -> None:
        for k, v in metrics.items():
            self._writer.add_scalar(k, v, step)

    def close(self) -> None:
        self._writer.close()


class WandbSink:
    def __init__(self, run_dir: str | Path, config: dict):
        try:
            import wandb
        except ImportError as e:
            raise ImportError("log.wandb=true needs Weights & Biases: pip install 'lmrl[wandb]'") from e
        self._run = wandb.init(dir=str(run_dir), config=config)

    def log(self, metrics: dict[str, float], step: int) -> None:
        self._run.log(metrics, step=step)

    def close(self) -> None:
        self._run.finish()


def make_sinks(output_dir: str | Path, jsonl: bool, tensorboard: bool, wandb: bool, config: dict,
               previous: list[dict] | None = None, purge_step: int | None = None) -> list[MetricSink]:
    """The chosen sinks. A resumed run passes the rows its checkpoint holds (`previous`) and the first step it
    will log (`purge_step`), so that nothing logged after the checkpoint by the interrupted run remains."""
    sinks: list[MetricSink] = []
    if jsonl:
        sinks.append(JsonlSink(Path(output_dir) / "metrics.jsonl", previous))
    if tensorboard:
        sinks.append(TensorBoardSink(Path(output_dir) / "tensorboard", purge_step))
    if wandb:
        sinks.append(WandbSink(output_dir, config))
    return sinks
