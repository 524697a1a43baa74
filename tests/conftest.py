import os
import sys

import torch

# tests/distributed.py is imported by the test modules and by spawned worker processes.
sys.path.insert(0, os.path.dirname(__file__))

import interpreted  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line("markers", "child(child): the test takes the lines of this "
                            "interpreted.Child, started on a background lane after collection")


def pytest_runtest_setup(item):
    """Each test starts on one torch thread (one that wants more sets them itself, as
    test_native does): the other core of a 2-core runner runs the interpreter lane or the
    other ranks, and two intra-op threads contending for one core made the tests that
    compute in this process several times slower (test_device, test_analysis: 4-9x)."""
    torch.set_num_threads(1)


def pytest_collection_modifyitems(items):
    """The tests that take an interpreter child run last, in their order: by then the lane
    has run most of their children beside the rest of the suite, so no test in between
    waits on the lane or runs a child of the lane's share itself."""
    items.sort(key=lambda item: item.get_closest_marker("child") is not None)


def pytest_collection_finish(session):
    """The selected tests' interpreter children, queued on the background lane in the
    tests' order (it runs them from the last: tests/interpreted.py); none for a test skipped
    by a true ``skipif``."""
    if not session.config.option.collectonly:
        interpreted.start(mark.args[0] for item in session.items
                          if not any(m.args and m.args[0] is True
                                     for m in item.iter_markers("skipif"))
                          for mark in item.iter_markers("child"))


def pytest_sessionfinish(session):
    interpreted.stop()
