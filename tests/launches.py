"""The launch budget: every `loom train` that trains goes through `tests/launches.py`, which counts
it against the test that caused it; the session ends with a per-file table and fails when the
count exceeds `tests/budget.toml`.

Why a count and not a time: a count is the same on any machine, so the budget cannot drift
silently; the time it costs is printed beside it (and `--durations=20` names the slow tests).
A test that launches is marked `launch`: tests using a launching fixture (`launching_fixture`)
are marked at collection; a test that launches without the marker fails, so
`-m "not launch"` (the quick loop) can never start a training process.
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


@dataclass
class Ledger:
    """Launches and CLI calls per test file; the item running now."""

    current: pytest.Item | None = None
    launches: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    cli_calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    tests: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    unmarked: list[str] = field(default_factory=list)
    timed: list[tuple[float, str, str]] = field(default_factory=list)  # (seconds, test, arguments)

    def file_of_current(self) -> str:
        return self.current.nodeid.split("::")[0] if self.current else "(no test)"

    def record(self, launches: int, seconds: float | None = None, args: tuple[str, ...] = ()) -> None:
        """`launches` training runs started by the current test (0: a CLI call that trained nothing);
        `seconds`: how long the command took, when it ran to its end here."""
        where = self.file_of_current()
        if launches and seconds is not None:
            self.timed.append((seconds, self.current.nodeid if self.current else where, " ".join(args)))
        if not launches:
            self.cli_calls[where] += 1
            return
        self.launches[where] += launches
        item = self.current
        if item is not None and item.get_closest_marker("launch") is None:
            self.unmarked.append(item.nodeid)
            pytest.fail(f"{item.nodeid} starts a training run but is not marked `launch`: add "
                        "@pytest.mark.launch (or use a fixture made with launching_fixture)", pytrace=False)


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


def budget() -> int:
    import tomllib

    return int(tomllib.loads(budget_file().read_text())["launches"]["max"])


# ----------------------------------------------------------------------------- pytest hooks


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "launch: starts real training processes (counted against tests/budget.toml)")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if LAUNCHING_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.launch)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem):
    LEDGER.current = item
    LEDGER.tests[item.nodeid.split("::")[0]] += 1
    yield
    LEDGER.current = None


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    LEDGER.seconds[report.nodeid.split("::")[0]] += report.duration


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    files = sorted(set(LEDGER.tests) | set(LEDGER.launches))
    if not files:
        return
    w = terminalreporter
    w.section("launch budget")
    w.write_line(f"{'file':42s} {'tests':>6s} {'launches':>9s} {'cli calls':>10s} {'seconds':>8s}")
    for f in files:
        w.write_line(f"{f:42s} {LEDGER.tests[f]:6d} {LEDGER.launches[f]:9d} {LEDGER.cli_calls[f]:10d} "
                     f"{LEDGER.seconds[f]:8.1f}")
    total = sum(LEDGER.launches.values())
    w.write_line(f"{'total':42s} {sum(LEDGER.tests.values()):6d} {total:9d} {sum(LEDGER.cli_calls.values()):10d} "
                 f"{sum(LEDGER.seconds.values()):8.1f}")
    w.write_line("slowest launches (seconds, test, arguments):")
    for seconds, test, args in sorted(LEDGER.timed, reverse=True)[:SLOWEST]:
        w.write_line(f"{seconds:7.1f}  {test}  {args[:160]}")
    limit = budget()
    w.write_line(f"launches: {total} of a budget of {limit} ({budget_file()})")
    if total > limit:
        w.write_line(f"FAILED: {total} training launches exceed the budget of {limit}. Fold the new checks "
                     f"into a shared run (tests/conftest.py), or raise {budget_file().name} with a reason "
                     "in the commit message.", red=True)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if sum(LEDGER.launches.values()) > budget() and session.exitstatus == 0:
        session.exitstatus = 1
