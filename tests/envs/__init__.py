from tests import forked


def python() -> str:
    """The `python` the agent programs of these tests run with: tests/forked.py's stand-in, each program a real
    process forked from one that has imported the official `openai` client (0.5 s of a fresh program's start)."""
    return forked.python(forked.AGENT)
