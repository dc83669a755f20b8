"""`python -m lmrl ...` is the `lmrl` command (also under torchrun: `torchrun --nproc_per_node 2 -m lmrl train`)."""

from lmrl.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
