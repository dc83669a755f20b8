"""`python tests/fault_driver.py FAULT STEP lmrl-train-args...`: `lmrl train` with one fault injected at a
named point of step STEP, as a real process that a real signal stops or kills (tests/test_long_runs.py).

Faults:
    sigterm-in-generation   SIGTERM to itself while step STEP generates (the step is abandoned)
    sigint-in-update        SIGINT to itself inside step STEP's update (the step finishes first)
    sigint-twice            two SIGINTs inside step STEP's update (the second exits at once)
    kill-after-state        SIGKILL once checkpoint-STEP's model / optimizer state is written
    kill-mid-model          SIGKILL with checkpoint-STEP's model.safetensors half written
    kill-before-rename      SIGKILL with checkpoint-STEP complete (COMPLETE written) but not yet renamed
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import lmrl.checkpoint as checkpoint
import lmrl.lifecycle as lifecycle
import lmrl.trainer as trainer
from lmrl.cli import main


def _kill() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def inject(fault: str, step: int) -> None:
    T = trainer.Trainer
    if fault == "sigterm-in-generation":
        collect = T.collect

        def faulty_collect(self, s):
            if s == step:
                os.kill(os.getpid(), signal.SIGTERM)
            return collect(self, s)

        T.collect = faulty_collect
    elif fault in ("sigint-in-update", "sigint-twice"):
        update, calls = T.update, [0]

        def faulty_update(self, exp):
            calls[0] += 1
            if calls[0] == step:
                for _ in range(2 if fault == "sigint-twice" else 1):
                    os.kill(os.getpid(), signal.SIGINT)
            return update(self, exp)

        T.update = faulty_update
    elif fault == "kill-after-state":
        save = lifecycle.save_model_state

        def faulty_save(directory, *args):
            save(directory, *args)
            if Path(directory).parent.name.startswith(f".tmp-checkpoint-{step}-"):
                _kill()

        lifecycle.save_model_state = faulty_save
    elif fault == "kill-mid-model":
        L = lifecycle.RunLifecycle
        files = L._save_model_files

        def faulty_files(self, directory, final=False):
            files(self, directory, final)
            if directory.name.startswith(f".tmp-checkpoint-{step}-"):
                weights = directory / "model.safetensors"
                weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
                _kill()

        L._save_model_files = faulty_files
    elif fault == "kill-before-rename":
        write = checkpoint._write_synced

        def faulty_write(path, text):
            write(path, text)
            if path.name == checkpoint.COMPLETE and path.parent.name.startswith(f".tmp-checkpoint-{step}-"):
                _kill()

        checkpoint._write_synced = faulty_write
    else:
        raise SystemExit(f"unknown fault {fault!r}")


if __name__ == "__main__":
    inject(sys.argv[1], int(sys.argv[2]))
    sys.exit(main(["train", *sys.argv[3:]]))
