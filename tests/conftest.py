"""Test-wide settings.

Property tests are derandomized so that CI runs the same examples every time: a failure is reproducible,
never a flake that lands on one run and not the next.

The `device` fixture runs a test once per device this machine has: on the CPU always, and on CUDA too
where a GPU is present (`scripts/gpu_run.sh` runs the suite there). Tests that take it are the ones
where a device changes what can go wrong (placement, generators, dtypes); the header pytest prints says
which devices ran.
"""

import pytest
import torch
from hypothesis import settings

settings.register_profile("lmrl", derandomize=True, deadline=None, print_blob=True)
settings.load_profile("lmrl")

DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]


def pytest_report_header(config):
    if len(DEVICES) == 1:
        return "lmrl devices: cpu (no CUDA here: the tests that take `device` ran on the CPU only)"
    return f"lmrl devices: {', '.join(DEVICES)} ({torch.cuda.get_device_name()})"


@pytest.fixture(params=DEVICES)
def device(request) -> torch.device:
    return torch.device(request.param)
