"""tests/interpreted.py's background lane: a child runs once, whoever starts it (the lane or
its test), and its test sees its failure."""

import pytest

import interpreted


def test_a_child_runs_once_and_its_test_sees_its_output_or_its_failure(tmp_path):
    runs = tmp_path / "runs"
    code = f"open({str(runs)!r}, 'a').write('x'); print('first'); print('last')"
    ok = interpreted.Child(["-c", code], interpret=False)
    bad = interpreted.Child(["-c", "import sys; sys.exit('it broke')"])
    interpreted.start([ok, bad, ok])  # the lane's next, before the suite's own, if any
    assert ok.lines() == ["first", "last"]
    assert ok.lines() == ["first", "last"] and runs.read_text() == "x"  # run once
    with pytest.raises(AssertionError, match="it broke"):
        bad.lines()
    here = interpreted.run_child(["-c", "import os; print(os.environ['TRITON_INTERPRET'])"])
    assert here == ["1"]
