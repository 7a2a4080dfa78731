"""A line on the terminal while collection or a test runs longer than ``EVERY_S``: what the suite is doing, and for
how long.

``pytest -q`` prints a dot when a test ends, so the README's test command was silent for as long as its longest
test ran (the offline rehearsal: 45 s on a quiet machine, 212 s on a busy one; mypy; a first inductor compile), and
while it collected (importing torch, transformers and every test module: 15 s on a busy machine).
``tests/conftest.py`` calls ``register``: it copies the terminal's file descriptor while pytest's capture is
suspended, and hands it to a small watcher process, which writes there, so no test's captured output is touched.

A process, not a thread: the tests run in a process with one thread, as a user's training script does, where
ampkit releases its dispatcher kernels when the last region closes (``precision/kernels.py``; a second thread
keeps them).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import subprocess
import sys
from collections.abc import Generator

import pytest

EVERY_S = float(os.environ.get("AMPKIT_TEST_HEARTBEAT_S", "8"))  # a newcomer's run: no silence over 10 s

# The watcher: reads what runs (a line; an empty line when it ends) and, while something runs, writes a line on the
# terminal every EVERY_S. It ends when the suite's process closes the pipe (or dies).
_WATCHER = """
import os, select, sys, time
terminal, every = int(sys.argv[1]), float(sys.argv[2])
what, start, beats, pending = None, 0.0, 0, b""
while True:
    wait = None if what is None else max(start + every * (beats + 1) - time.monotonic(), 0.0)
    if select.select([0], [], [], wait)[0]:
        chunk = os.read(0, 65536)
        if not chunk:
            break
        *lines, pending = (pending + chunk).split(b"\\n")
        for line in lines:
            what, start, beats = line.decode() or None, time.monotonic(), 0
    else:
        beats += 1
        try:
            os.write(terminal, f"\\n[{what}: still running after {time.monotonic() - start:.0f} s]\\n".encode())
        except OSError:  # the terminal went away: nothing to tell
            break
"""


def register(config: pytest.Config) -> None:
    """Start the heartbeat for this session (from ``pytest_configure``)."""
    capture = config.pluginmanager.getplugin("capturemanager")
    if capture is None:  # -p no:capture: descriptor 1 is the terminal
        terminal = os.dup(1)
    else:
        with capture.global_and_fixture_disabled():  # descriptor 1 is the terminal again for this moment
            terminal = os.dup(1)
    watcher = subprocess.Popen([sys.executable, "-c", _WATCHER, str(terminal), str(EVERY_S)], stdin=subprocess.PIPE,
                               pass_fds=(terminal,))
    os.close(terminal)
    atexit.register(_stop, watcher)
    config.pluginmanager.register(_Heartbeat(watcher), "ampkit-tests-heartbeat")


def _stop(watcher: subprocess.Popen[bytes]) -> None:
    assert watcher.stdin is not None
    watcher.stdin.close()
    watcher.wait(timeout=10)


@contextlib.contextmanager
def _beating(watcher: subprocess.Popen[bytes], what: str) -> Generator[None, None, None]:
    """Every ``EVERY_S`` while the block runs, a line naming ``what`` and the time so far."""
    assert watcher.stdin is not None
    watcher.stdin.write(what.replace("\n", " ").encode() + b"\n")
    watcher.stdin.flush()
    try:
        yield
    finally:
        watcher.stdin.write(b"\n")
        watcher.stdin.flush()


class _Heartbeat:
    """The hooks: a heartbeat around collection and around each test."""

    def __init__(self, watcher: subprocess.Popen[bytes]) -> None:
        self.watcher = watcher

    @pytest.hookimpl(hookwrapper=True)
    def pytest_collection(self, session: pytest.Session) -> Generator[None, None, None]:
        with _beating(self.watcher, "collecting the tests"):
            yield

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, None, None]:
        with _beating(self.watcher, item.nodeid):
            yield
