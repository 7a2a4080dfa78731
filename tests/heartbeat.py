"""A line on the terminal while collection or a test runs longer than ``EVERY_S``: what the suite is doing, and for
how long.

``pytest -q`` prints a dot when a test ends, so the README's test command was silent for as long as its longest
test ran (the offline rehearsal: 45 s on a quiet machine, 212 s on a busy one; mypy; a first inductor compile), and
while it collected (importing torch, transformers and every test module: 15 s on a busy machine).
``tests/conftest.py`` calls ``register``: it copies the terminal's file descriptor while pytest's capture is
suspended, and writes there, so no test's captured output is touched.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Generator

import pytest

EVERY_S = float(os.environ.get("AMPKIT_TEST_HEARTBEAT_S", "8"))  # a newcomer's run: no silence over 10 s


def register(config: pytest.Config) -> None:
    """Start the heartbeat for this session (from ``pytest_configure``)."""
    capture = config.pluginmanager.getplugin("capturemanager")
    if capture is None:  # -p no:capture: descriptor 1 is the terminal
        terminal = os.dup(1)
    else:
        with capture.global_and_fixture_disabled():  # descriptor 1 is the terminal again for this moment
            terminal = os.dup(1)
    config.pluginmanager.register(_Heartbeat(terminal), "ampkit-tests-heartbeat")


@contextlib.contextmanager
def _beating(terminal: int, what: str) -> Generator[None, None, None]:
    """Every ``EVERY_S`` while the block runs, a line naming ``what`` and the time so far."""
    done = threading.Event()
    start = time.monotonic()

    def beat() -> None:
        while not done.wait(EVERY_S):
            try:
                os.write(terminal, f"\n[{what}: still running after {time.monotonic() - start:.0f} s]\n".encode())
            except OSError:  # the terminal went away: nothing to tell
                return

    thread = threading.Thread(target=beat, name="ampkit-tests-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


class _Heartbeat:
    """The hooks: a heartbeat around collection and around each test."""

    def __init__(self, terminal: int) -> None:
        self.terminal = terminal

    @pytest.hookimpl(hookwrapper=True)
    def pytest_collection(self, session: pytest.Session) -> Generator[None, None, None]:
        with _beating(self.terminal, "collecting the tests"):
            yield

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, None, None]:
        with _beating(self.terminal, item.nodeid):
            yield
