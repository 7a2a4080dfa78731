"""The subprocess that hosts one run, stepped in lockstep by its host.

Each run executes in its own Python process (``python -m ampkit.experiment.process``)
so its peak memory is its own; it reports progress and its result as JSON lines
on stdout. Runs start from the same seed, hence the same initial weights, and
draw the same batches in the same order.

The runs of a comparison step in lockstep: each process waits for a ``step``
line on stdin before every training step and a ``finish`` line before its
evaluation, so the parent can interleave the runs' steps (one process computes
at a time) and every run meets the machine's fast and slow moments alike, as a
benchmark that alternates its variants does. Timings of separate processes run
one after the other differed widely on a shared 2-core machine.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import warnings
from typing import Any, NoReturn

from ampkit.experiment.config import RunConfig, RunResult
from ampkit.experiment.training import execute
from ampkit.hardware.flags import SlowPrecisionWarning
from ampkit.modes import ComputeModeWarning


class RunFailed(RuntimeError):
    """A run's process failed. ``str()`` gives the run, the exit code and the last line of
    its error output; ``log`` keeps all of it."""

    def __init__(self, label: str, code: int, log: str) -> None:
        last = next((line.strip() for line in reversed(log.splitlines()) if line.strip()), "no error output")
        super().__init__(f"The {label} run failed (exit code {code}): {last}")
        self.label, self.code, self.log = label, code, log


# The first line of a warning as Python prints it: "path:line: Category: message"
_WARNING_LINE = re.compile(r"^\S.*:\d+: (\w+): ")


def warning_key(warning: warnings.WarningMessage) -> str:
    """What ``new_warnings`` knows a warning by, for one this process printed itself: its category and the first line
    of its message (where it was raised differs between the host and a run)."""
    return _key(warning.category.__name__, str(warning.message))


def _key(category: str, message: str) -> str:
    return f"{category}: {(message.splitlines() or [''])[0]}"


def new_warnings(text: str, shown: set[str]) -> str:
    """``text`` (a run's error output) less the warnings in ``shown``, which takes the rest: every run of a comparison
    says the same TorchVersionWarning or torchao import noise, and a reader needs it once, not once per run (nor
    again after the host's own copy, ``warning_key``). A warning is its first line and the lines after it up to the
    next warning's, known by its category and message; other lines by their text."""
    blocks: list[str] = []
    for line in text.splitlines(keepends=True):
        if not blocks or _WARNING_LINE.match(line):
            blocks.append(line)
        else:
            blocks[-1] += line
    fresh = []
    for block in blocks:
        first = _WARNING_LINE.match(block)
        key = _key(first.group(1), block[first.end():]) if first else block
        if key not in shown:
            shown.add(key)
            fresh.append(block)
    return "".join(fresh)


class RunProcess:
    """One run in its own Python process, stepped by its host (see the module docstring).

    Use as a context manager: the process starts on entry and is killed on exit if it
    is still running (another run failed, or the host was interrupted).

    Raises (from ``step`` and ``result``):
        RuntimeError: the run failed; the message carries its error output.
    """

    def __init__(self, config: RunConfig) -> None:
        self.config = config
        self.steps_done = 0
        self.losses: list[float] = []  # per step, as reported
        self.stopped = False  # the run ended its training early (it diverged)
        # stderr goes to a file, not a pipe: a chatty run must not block on a full pipe
        # while the host reads its stdout.
        self._errors = tempfile.TemporaryFile("w+")
        self._process = subprocess.Popen(
            [sys.executable, "-m", "ampkit.experiment.process", json.dumps(dataclasses.asdict(config))],
            env={**os.environ, "AMPKIT_HOST_PID": str(os.getpid())},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._errors,
            text=True,
        )

    def __enter__(self) -> RunProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._process.poll() is None:
            self._process.kill()
            self._process.wait()
        self._errors.close()

    def step(self) -> tuple[int, float]:
        """Let the run take one training step; returns (step number, loss)."""
        self._write("step")
        message = self._read("step")
        self.steps_done += 1
        self.stopped = bool(message.get("stop"))
        loss = float(message["loss"])  # "nan" / "inf" arrive as strings: strict JSON
        self.losses.append(loss)
        return message["step"], loss

    @property
    def training(self) -> bool:
        """Whether the run has steps left to take."""
        return not self.stopped and self.steps_done < self.config.steps

    def finish(self) -> None:
        """Let the run evaluate (after its last step); ``result`` collects what it found."""
        self._write("finish")

    def result(self, shown: set[str] | None = None) -> RunResult:
        """The run's result, once the process has evaluated and exited. Its warnings go to stderr, each once: those
        in ``shown`` (another run's, the same text) are left out, and the others added to it."""
        message = self._read("result")
        if self._process.wait() != 0:
            self._fail()
        self._errors.seek(0)
        warnings_text = new_warnings(self._errors.read(), set() if shown is None else shown)
        if warnings_text.strip():
            print(warnings_text, file=sys.stderr, end="")
        return RunResult(**message["result"])

    def _write(self, command: str) -> None:
        assert self._process.stdin is not None
        try:
            self._process.stdin.write(command + "\n")
            self._process.stdin.flush()
        except BrokenPipeError:
            self._fail()

    def _read(self, expect: str) -> dict[str, Any]:
        """Read the run's stdout up to a JSON message with key ``expect``; pass other lines on."""
        assert self._process.stdout is not None
        for line in self._process.stdout:
            try:
                message = json.loads(line)
            except json.JSONDecodeError:  # something the model's own code printed
                message = None
            if isinstance(message, dict) and expect in message:
                return message
            print(line, file=sys.stderr, end="")
        self._fail()

    def _fail(self) -> NoReturn:
        code = self._process.wait()
        self._errors.seek(0)
        raise RunFailed(self.config.label, code, self._errors.read())


def _die_with_the_parent() -> None:
    """Ask Linux to end this process when its parent dies (a run must not outlive its host).

    The host passes its pid in ``AMPKIT_HOST_PID``: if it died before this call (importing
    torch takes seconds), the request came too late and the run ends now.
    """
    try:
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux: the host closes our stdin when it goes, which ends us at the next step
    host = os.environ.get("AMPKIT_HOST_PID")
    if host is not None and os.getppid() != int(host):
        raise SystemExit("ampkit.experiment.process: the host process is gone")


def _main(argv: list[str]) -> int:
    _die_with_the_parent()
    config = RunConfig(**json.loads(argv[0]))
    # The parent states these once; each run would repeat them.
    warnings.filterwarnings("ignore", category=SlowPrecisionWarning)
    warnings.filterwarnings("ignore", category=ComputeModeWarning)
    # torchao's low-bit states (--states), compiled by its optimizer: a note for torchao's authors, not the user
    warnings.filterwarnings("ignore", message=r".*does not implement _stable_hash_for_caching")

    def report(step: int, loss: float, stop: bool) -> None:
        print(json.dumps({"step": step, "loss": loss if math.isfinite(loss) else str(loss), "stop": stop}), flush=True)

    def wait(phase: str) -> None:
        command = sys.stdin.readline().strip()
        if command != phase:  # the host went away (end of input) or lost count
            raise SystemExit(f"ampkit.experiment.process: expected {phase!r} on stdin, got {command!r}")

    result = execute(config, report, wait)
    print(json.dumps({"result": dataclasses.asdict(result)}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
