"""Signals as interruptions while a command runs (sdcreplay.interrupts)."""

from __future__ import annotations

import os
import signal
import sys
import time
import weakref

import pytest

from sdcreplay import interrupts
from sdcreplay.errors import Terminated, interrupt_exit_code


def test_sigterm_is_an_interruption_that_exits_143():
    with pytest.raises(Terminated) as caught, interrupts.handled():
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
    assert interrupt_exit_code(caught.value) == 143
    assert interrupt_exit_code(KeyboardInterrupt()) == 130


def test_an_interruption_raised_inside_a_weakref_callback_is_not_lost():
    """Python only prints what a weakref callback raises ("Exception ignored in"); the signal
    is delivered again, so the command still ends."""

    class Held:
        pass

    def callback(_):
        os.kill(os.getpid(), signal.SIGTERM)  # the handler raises inside this callback
        sum(range(1000))

    with pytest.raises(Terminated), interrupts.handled():
        held = Held()
        watched = weakref.ref(held, callback)
        del held
        for _ in range(500):
            time.sleep(0.01)
    assert watched() is None


def test_a_signal_inside_an_import_is_raised_when_the_import_ends(tmp_path, monkeypatch):
    """A ^C while torch imports made the command abort (SIGABRT, not 130) or fail on a half
    made numpy: the interruption waits for the module to be whole, then ends the command."""
    (tmp_path / "slow_to_import.py").write_text(
        "import os, signal, time\n"
        "os.kill(os.getpid(), signal.SIGINT)\n"
        "for _ in range(30):\n"
        "    time.sleep(0.01)\n"
        "WHOLE = True\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(KeyboardInterrupt) as caught, interrupts.handled():
        import slow_to_import  # noqa: F401

        for _ in range(500):
            time.sleep(0.01)
    assert sys.modules["slow_to_import"].WHOLE
    raised_in = [entry.name for entry in caught.traceback]
    assert raised_in[-2:] == [
        "test_a_signal_inside_an_import_is_raised_when_the_import_ends",
        "_interrupt",
    ]
