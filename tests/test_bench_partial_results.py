"""What the GPU benches do on the paths the CPU smoke runs do not reach: a crash in a later part
keeps the earlier parts' rows (one device call per bench), bf16 parameters run without autocast
(as the trainer's), and method_bench's gradient copy is the gradient the step really keeps."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from tests.scripts import bench_module
from trainer.config.schema import model_config


@pytest.fixture(scope="module")
def bench():
    return {name: bench_module(name) for name in ("timing", "moe_bench", "method_bench")}


def test_run_part_keeps_earlier_rows_and_records_the_error(bench, capsys):
    rows = [{"part": "layer", "ms": 1.0}]

    def boom():
        raise RuntimeError("CUDA error: an illegal memory access\nsecond line")

    assert bench["timing"].run_part(rows, "step", lambda: [{"part": "step", "ms": 2.0}]) is True
    assert bench["timing"].run_part(rows, "step", boom) is False
    assert rows[:2] == [{"part": "layer", "ms": 1.0}, {"part": "step", "ms": 2.0}]
    assert rows[2]["part"] == "step"
    assert rows[2]["error"].startswith("RuntimeError: CUDA error: an illegal memory access")
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert printed == [{"done": "step", "rows": [{"part": "step", "ms": 2.0}]}]


def test_moe_bench_writes_the_layer_rows_when_the_step_fails_and_exits_1(bench, tmp_path, monkeypatch):
    mb = bench["moe_bench"]

    def failing_step(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError("out of memory")

    monkeypatch.setattr(mb, "bench_step", failing_step)
    argv = ["--preset", "moe-tiny", "--micro-batch", "2", "--seq", "16", "--steps", "1", "--warmup", "0"]
    with pytest.raises(SystemExit) as stop:
        mb.main([*argv, "--device", "cpu", "--out", str(tmp_path)])
    assert stop.value.code == 1
    rows = json.loads((tmp_path / "moe_bench.json").read_text())["rows"]
    assert [r["variant"] for r in rows[:4]] == ["framework", "plain"] * 2 and all(r["ms"] > 0 for r in rows[:4])
    assert rows[4] == {"part": "step", "error": "OutOfMemoryError: out of memory"}


class _Recorder(torch.nn.Module):
    """A model whose loss is a parameter's square, recording whether autocast was on."""

    def __init__(self, dtype: torch.dtype):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(4, dtype=dtype))
        self.autocast: list[bool] = []

    def forward(self, hidden, batch):
        self.autocast.append(torch.is_autocast_enabled("cpu"))
        return (self.w.float() ** 2).sum().expand(batch["input_ids"].shape)


@pytest.mark.parametrize(("param_dtype", "expected"), [(torch.float32, True), (torch.bfloat16, False)])
def test_model_step_row_autocasts_fp32_parameters_only(bench, param_dtype, expected):
    timing = bench["timing"]
    cfg = model_config(preset="tiny")
    model = _Recorder(param_dtype)
    row = timing.model_step_row(model, cfg, "tiny", 2, 8, 2, 1, torch.device("cpu"), torch.bfloat16)
    assert model.autocast == [expected] * 3
    assert row["ms"] > 0 and row["tokens_per_s"] == pytest.approx(2 * 8 / (row["ms"] / 1e3))


@pytest.mark.parametrize(
    ("micro_batches", "world", "dtype", "expected"),
    [(1, 1, torch.bfloat16, 2), (2, 1, torch.bfloat16, 4), (1, 2, torch.bfloat16, 4), (1, 1, torch.float32, 4)],
)
def test_method_bench_gradient_copy_is_the_gradient_the_step_keeps(bench, micro_batches, world, dtype, expected):
    trainer = SimpleNamespace(
        cfg=SimpleNamespace(train=SimpleNamespace(micro_batches=micro_batches)),
        pc=SimpleNamespace(world_size=world),
        facts=SimpleNamespace(param_dtype=dtype),
    )
    assert bench["method_bench"].gradient_bytes(trainer) == expected
