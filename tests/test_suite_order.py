"""The suite's own scheduling (tests/conftest.py): the files it runs first exist, and run first."""

from pathlib import Path

from tests.conftest import SLOWEST_FIRST, pytest_collection_modifyitems

ROOT = Path(__file__).resolve().parents[1]


def test_the_files_run_first_exist():
    assert [p for p in SLOWEST_FIRST if not (ROOT / p).is_file()] == []  # a renamed file would just run late


def test_the_slowest_files_are_collected_first(pytestconfig):
    class Item:
        def __init__(self, nodeid):
            self.nodeid = nodeid

    items = [Item("tests/test_cli.py::a"), Item(f"{SLOWEST_FIRST[1]}::b"), Item("tests/test_cli.py::c"),
             Item(f"{SLOWEST_FIRST[0]}::d")]
    pytest_collection_modifyitems(pytestconfig, items)
    assert [i.nodeid[-1] for i in items] == ["d", "b", "a", "c"]
