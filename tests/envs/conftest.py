"""Fixtures of the environment and agent tests."""

import pytest


@pytest.fixture(scope="module")
def policy():
    """The shipped calculator model and a generator over it (seed 0), once per module."""
    from lmrl.models.shipped import SHIPPED_MODELS, load_shipped
    from lmrl.rollout.hf import HFGenerator

    model, tok = load_shipped(SHIPPED_MODELS["tiny-calculator"])
    return HFGenerator(model, tok, seed=0), tok
