"""Run a function on N CPU processes over gloo, for multi-process tests.

`spawn(fn, world_size, *args)` starts N processes with a free port; each calls
`fn(rank, world_size, *args)` after `init_process_group`. A failure on any rank fails the test
with that rank's traceback. The ranks compute on the CPU on a machine with GPUs too: in a gloo
group made before it, the trainer resolves `train.device: auto` to the CPU
(`trainer.parallel.context.resolve_device`, tests/test_gloo_device.py).

The ranks are forked from a forkserver that imported torch and the trainer once (PRELOAD), not
started fresh: a fresh rank spent about 4 s of CPU importing them, which was a third of the
suite's time on two cores (experiments/notes/SUITE.md). A fork of a process that only imported
(no thread pool started, no process group) is as clean as a fresh one; each rank still gets the
test's environment and working directory of the moment, as under "spawn".
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


#: Imported once by the forkserver, so that each rank starts with them in memory. Dynamo too:
#: torch's optimizers import it when built (`torch._disable_dynamo` on `add_param_group`), 1.6 s
#: of CPU in every rank that trains.
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "tests.distributed", "tests.runs", "doremi.pipeline.stages"]
_CTX = mp.get_context("forkserver")
_CTX.set_forkserver_preload(PRELOAD)


def _entry(rank: int, world_size: int, port: int, env: dict[str, str], fn, args, errq) -> None:
    os.environ.clear()
    os.environ.update(env)
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
    errq = _CTX.SimpleQueue()
    try:
        mp.start_processes(
            _entry,
            args=(world_size, free_port(), dict(os.environ), fn, args, errq),
            nprocs=world_size,
            join=True,
            start_method="forkserver",
        )
    except Exception as e:
        msgs = []
        while not errq.empty():
            rank, tb = errq.get()
            msgs.append(f"--- rank {rank} ---\n{tb}")
        raise AssertionError("\n".join(msgs) or str(e)) from None


def world_size(sets: list[str]) -> int:
    """Processes a layout's --set list asks for: tp x pp x dp (ep divides dp, so adds none)."""
    size = 1
    for s in sets:
        key, value = s.split("=")
        if key in ("parallelism.tp", "parallelism.pp", "parallelism.dp"):
            size *= int(value)
    return size
