"""Test-wide settings. Property tests are derandomized so that CI runs the same examples every time:
a failure is reproducible, never a flake that lands on one run and not the next."""

from hypothesis import settings

settings.register_profile("lmrl", derandomize=True, deadline=None, print_blob=True)
settings.load_profile("lmrl")
