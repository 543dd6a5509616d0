"""`doremi preprocess` as datatrove pipeline steps (issue 42 item 2: datatrove's executors, local,
SLURM or Ray, are the field's tool to spread tokenizing over many machines; the optional extra
`[scale]`). This module imports datatrove; data/preprocess/scale.py imports it only once datatrove is known
to be installed.

The steps only call our own build: datatrove rank r of `world_size` runs share r of the build's
per-(domain, file) tasks (data.preprocess.preprocess.preprocess_share: our readers, our tokenizer, our part
files and finished-task markers), and the merge step runs `preprocess` (the tasks still missing,
the stores, the manifest last). So the stores' bytes are those of one process whatever executor
ran the shares; datatrove adds its scheduling, logs and per-rank completion records, which skip a
finished rank on a re-run (docs/design.md section 3a-iii).
"""

from __future__ import annotations

from typing import Any

from datatrove.pipeline.base import PipelineStep

from data.config import DataConfig
from data.preprocess.preprocess import preprocess, preprocess_share


class _BuildStep(PipelineStep):
    """A step of our build: the data config and whether to show progress; datatrove's `data`
    passes through untouched (the build reads its own inputs)."""

    type = "TOKENIZER"

    def __init__(self, cfg: DataConfig, progress: bool = False):
        super().__init__()
        self.cfg = cfg
        self.progress = progress

    def run(self, data: Any = None, rank: int = 0, world_size: int = 1) -> Any:
        self.build(rank, world_size)
        if data:
            yield from data

    def build(self, rank: int, world_size: int) -> None:
        raise NotImplementedError


class PreprocessShare(_BuildStep):
    """Share `rank` of `world_size` of the build's tasks, each share tokenizing with `cfg.num_proc`
    processes (1 under datatrove's local executor, whose own workers are the parallelism: its
    pool's processes may not start processes of their own)."""

    name = "doremi preprocess share"

    def build(self, rank: int, world_size: int) -> None:
        ran, share = preprocess_share(self.cfg, rank, world_size, progress=self.progress)
        self.stat_update("tasks_run", value=ran)
        self.stat_update("tasks_found_finished", value=share - ran)


class PreprocessMerge(_BuildStep):
    """The build's merge, as one datatrove task that runs after the shares (SLURM: a job that
    depends on the shares' job array)."""

    name = "doremi preprocess merge"

    def build(self, rank: int, world_size: int) -> None:
        manifest = preprocess(self.cfg, progress=self.progress)
        self.stat_update("domains", value=len(manifest.domains))
