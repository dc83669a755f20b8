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


class JsonlSink:
    """Appends one JSON object per step: {"step": n, "time": unix seconds, metric: value, ...}."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("w", buffering=1)  # a new run starts a new file

    def log(self, metrics: dict[str, float], step: int) -> None:
        row = {"step": step, "time": round(time.time(), 3)}
        # JSON has no NaN / inf: write them as null rather than producing an unreadable file
        row.update({k: (v if isinstance(v, (int, float)) and math.isfinite(v) else None) for k, v in metrics.items()})
        self._file.write(json.dumps(row) + "\n")

    def close(self) -> None:
        self._file.close()


class TensorBoardSink:
    def __init__(self, log_dir: str | Path):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise ImportError("log.tensorboard=true needs TensorBoard: pip install 'lmrl[tensorboard]'") from e
        self._writer = SummaryWriter(str(log_dir))

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


def make_sinks(output_dir: str | Path, jsonl: bool, tensorboard: bool, wandb: bool, config: dict) -> list[MetricSink]:
    sinks: list[MetricSink] = []
    if jsonl:
        sinks.append(JsonlSink(Path(output_dir) / "metrics.jsonl"))
    if tensorboard:
        sinks.append(TensorBoardSink(Path(output_dir) / "tensorboard"))
    if wandb:
        sinks.append(WandbSink(output_dir, config))
    return sinks
