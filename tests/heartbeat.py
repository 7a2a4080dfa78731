"""A line on the terminal while a test runs longer than ``EVERY_S``: what the suite is doing, and for how long.

``pytest -q`` prints a dot when a test ends, so the README's test command was silent for as long as its longest
test ran (the offline rehearsal: 45 s on a quiet machine, 212 s on a busy one; mypy; a first inductor compile).
pyproject.toml's addopts load this module with ``-p``, before pytest starts capturing output: it keeps its own
copy of the terminal's file descriptor, which capture never redirects, so no test's captured output is touched.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Generator

import pytest

EVERY_S = float(os.environ.get("AMPKIT_TEST_HEARTBEAT_S", "8"))  # a newcomer's run: no silence over 10 s
_TERMINAL = os.dup(1)  # this module is imported before capture redirects descriptor 1


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, None, None]:
    done = threading.Event()
    start = time.monotonic()

    def beat() -> None:
        while not done.wait(EVERY_S):
            line = f"\n[{item.nodeid}: still running after {time.monotonic() - start:.0f} s]\n"
            try:
                os.write(_TERMINAL, line.encode())
            except OSError:  # the terminal went away: nothing to tell
                return

    thread = threading.Thread(target=beat, name="ampkit-tests-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()
