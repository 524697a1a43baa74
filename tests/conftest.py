import os
import sys

# One OpenMP thread a process, this one and every process it starts (set before torch is
# imported): the suite runs its interpreter lane, its ranks and its tests side by side on a
# 2-core runner, where a second thread only spins waiting for a busy core (an interpreter
# child: a quarter more CPU time on two threads here).
os.environ["OMP_NUM_THREADS"] = "1"

import torch  # noqa: E402

# tests/distributed.py is imported by the test modules and by spawned worker processes.
sys.path.insert(0, os.path.dirname(__file__))

import interpreted  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line("markers", "child(child): the test takes the lines of this "
                            "interpreted.Child, started on a background lane after collection")


def pytest_runtest_setup(item):
    """Each test starts on one torch thread, whatever an earlier one set (an in-process
    ``train`` sets its own; test_native sets 7 for its split kernels): two threads contending
    for a core the lane or the other ranks hold made the tests that compute in this process
    several times slower (test_device, test_analysis: 4-9x here)."""
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
