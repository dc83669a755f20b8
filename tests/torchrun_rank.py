"""A rank of `tests.forked.torchrun`, forked from the launcher (torchrun's `--run-path`):

    torchrun_rank.py ARGS...                    `lmrl ARGS...`, as `python -m lmrl` runs under torchrun
    torchrun_rank.py --driver OUT NAMES...      `tests/dist_driver.py OUT NAMES...`

It returns where `lmrl.cli.main` (and the driver) end a rank with `os._exit`: a forked worker must return to
torchrun's wrapper, which hands the rank's result to the agent; the worker then ends with `os._exit` all the same,
as every forked worker does, so no static destructor runs."""

import sys
from pathlib import Path

import torch

if __name__ == "__main__":  # not when a process a rank spawns imports this file as its main module
    if sys.argv[1:2] == ["--driver"]:
        from tests.dist_driver import main

        main(Path(sys.argv[2]), sys.argv[3:])
        code = 0
    else:
        from lmrl.cli import _main

        code = _main(sys.argv[1:])
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    raise SystemExit(code)
