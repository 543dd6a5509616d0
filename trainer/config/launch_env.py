"""What the launcher (torchrun, or none) says about this process, read in one place.

Before a process group exists the environment is the only source: the CLI decides which rank
prints an error, and the world-size and device checks run, before `ParallelContext.initialize`.
After it, `ParallelContext` (`is_main`, `world`) is the source.
"""

from __future__ import annotations

import os


def launch_rank() -> int:
    """This process's global rank (torchrun's RANK; 0 without a launcher)."""
    return int(os.environ.get("RANK", "0"))


def launched() -> bool:
    """Whether a launcher (torchrun, srun through it) started this process: WORLD_SIZE is set."""
    return "WORLD_SIZE" in os.environ


def launch_world_size() -> int:
    """The number of processes launched (torchrun's WORLD_SIZE; 1 without a launcher)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def local_rank() -> int:
    """This process's rank on its node (torchrun's LOCAL_RANK)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def local_world_size() -> int:
    """The number of processes on this node (torchrun's LOCAL_WORLD_SIZE)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def is_launch_main() -> bool:
    """Whether this process is global rank 0: the one that prints user errors and summaries."""
    return launch_rank() == 0
