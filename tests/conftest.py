"""Test-wide settings.

Property tests are derandomized so that CI runs the same examples every time: a failure is reproducible,
never a flake that lands on one run and not the next.

The `device` fixture runs a test once per device this machine has: on the CPU always, and on CUDA too
where a GPU is present (`scripts/gpu_run.sh` runs the suite there). Tests that take it are the ones
where a device changes what can go wrong (placement, generators, dtypes); the header pytest prints says
which devices ran.
"""

import gc
import os
import sys


def _share_the_cores() -> None:
    """An xdist worker takes its share of the cores for torch's threads, and so do the processes it starts (the
    environment). Two workers each spinning two OpenMP threads on two cores made a file of small decodes 6x slower
    (55 s against 8.5 s) and the whole suite 6%: a thread that waits for its partner spins on a core the other
    worker needs."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers and "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = str(max(1, len(os.sched_getaffinity(0)) // workers))


_share_the_cores()  # before torch is imported: it reads OMP_NUM_THREADS then

import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import settings  # noqa: E402

settings.register_profile("lmrl", derandomize=True, deadline=None, print_blob=True)
settings.load_profile("lmrl")

DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]


def pytest_report_header(config):
    if len(DEVICES) == 1:
        return "lmrl devices: cpu (no CUDA here: the tests that take `device` ran on the CPU only)"
    return f"lmrl devices: {', '.join(DEVICES)} ({torch.cuda.get_device_name()})"


# The files that take longest (worker-seconds on 2 EPYC cores, 2026-11-29: 45, 28, 26, 24, 24, 22, 21, 18, 17, 17,
# 16, 15, 14), run first: pytest-xdist's --dist loadfile hands out files in collection order, so a long file collected
# last ran alone at the end while the other worker idled (34 s of the suite's 408); `make test` passes
# --no-loadscope-reorder, or xdist would order files by their number of tests. The rest keep their order.
SLOWEST_FIRST = [
    "tests/rollout/test_vllm_engine.py", "tests/test_benchmarks.py", "tests/envs/test_agent.py",
    "tests/rollout/test_vllm_server.py", "tests/docs/test_examples.py", "tests/test_distributed.py",
    "tests/test_streamed.py", "tests/test_async_rollouts.py", "tests/docs/test_site.py", "tests/test_multinode.py",
    "tests/test_long_runs.py", "tests/models/test_vision_train.py", "tests/test_supported_models.py",
]


def pytest_collection_modifyitems(config, items):
    rank = {path: i for i, path in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # stable: the rest as collected


_frozen_at = [0]  # how many modules were imported at the last freeze
_unfreeze = gc.unfreeze
_unfrozen = [False]  # whether something asked for the heap to be unfrozen since the last freeze


def _unfreeze_after_the_test() -> None:
    """`gc.unfreeze` in a worker: vLLM's engine unfreezes the whole heap as it shuts down, and its next start-up
    collects three times before it freezes the heap again: five full collections an engine (0.45 s each here: 26 s
    of `tests/rollout/test_vllm_engine.py`'s 71 s). The unfreeze waits for the end of the test (below): vLLM's own
    collections then skip what is frozen, and what the engine left in reference cycles is freed once, after it."""
    _unfrozen[0] = True


gc.unfreeze = _unfreeze_after_the_test


@pytest.hookimpl(trylast=True)
def pytest_runtest_logfinish(nodeid, location):
    """What imports made stays for the whole run: frozen (`gc.freeze`), Python's full collections skip it. They
    scanned it every time, 0.5 s each: 50 s of one worker's 410 s in 89 of them. Frozen again after a test that
    imported much more (vLLM: 3,000 modules) or asked for an unfreeze (above), garbage collected first so that what
    is frozen is alive (a frozen object is still freed when nothing refers to it; one in a reference cycle is not).
    Not on `gc.get_freeze_count()`: it walks the frozen objects, 60 ms a call, which cost every test that much."""
    if _unfrozen[0]:
        _unfreeze()
        _unfrozen[0] = False
    elif len(sys.modules) <= _frozen_at[0] + 200:
        return
    gc.collect()
    gc.freeze()
    _frozen_at[0] = len(sys.modules)


@pytest.fixture(params=DEVICES)
def device(request) -> torch.device:
    return torch.device(request.param)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """A pytest-xdist worker ends here, its results already sent to the main process: with `os._exit`, not the
    interpreter's shutdown, which kept the last worker busy for about 30 s after its last test (in C, freeing what
    torch, transformers and vLLM built) while the main process waited for it."""
    _unfreeze()  # what the run froze is freed at exit (else nanobind, vLLM's, names what it finds leaked)
    if hasattr(config, "workerinput"):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
