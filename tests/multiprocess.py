"""Run a function on N gloo ranks in spawned processes, with a bounded time and a free port."""

from __future__ import annotations

import os
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, fn: Callable[..., Any], world_size: int, port: int, out: str, args: tuple) -> None:
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
            timeout=timedelta(seconds=60),
        )
        result = fn(rank, world_size, *args)
        torch.save({"result": result}, Path(out) / f"{rank}.pt")
        dist.barrier()  # no rank tears its connections down while another still talks to it
    except BaseException:
        torch.save({"error": traceback.format_exc()}, Path(out) / f"{rank}.pt")
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
            time.sleep(0.2)  # gloo's workers free the last collectives while Python lives (docs/distributed.md)


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 120.0) -> list[Any]:
    """``fn(rank, world_size, *args)`` on each rank; returns the per-rank results.

    Raises:
        RuntimeError: a rank failed (its traceback is in the message) or the ranks ran past ``timeout_s``.
    """
    with tempfile.TemporaryDirectory() as out:
        context = mp.start_processes(
            _entry, args=(fn, world_size, free_port(), out, args), nprocs=world_size, join=False, start_method="spawn"
        )
        try:
            finished = False
            deadline = timeout_s
            while not finished and deadline > 0:
                finished = context.join(timeout=1)
                deadline -= 1
            if not finished:
                raise RuntimeError(f"{world_size} ranks did not finish within {timeout_s} s")
        except (mp.ProcessRaisedException, mp.ProcessExitedException):
            pass  # the rank's own traceback, saved below, is the useful report
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
        results = []
        for rank in range(world_size):
            path = Path(out) / f"{rank}.pt"
            if not path.exists():
                raise RuntimeError(f"rank {rank} left no result")
            saved = torch.load(path, weights_only=False)
            if "error" in saved:
                raise RuntimeError(f"rank {rank} failed:\n{saved['error']}")
            results.append(saved["result"])
        return results


os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
