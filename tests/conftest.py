import os
import sys

# tests/distributed.py is imported by the test modules and by spawned worker processes.
sys.path.insert(0, os.path.dirname(__file__))

import interpreted  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line("markers", "child(child): the test takes the lines of this "
                            "interpreted.Child, started on a background lane after collection")


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
