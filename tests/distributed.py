"""Run a function on N CPU processes over gloo, for multi-process tests.

`spawn(fn, world_size, *args)` starts N processes with a free port; each calls
`fn(rank, world_size, *args)` after `init_process_group`. A failure on any rank fails the test
with that rank's traceback.
"""

from __future__ import annotations

import os
import socket
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, fn, args, errq) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank)
    )
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        fn(rank, world_size, *args)
    except BaseException:
        errq.put((rank, traceback.format_exc()))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn(fn, world_size: int, *args) -> None:
    ctx = mp.get_context("spawn")
    errq = ctx.SimpleQueue()
    try:
        mp.start_processes(
            _entry, args=(world_size, free_port(), fn, args, errq), nprocs=world_size, join=True, start_method="spawn"
        )
    except Exception as e:
        msgs = []
        while not errq.empty():
            rank, tb = errq.get()
            msgs.append(f"--- rank {rank} ---\n{tb}")
        raise AssertionError("\n".join(msgs) or str(e)) from None
