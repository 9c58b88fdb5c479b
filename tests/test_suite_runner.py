"""`./pdserve test` (testing/suite.py): the whole suite goes parallel then serial; a run that picks its
own tests or workers is passed to pytest as it is."""

from __future__ import annotations

import pytest

from testing.suite import _selects_itself


@pytest.mark.parametrize("args", [[], ["-q", "-p", "no:cacheprovider", "--durations=30", "-rfE"], ["-k", "engine"],
                                  ["-x", "--timeout", "60"]])
def test_the_whole_suite_runs_in_two_phases(args: list[str]) -> None:
    assert not _selects_itself(args)


@pytest.mark.parametrize("args", [["tests/test_engine.py"], ["-q", "tests/test_engine.py::test_x"], ["tests"],
                                  ["-m", "quick"], ["-n", "4"], ["-n4"], ["--numprocesses=3"]])
def test_a_run_that_picks_its_tests_is_one_pytest_run(args: list[str]) -> None:
    assert _selects_itself(args)
