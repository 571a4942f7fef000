"""The budgets themselves (tests/launches.py), in a child pytest session: a launching test
without the `launch` marker fails, a launching fixture marks its users, a session over the launch
budget fails with the per-file table, a file over its seconds is named and fails nothing, and the
table adds up the same under pytest-xdist. No training runs: `LEDGER.record` is what run_loom calls."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest_plugins = ["pytester"]

HERE = Path(__file__).resolve().parent

INNER = '''
import pytest
from launches import LEDGER, launching_fixture


@launching_fixture(scope="session")
def shared_run():
    LEDGER.record(2)  # what run_loom does for a `loom train` that launched two runs (a sweep)
    return "ran"


def test_uses_the_fixture(shared_run):
    assert shared_run == "ran"


@pytest.mark.launch
def test_marked():
    LEDGER.record(1)


def test_unmarked_launch():
    LEDGER.record(1)


def test_refusal_only():
    LEDGER.record(0)  # a CLI call that trained nothing: no marker needed
'''


def _session(pytester: pytest.Pytester, budget: int, *args: str, seconds: str = "") -> pytest.RunResult:
    pytester.makeconftest("from launches import *  # noqa: F401,F403\n")
    pytester.makepyfile(test_inner=INNER)
    (pytester.path / "budget.toml").write_text(f"[launches]\nmax = {budget}\n{seconds}")
    pytester.syspathinsert(HERE)
    return pytester.runpytest_subprocess("-p", "no:cacheprovider", *args)


def test_unmarked_launch_fails_and_fixtures_mark_their_users(pytester, monkeypatch):
    monkeypatch.setenv("LOOM_LAUNCH_BUDGET", str(pytester.path / "budget.toml"))
    monkeypatch.setenv("PYTHONPATH", str(HERE))
    r = _session(pytester, 10)
    r.assert_outcomes(passed=3, failed=1)
    # the unmarked test's launch happened (it is counted), and the test failed for it
    r.stdout.fnmatch_lines(["*test_unmarked_launch*not marked `launch`*",
                            "*test_inner.py * 4 * 4 * 1 *", "launches: 4 of a budget of 10*"])
    quick = _session(pytester, 10, "-m", "not launch")  # the quick loop: fixture users and marked tests out
    quick.assert_outcomes(passed=1, failed=1, deselected=2)


def test_a_session_over_budget_fails_naming_the_budget(pytester, monkeypatch):
    monkeypatch.setenv("LOOM_LAUNCH_BUDGET", str(pytester.path / "budget.toml"))
    monkeypatch.setenv("PYTHONPATH", str(HERE))
    r = _session(pytester, 2, "-k", "not unmarked")
    r.assert_outcomes(passed=3, deselected=1)
    assert r.ret == 1
    r.stdout.fnmatch_lines(["launches: 3 of a budget of 2*", "*FAILED: 3 training launches exceed the budget of 2*"])
    assert _session(pytester, 3, "-k", "not unmarked").ret == 0


def test_a_file_over_its_seconds_is_named_and_fails_nothing(pytester, monkeypatch):
    monkeypatch.setenv("LOOM_LAUNCH_BUDGET", str(pytester.path / "budget.toml"))
    monkeypatch.setenv("PYTHONPATH", str(HERE))
    r = _session(pytester, 10, "-k", "not unmarked", seconds='[seconds]\n"test_inner.py" = 0\n')
    assert r.ret == 0
    r.stdout.fnmatch_lines(["file * tests * launches * cli calls * seconds * budget",
                            "test_inner.py * 3 * 3 * 1 * 0  OVER",
                            "load average (1, 5, 15 min): * at the start, * at the end; * cores",
                            "over its budget: test_inner.py took * s of 0 s (a report, not a failure*"])
    roomy = _session(pytester, 10, "-k", "not unmarked", seconds='[seconds]\n"test_inner.py" = 600\n')
    assert roomy.ret == 0 and "over its budget" not in roomy.stdout.str() and "OVER" not in roomy.stdout.str()
    roomy.stdout.fnmatch_lines(["test_inner.py * 3 * 3 * 1 * 600"])


def test_under_xdist_the_table_adds_up_the_workers_reports(pytester, monkeypatch):
    """`-n 2` (the quick tier): the tests run in two worker processes, the table is the serial one's."""
    monkeypatch.setenv("LOOM_LAUNCH_BUDGET", str(pytester.path / "budget.toml"))
    monkeypatch.setenv("PYTHONPATH", str(HERE))
    r = _session(pytester, 10, "-n", "2")
    r.assert_outcomes(passed=3, failed=1)
    r.stdout.fnmatch_lines(["*test_unmarked_launch*not marked `launch`*",
                            "test_inner.py * 4 * 4 * 1 *", "no budget of seconds in budget.toml: test_inner.py",
                            "launches: 4 of a budget of 10*"])
    assert _session(pytester, 3, "-n", "2").ret == 1  # over the launch budget, from the workers' reports


def test_conftest_registers_every_hook_of_the_budgets():
    """conftest.py imports the hooks by name (a non-root conftest cannot use pytest_plugins): one left
    out is silently not run (a report without the ledger's records counted no launch at all)."""
    import conftest
    import launches

    hooks = {name for name in vars(launches) if name.startswith("pytest_")}
    assert hooks and hooks <= set(vars(conftest)), hooks - set(vars(conftest))
