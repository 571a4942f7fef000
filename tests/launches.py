"""The suite's budgets (tests/budget.toml): every `loom train` that trains goes through
`tests/launches.py`, which counts it against the test that caused it, and every test file's
seconds are added up. The session ends with a per-file table: tests, launches, CLI calls, seconds
and the file's budget of seconds, then the files over their budget, the machine's load average
at the session's start and end, and the launch total against its budget.

Why a count for launches: a count is the same on any machine, so its budget cannot drift silently,
and exceeding it fails the session. Why seconds are only reported: a busy machine is slower, and
a suite must not fail for the load beside it (issue 49); the table names a file over its budget so
the commit that made it slower says why, and raises that file's budget with the reason.

A test that launches is marked `launch`: tests using a launching fixture (`launching_fixture`)
are marked at collection; a test that launches without the marker fails, so `-m "not launch"`
(the quick loop) can never start a training process.

Under pytest-xdist (`-n N`, the quick tier) the tests run in worker processes: each test report
carries what its phase recorded (`user_properties`), and the table is added up from the reports,
in whichever process prints it.
"""

from __future__ import annotations

import os
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import pytest

BUDGET_FILE = Path(__file__).resolve().parent / "budget.toml"
LAUNCHING_FIXTURES: set[str] = set()
SLOWEST = 15  # launches named in the session's summary, slowest first
PROPERTY = "loom_ledger"  # the report property that carries a phase's records


@dataclass
class Ledger:
    """Launches, CLI calls, tests and seconds per test file; the item running now; what this
    process recorded since its last report (`pending`)."""

    current: pytest.Item | None = None
    launches: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    cli_calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    tests: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    timed: list[tuple[float, str, str]] = field(default_factory=list)  # (seconds, test, arguments)
    pending: list[tuple[str, int, float | None, str, str]] = field(default_factory=list)
    load_at_start: str = ""

    def file_of_current(self) -> str:
        return self.current.nodeid.split("::")[0] if self.current else "(no test)"

    def record(self, launches: int, seconds: float | None = None, args: tuple[str, ...] = ()) -> None:
        """`launches` training runs started by the current test (0: a CLI call that trained nothing);
        `seconds`: how long the command took, when it ran to its end here."""
        where = self.file_of_current()
        test = self.current.nodeid if self.current else where
        self.pending.append((where, launches, seconds, test, " ".join(args)))
        item = self.current
        if launches and item is not None and item.get_closest_marker("launch") is None:
            pytest.fail(f"{item.nodeid} starts a training run but is not marked `launch`: add "
                        "@pytest.mark.launch (or use a fixture made with launching_fixture)", pytrace=False)

    def drain(self) -> list[list]:
        out, self.pending = [list(p) for p in self.pending], []
        return out

    def add(self, records: list[list]) -> None:
        """A report's records into the session's totals."""
        for where, launches, seconds, test, args in records:
            if not launches:
                self.cli_calls[where] += 1
                continue
            self.launches[where] += launches
            if seconds is not None:
                self.timed.append((seconds, test, args))


LEDGER = Ledger()


def launching_fixture(*args, **kwargs):
    """`pytest.fixture`, and every test using it is marked `launch` at collection."""

    def wrap(fn):
        LAUNCHING_FIXTURES.add(kwargs.get("name") or fn.__name__)
        return pytest.fixture(*args, **kwargs)(fn) if args or kwargs else pytest.fixture(fn)

    if len(args) == 1 and callable(args[0]) and not kwargs:
        fn, args = args[0], ()
        return wrap(fn)
    return wrap


def budget_file() -> Path:
    """tests/budget.toml (LOOM_LAUNCH_BUDGET names another file: the budget's own test)."""
    return Path(os.environ.get("LOOM_LAUNCH_BUDGET", BUDGET_FILE))


def _budgets() -> dict:
    import tomllib

    return tomllib.loads(budget_file().read_text())


def budget() -> int:
    return int(_budgets()["launches"]["max"])


def seconds_budgets() -> dict[str, float]:
    """Seconds per test file (by file name), `[seconds]` of budget.toml; {} when it has none."""
    return {name: float(s) for name, s in _budgets().get("seconds", {}).items()}


def load_average() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "unknown"


# ----------------------------------------------------------------------------- pytest hooks


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "launch: starts real training processes (counted against tests/budget.toml)")
    LEDGER.load_at_start = load_average()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if LAUNCHING_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.launch)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem):
    LEDGER.current = item
    yield
    LEDGER.current = None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call):
    """Each phase's report carries what the phase recorded (the way to the printing process under xdist)."""
    outcome = yield
    outcome.get_result().user_properties.append((PROPERTY, LEDGER.drain()))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    where = report.nodeid.split("::")[0]
    LEDGER.seconds[where] += report.duration
    if report.when == "setup":
        LEDGER.tests[where] += 1
    for name, records in report.user_properties:
        if name == PROPERTY:
            LEDGER.add(records)


def _table(w, files: list[str], budgets: dict[str, float]) -> list[tuple[str, float, float]]:
    """The per-file rows; returns the files over their budget (file, seconds, budget)."""
    over = []
    w.write_line(f"{'file':42s} {'tests':>6s} {'launches':>9s} {'cli calls':>10s} {'seconds':>8s} {'budget':>7s}")
    for f in files:
        limit = budgets.get(Path(f).name)
        seconds = LEDGER.seconds[f]
        flag = "" if limit is None or seconds <= limit else "  OVER"
        if flag:
            over.append((f, seconds, limit))
        w.write_line(f"{f:42s} {LEDGER.tests[f]:6d} {LEDGER.launches[f]:9d} {LEDGER.cli_calls[f]:10d} "
                     f"{seconds:8.1f} {'-' if limit is None else f'{limit:7.0f}':>7s}{flag}")
    total_budget = sum(budgets.get(Path(f).name, 0.0) for f in files)
    w.write_line(f"{'total':42s} {sum(LEDGER.tests.values()):6d} {sum(LEDGER.launches.values()):9d} "
                 f"{sum(LEDGER.cli_calls.values()):10d} {sum(LEDGER.seconds.values()):8.1f} {total_budget:7.0f}")
    return over


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    files = sorted(set(LEDGER.tests) | set(LEDGER.launches))
    if not files:
        return
    w = terminalreporter
    w.section("budgets: launches and seconds per file")
    budgets = seconds_budgets()
    over = _table(w, files, budgets)
    unbudgeted = [Path(f).name for f in files if Path(f).name not in budgets]
    w.write_line(f"load average (1, 5, 15 min): {LEDGER.load_at_start} at the start, {load_average()} at the end; "
                 f"{os.cpu_count()} cores")
    for f, seconds, limit in over:
        w.write_line(f"over its budget: {f} took {seconds:.1f} s of {limit:.0f} s (a report, not a failure: on a "
                     f"loaded machine every file is slower; raise [seconds] in {budget_file().name} only in the "
                     "commit that makes it slower, with the reason)", yellow=True)
    if unbudgeted:
        w.write_line(f"no budget of seconds in {budget_file().name}: {', '.join(unbudgeted)}", yellow=True)
    w.write_line("slowest launches (seconds, test, arguments):")
    for seconds, test, args in sorted(LEDGER.timed, reverse=True)[:SLOWEST]:
        w.write_line(f"{seconds:7.1f}  {test}  {args[:160]}")
    total, limit = sum(LEDGER.launches.values()), budget()
    w.write_line(f"launches: {total} of a budget of {limit} ({budget_file()})")
    if total > limit:
        w.write_line(f"FAILED: {total} training launches exceed the budget of {limit}. Fold the new checks "
                     f"into a shared run (tests/conftest.py), or raise {budget_file().name} with a reason "
                     "in the commit message.", red=True)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if sum(LEDGER.launches.values()) > budget() and session.exitstatus == 0:
        session.exitstatus = 1
