"""trainer.callbacks: a user's own Lightning callbacks, built on every rank after Loom's.

The end-to-end check rides on tests/test_stragglers.py's 4-rank launch (there, so that the
module-scoped launch is not started twice); the refusals run in-process."""

from __future__ import annotations

import pytest
from conftest import refused


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
