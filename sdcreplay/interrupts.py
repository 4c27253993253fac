"""Signals end a command cleanly: SIGINT raises KeyboardInterrupt (as Python does), SIGTERM
and SIGHUP raise `errors.Terminated`, so the cleanup a ^C runs (every device process and rank
stopped, the leftovers named) runs for a scheduler's signal too, and the command exits 128 +
the signal (130, 143, 129) without a traceback. The command line's (`cli.boundary`); in the
ground so that the package installs them first thing in the console script's process.

A signal while that cleanup runs is remembered, not raised, so the cleanup finishes (it waits
at most a few seconds); a third one ends the process at once. One that lands inside an import
is raised as soon as the import ends (raised in a module's body, it would leave the module half
made). The console script installs the
handlers as it imports the package, before typer or torch (`install_for_console_script`);
there a signal before a command's body runs (while the tool is still importing, or parsing
the command line) or after it answered ends the process at once: it has started nothing, or
stopped all it started. A command run inside another program (a test's CliRunner) has the
handlers while it runs (`handled`).
"""

from __future__ import annotations

import _thread
import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from types import FrameType

from .errors import Terminated

HANDLED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
CONSOLE_SCRIPT = "sdcreplay"
_received: list[int] = []
_running: list[bool] = []  # a command's body is running
_deferred: list[int] = []  # received inside an import, raised when it ends


def _interrupt(signum: int, frame: FrameType | None) -> None:
    if _running and not _received and _importing(frame):
        if not _deferred:
            threading.Thread(target=_raise_after_the_import, daemon=True).start()
        _deferred.append(signum)
        if len(_deferred) >= 3:
            _end_at_once(_deferred[0])
        return
    _received.append(signum)
    if not _running:
        _end_at_once(signum)
    if len(_received) == 1:
        raise KeyboardInterrupt if signum == signal.SIGINT else Terminated(signum)
    if len(_received) >= 3:
        _end_at_once(_received[0])


def _importing(frame: FrameType | None) -> bool:
    """Whether the main thread is inside an import. An interruption raised in a module's body
    leaves that module half made: a half-initialized torch aborts the interpreter as it exits
    (SIGABRT instead of 130), a numpy without its ufuncs fails the cleanup."""
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


def _raise_after_the_import() -> None:
    """From a thread of its own: the deferred signal, raised in the main thread as soon as it
    is out of the import (its handler runs again there, and defers again if another began)."""
    frames = sys._current_frames
    while _importing(frames().get(threading.main_thread().ident or 0)):
        time.sleep(0.01)
    signum = _deferred[0]
    _deferred.clear()
    _thread.interrupt_main(signal.Signals(signum))


def _end_at_once(signum: int) -> None:
    with contextlib.suppress(OSError, ValueError):
        sys.stdout.flush()
        os.write(2, f"Interrupted ({signal.Signals(signum).name}).\n".encode())
    os._exit(128 + signum)


def _lost_interrupt_again(default):
    """An interruption raised inside a weakref callback or a ``__del__`` is only printed
    ("Exception ignored in") and lost: deliver the signal again, to be raised where it counts."""

    def hook(unraisable) -> None:
        if isinstance(unraisable.exc_value, KeyboardInterrupt) and _received:
            signum = _received[0]
            _received.clear()
            # from another thread: a signal sent here would be raised inside this hook
            threading.Timer(0.01, os.kill, (os.getpid(), signum)).start()
            return
        default(unraisable)

    return hook


def _install() -> dict:
    """Our handlers (main thread only); the ones they replace."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {signum: signal.signal(signum, _interrupt) for signum in HANDLED}


def install_for_console_script() -> None:
    """In the ``sdcreplay`` console script's process, before the command line is even parsed:
    a signal in its first second gets the same clean end as one later."""
    main = getattr(sys.modules.get("__main__"), "__file__", None) or ""
    if os.path.basename(main) == CONSOLE_SCRIPT:
        _install()


@contextlib.contextmanager
def handled() -> Iterator[None]:
    """While one command runs: signals as interruptions, the previous handlers after."""
    from . import leftovers  # here: the console script installs the handlers before it loads

    _received.clear()
    _deferred.clear()
    leftovers.forget()
    saved = _install()
    _running.append(True)
    unraisable = sys.unraisablehook
    sys.unraisablehook = _lost_interrupt_again(unraisable)
    try:
        yield
    finally:
        _running.clear()
        sys.unraisablehook = unraisable
        for signum, handler in saved.items():
            signal.signal(signum, signal.SIG_DFL if handler is None else handler)
