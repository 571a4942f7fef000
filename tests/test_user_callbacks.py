"""trainer.callbacks: a user's own Lightning callbacks, built on every rank after Loom's.

The end-to-end check rides on tests/test_stragglers.py's 4-rank launch (no launch of its own);
the refusals run in-process."""

from __future__ import annotations

import json

import pytest
from conftest import refused
from test_stragglers import slow_run  # noqa: F401  (the shared 4-rank launch)


@pytest.mark.slow
def test_a_users_callback_runs_on_every_rank_after_loom_s(slow_run):  # noqa: F811
    for rank in range(4):
        seen = json.loads((slow_run.run_dir / f"user-callback-rank-{rank}.json").read_text())
        assert seen["batches"] == 6 and seen["tag"] == "mine", seen
        order = seen["order"]
        assert order.index("BatchCounter") > max(order.index(c) for c in ("Recorder", "DataPosition", "HangWatchdog"))


@pytest.mark.parametrize(("value", "says"), [
    ("[3]", "trainer.callbacks[0]=3: give {_target_: module.Class"),
    ("[{every:2}]", "trainer.callbacks[0]={'every': 2}: give {_target_: module.Class"),
    ("[{_target_:no_such_pkg_xyz.Cb}]", "trainer.callbacks[0]._target_='no_such_pkg_xyz.Cb': module "
                                       "'no_such_pkg_xyz' cannot be found"),
])
def test_bad_callbacks_are_refused(tmp_path, value, says):
    err = refused(tmp_path, "hardware=cpu", "tracking=csv", f"trainer.callbacks={value}",
                  "security.allow_targets=[no_such_pkg_xyz]")
    assert says in err, err


def test_a_callback_outside_the_allow_list_is_refused(tmp_path):
    err = refused(tmp_path, "hardware=cpu", "tracking=csv", "trainer.callbacks=[{_target_:os.system}]")
    assert "trainer.callbacks[0]._target_=os.system is not allowed" in err, err
