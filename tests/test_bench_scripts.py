"""The GPU bench scripts import on a CPU machine; each ablation reaches the code path it names
(a rename in the model would otherwise only show on the GPU, as a row equal to the plain step):
the model's `Kernels` switches change what it calls, their defaults are what it called before
they existed, and the one ablation outside the model checks its own patch."""

from __future__ import annotations

import gzip
import importlib
import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.paths import ROOT
from tests.scripts import BENCH, bench_module
from trainer.config.schema import ModelConfig
from trainer.model import layers, llama
from trainer.model.llama import Llama
from trainer.model.ops import cross_entropy as ce
from trainer.model.ops import rope
from trainer.model.ops.kernels import Kernels
from trainer.optim import clip


@pytest.fixture(scope="module")
def bench_modules():
    return {name: bench_module(name) for name in ("step_bench", "profile_step", "micro_bench")}


def test_paired_windows_alternate_abba_and_rows_compare_within_their_group(bench_modules, monkeypatch):
    sb = bench_modules["step_bench"]
    monkeypatch.setattr(sb.torch.cuda, "synchronize", lambda: None)
    calls: list[str] = []
    seen = sb.paired_windows({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, iters=2, rounds=2)
    assert "".join(calls) == "aabbbbaaaabbbbaa"
    assert [len(v) for v in seen.values()] == [4, 4]
    rows = [
        sb.Row("1b", "baseline --compile", 100.0),
        sb.Row("1b", "plain", 104.0),
        sb.Row("1b", "baseline --compile", 100.0, group="paired"),
        sb.Row("1b", "plain", 106.0, group="paired"),
    ]
    table = sb.format_table(rows).splitlines()
    assert "1.040" in table[2] and "plain (paired)" in table[4] and "1.060" in table[4]


CFG = ModelConfig(vocab_size=250, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=16)


def _batch(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "input_ids": torch.randint(0, 250, (2, 16), generator=g),
        "labels": torch.randint(0, 250, (2, 16), generator=g),
    }


def counting(fn, calls: list):
    def wrapper(*args, **kwargs):
        calls.append(fn)
        return fn(*args, **kwargs)

    return wrapper


def test_kernel_defaults_are_the_implementations_the_model_called_before():
    k = Kernels()
    assert k.rope_qkv is rope.rope_qkv
    assert k.cross_entropy is ce.cross_entropy
    assert k.sdpa_priority == layers.CUDA_SDPA_PRIORITY
    assert k.sdpa_priority[0] == layers.SDPBackend.CUDNN_ATTENTION
    model = Llama(CFG)
    assert model.kernels == k and all(b.attn.kernels is model.kernels for b in model.layers.values())


def test_rope_switch_changes_the_function_called_and_not_the_numbers():
    calls: list = []
    switched = Llama(CFG, seed=1, kernels=Kernels(rope_qkv=counting(rope.rope_qkv_torch, calls)))
    batch = _batch()
    losses = switched(None, batch)
    assert calls == [rope.rope_qkv_torch] * CFG.n_layers
    torch.testing.assert_close(losses, Llama(CFG, seed=1)(None, batch), atol=1e-6, rtol=1e-6)


def test_sdpa_priority_switch_reaches_causal_attention(monkeypatch):
    seen: list = []
    real = llama.causal_attention
    monkeypatch.setattr(
        llama,
        "causal_attention",
        lambda q, k, v, impl, priority: seen.append(priority) or real(q, k, v, impl, priority),
    )
    batch = _batch()
    Llama(CFG)(None, batch)
    assert seen == [layers.CUDA_SDPA_PRIORITY] * CFG.n_layers
    seen.clear()
    flash_first = tuple(reversed(layers.CUDA_SDPA_PRIORITY))
    Llama(CFG, kernels=Kernels(sdpa_priority=flash_first))(None, batch)
    assert seen == [flash_first] * CFG.n_layers


def test_cross_entropy_switch_is_the_fused_heads_loss():
    """The switch only matters where the head fuses its loss (compiled, CUDA, tp = 1); here that
    path is forced on the CPU, against the eager vocabulary-parallel loss."""
    calls: list = []
    batch = _batch()
    model = Llama(CFG, seed=2, kernels=Kernels(cross_entropy=counting(ce.cross_entropy, calls)))
    eager = model(None, batch)
    assert calls == []
    model._fused_loss = True
    torch.testing.assert_close(model(None, batch), eager, atol=1e-5, rtol=1e-5)
    assert calls == [ce.cross_entropy]


def test_ablations_set_existing_switches_to_other_values(bench_modules):
    sb = bench_modules["step_bench"]
    labels = [a.label for a in sb.ABLATIONS]
    assert len(set(labels)) == len(labels)
    assert all(a.label.startswith(("ablation: ", "trial: ")) for a in sb.ABLATIONS)
    default = Kernels()
    for a in sb.ABLATIONS:
        changed = a.model_kernels(default)
        assert all(getattr(changed, f) is v and getattr(default, f) != v for f, v in a.kernels.items()), a.label
        assert a.kernels or a.train or a.context is not sb.contextlib.nullcontext, a.label
    with pytest.raises(TypeError):
        sb.Ablation("ablation: unknown", kernels={"rope": rope.rope_qkv_torch}).model_kernels(default)


@pytest.mark.parametrize("label", ["earlier form", "RoPE by inductor", "cross entropy by inductor"])
def test_ablation_kernels_run_in_the_model(bench_modules, label):
    """Each replacement runs in the model on the CPU (the fused loss forced) and agrees with it."""
    sb = bench_modules["step_bench"]
    ablation = next(a for a in sb.ABLATIONS if label in a.label)
    calls: list = []
    kernels = Kernels(**{f: counting(fn, calls) for f, fn in ablation.kernels.items()})
    batch = _batch()
    model = Llama(CFG, seed=3, kernels=kernels)
    model._fused_loss = True
    torch.testing.assert_close(model(None, batch), Llama(CFG, seed=3)(None, batch), atol=1e-5, rtol=1e-5)
    assert set(calls) == set(ablation.kernels.values()) and calls


def test_foreach_grad_norm_patches_the_name_clip_consults_and_refuses_a_silent_rename(bench_modules, monkeypatch):
    sb = bench_modules["step_bench"]
    original = clip.uses_triton_squares
    grads = [torch.ones(3), torch.full((2, 2), 2.0)]
    with sb.foreach_grad_norm():
        assert clip.uses_triton_squares is not original and clip.uses_triton_squares(grads) is False
        torch.testing.assert_close(clip.squares(grads), torch.tensor([3.0, 16.0]))
    assert clip.uses_triton_squares is original
    monkeypatch.setattr(clip, "squares", lambda tensors: torch.zeros(len(tensors)))
    with pytest.raises(RuntimeError, match="no longer consults"):
        with sb.foreach_grad_norm():
            pass
    assert clip.uses_triton_squares is original


def test_bench_shapes_come_from_the_baseline_presets(bench_modules):
    sb = bench_modules["step_bench"]
    assert sb.SHAPES == {"1b": ("bench-1b", 8), "280m": ("bench-280m", 32)}


def test_the_bench_reference_cache_is_one_the_proxy_reads(bench_modules, tmp_path):
    """The cached-reference row reads its cache as the proxy does (`open_cache`, then
    `CachedReference`); `open_cache` refuses a cache in another format (the bench once wrote
    version 1 by hand after the format moved on)."""
    from doremi.methods.reference import CachedReference
    from doremi.methods.reference_cache import open_cache

    sb = bench_modules["step_bench"]
    mb, seq = 6, 8
    domains = sb.write_cache(tmp_path / "cache", mb, seq)
    sampling = [1.0 / sb.K_DOMAINS] * sb.K_DOMAINS
    arrays = open_cache(tmp_path / "cache", domains, seq, 3, mb, seed=0, sampling=sampling, synthetic=True)
    ref = CachedReference(tmp_path / "cache", domains, arrays, torch.device("cpu"))
    per_domain = -(-mb // sb.K_DOMAINS)
    assert [a.shape for a in ref.arrays] == [(per_domain, seq)] * sb.K_DOMAINS
    assert all(9.0 <= a.min() and a.max() <= 11.0 for a in ref.arrays)


def test_method_bench_runs_every_variant_on_a_tiny_preset_on_the_cpu(capsys, tmp_path):
    """`method_bench.main` on the `tiny` preset (CPU): one table row per variant with positive
    numbers and `vs plain` computed; Aioli's validation passes and ADO's refits fall inside the
    timed steps; DoReMi's proxy runs against its online reference, from a reference run the bench
    made for the preset, and its FP8 row is skipped with one line (no FP8 on the CPU); the run
    writes nothing but its two reports."""
    mb = bench_module("method_bench")
    out = tmp_path / "out"
    result = mb.main(["--presets", "tiny", "--steps", "4", "--warmup", "1", "--device", "cpu", "--out", str(out)])
    assert sorted(p.name for p in out.iterdir()) == ["method_bench.json", "method_bench.md"]
    rows = {r["variant"]: r for r in result["rows"]}
    # plain, then the catalog's trained methods in its order (DoReMi a proxy only), each with its option rows
    variants = ["plain", "doremi", "doremi-fp8", "doge", "doge-kpass", "odm", "aioli", "ado"]
    assert list(rows) == list(mb.VARIANTS) == variants
    skipped = rows.pop("doremi-fp8")
    assert skipped["step_s"] == 0 and skipped["note"] == "skipped: needs torchao and an FP8 GPU", skipped
    assert capsys.readouterr().out.count("skipped doremi-fp8") == 1
    for r in rows.values():
        assert r["step_s"] > 0 and r["tokens_per_s"] > 0 and len(r["steps_s"]) == 4, r
        assert r["grad_bytes"] == 4 * r["params"] > 0
    assert rows["aioli"]["val_passes"] > 0 and rows["aioli"]["val_s_per_step"] > 0
    assert all(rows[v]["val_passes"] == 0 for v in ("plain", "doremi", "odm", "ado", "doge", "doge-kpass"))
    assert rows["ado"]["refits"], "no ADO refit in the timed steps"
    assert rows["doremi"]["note"].startswith("online reference in the run's precision")
    # the CPU's fp32 update reads written gradients; on a GPU in bf16 it sums DoGE's rows itself
    assert rows["doge"]["note"] == "update unwritten (the optimizer summed the domain rows) in 0 of 5 steps"
    assert [n for n in result["notes"] if n.startswith("tiny reference: a one-step reference run")], result["notes"]
    text = (out / "method_bench.md").read_text()
    assert "tiny" in text and "CPU: not a result" in text and "--presets tiny" in text
    assert "DoReMi's FLOP floor against plain" in text and "= 0.75x" in text
    table = [line for line in text.splitlines() if line.startswith("| ") and not line.startswith("| variant")]
    assert [line.split("|")[1].strip() for line in table] == list(mb.VARIANTS)
    head = next(line for line in text.splitlines() if line.startswith("| variant")).split("|")
    vs = head.index(" vs plain ")
    assert table.pop(2).split("|")[1:-1] == [" doremi-fp8 ", *[" - "] * 7, " skipped: needs torchao and an FP8 GPU "]
    assert ">= 0.78x" in table[1].split("|")[-2]
    for line in table:
        cells = line.split("|")
        step_ms, tokens = float(cells[2]), float(cells[3].replace(",", ""))
        ratio = float(cells[vs])
        assert step_ms > 0 and tokens > 0 and ratio > 0, line
        variant = cells[1].strip()
        assert ratio == pytest.approx(rows["plain"]["step_s"] / rows[variant]["step_s"], abs=1e-3)
    assert float(table[0].split("|")[vs]) == 1.0


def test_method_bench_times_only_the_chosen_variants_in_the_catalogs_order(capsys, tmp_path):
    """`--variants doge-kpass,doge,plain` gives exactly those rows, plain first, and `--profile doge`
    one profile table, of that variant; an unknown name, or a profile of a variant not chosen or
    without --out, exits 2."""
    mb = bench_module("method_bench")
    argv = ["--presets", "tiny", "--steps", "1", "--warmup", "0", "--device", "cpu"]
    out = tmp_path / "out"
    result = mb.main([*argv, "--variants", "doge-kpass,doge,plain", "--profile", "doge", "--out", str(out)])
    assert [r["variant"] for r in result["rows"]] == ["plain", "doge", "doge-kpass"]
    assert all(r["step_s"] > 0 for r in result["rows"]), result["notes"]
    assert sorted(p.name for p in out.iterdir()) == [
        "method_bench.json",
        "method_bench.md",
        "profile_tiny_doge.txt",
        "trace_tiny_doge.json.gz",
    ]
    table = (out / "profile_tiny_doge.txt").read_text()  # DoGE's default step here: the one pass
    assert "Self CPU time total" in table and "_GroupLinearBackward" in table
    trace = json.loads(gzip.decompress((out / "trace_tiny_doge.json.gz").read_bytes()))
    marks = sorted(e["name"] for e in trace["traceEvents"] if e.get("name", "").startswith("bench step"))
    assert marks == ["bench step 0", "bench step 1"]
    for bad, said in (
        (["--variants", "plain,dogee"], "expected --variants of plain, doremi, doremi-fp8, doge"),
        (["--variants", "plain", "--profile", "doge", "--out", str(out)], "expected --profile of the chosen variants"),
        (["--variants", "plain", "--profile", "plain"], "expected --profile of the chosen variants"),
    ):
        with pytest.raises(SystemExit) as e:
            mb.main([*argv, *bad])
        assert e.value.code == 2 and said in capsys.readouterr().err


def test_stacked_bench_runs_both_sides_on_a_tiny_shape_on_the_cpu(capsys):
    """`stacked_bench.main` at a tiny shape on the CPU: the ordinary runs one by one and the
    stacked models both step, and the speed-up is the ratio of their step times."""
    sb = bench_module("stacked_bench")
    args = "--models 3 --single 2 --chunk-size 2 --d-model 32 --layers 1 --heads 2 --ffn 64 --vocab 128"
    result = sb.main([*args.split(), "--seq", "16", "--batch", "2", "--steps", "2", "--warmup", "1", "--device", "cpu"])
    assert result["models"] == 3 and result["params_per_model"] > 0
    assert result["single_step_s"] > 0 and result["stacked_step_s"] > 0
    assert result["speedup"] == pytest.approx(3 * result["single_step_s"] / result["stacked_step_s"])
    assert "CPU: not a result" in capsys.readouterr().out


def test_mamba_bench_runs_the_layer_and_the_hybrid_step_on_the_cpu(tmp_path):
    """`mamba_bench.main` at the `hybrid-tiny` shape on the CPU: the mixer's fwd+bwd and the
    hybrid step are timed, and the step's MFU is tokens/s x the counted FLOPs / 989e12."""
    bench = bench_module("mamba_bench")
    argv = ["--preset", "hybrid-tiny", "--micro-batch", "2", "--seq", "20", "--steps", "2", "--warmup", "1"]
    result = bench.main([*argv, "--device", "cpu", "--no-compile", "--out", str(tmp_path)])
    layer, step = result["rows"]
    assert layer["variant"] == "eager" and layer["ms"] > 0 and layer["tflops"] > 0
    assert step["mfu"] == pytest.approx(step["tokens_per_s"] * step["flops_per_token"] / 989e12)
    assert (tmp_path / "mamba_bench.json").exists()


def test_moe_bench_runs_both_moe_implementations_and_the_step_on_the_cpu(tmp_path):
    """`moe_bench.main` at the `moe-tiny` shape on the CPU: the framework's dropless MoE (eager and
    compiled, its graph breaks counted) and the plain per-expert loop compute the same outputs
    and are all timed, each framework row with its speedup over the loop; the step's MFU is
    tokens/s x the counted (active) FLOPs / 989e12."""
    bench = bench_module("moe_bench")
    argv = ["--preset", "moe-tiny", "--micro-batch", "2", "--seq", "16", "--steps", "2", "--warmup", "1"]
    result = bench.main([*argv, "--device", "cpu", "--out", str(tmp_path)])
    ours, plain, ours_compiled, plain_compiled, step = result["rows"]
    assert ours["variant"] == ours_compiled["variant"] == "framework" and plain["variant"] == "plain"
    assert not ours["compiled"] and ours_compiled["compiled"] and ours["ms"] > 0 and plain["ms"] > 0
    assert ours["speedup_vs_plain"] == pytest.approx(plain["ms"] / ours["ms"])
    assert ours["max_abs_diff"] < 1e-5 and ours["grouped_mm"] is False
    assert ours_compiled["graph_breaks"] >= 0 and plain_compiled["variant"] == "plain" and not step["compiled"]
    assert ours_compiled["speedup_vs_plain"] == pytest.approx(plain_compiled["ms"] / ours_compiled["ms"])
    assert step["mfu"] == pytest.approx(step["tokens_per_s"] * step["flops_per_token"] / 989e12)
    assert (tmp_path / "moe_bench.json").exists()


def _fp8_bench():
    return bench_module("fp8_bench")


def test_fp8_bench_steps_smoke_compiles_ours_and_torchaos_plain_model_on_the_cpu(tmp_path):
    """`fp8_bench.py step --smoke --with-head`: our model and plain_llama, bf16, FP8 tensorwise
    and FP8 tensorwise with the LM head in FP8 too (torchao emulated), each compiled (`aot_eager`)
    in one run; ratios to each model's own bf16 row, and the FP8 steps add no graph break to
    their model's bf16 step."""
    pytest.importorskip("torchao.float8")
    result = _fp8_bench().main(["step", "--smoke", "--with-head", "--out", str(tmp_path)])
    rows = {(r["model"], r["variant"]): r for r in result["rows"]}
    assert set(rows) == {(m, v) for m in ("ours", "plain") for v in ("bf16", "tensorwise", "tensorwise+head")}
    for (model, _), r in rows.items():
        assert r["size"] == "smoke" and r["ms"] > 0
        assert r["ratio_vs_bf16"] == pytest.approx(r["tokens_per_s"] / rows[(model, "bf16")]["tokens_per_s"])
    for model in ("ours", "plain"):
        breaks = {rows[(model, v)]["graph_breaks"] for v in ("bf16", "tensorwise", "tensorwise+head")}
        assert breaks == ({0} if model == "plain" else {rows[("ours", "bf16")]["graph_breaks"]})
    assert result["native_fp8"] is False and (tmp_path / "fp8_step.json").exists()


def test_fp8_bench_times_each_size_at_its_own_micro_batch_and_only_the_head_rows(monkeypatch, capsys):
    """`--sizes 1b 4096 --micro-batch 16 4 --only-with-head`: each size's rows at its own
    micro-batch, one FP8 row per model (with the head); a count of micro-batches that is neither
    one nor one per size exits 2 before anything is built."""
    fb = _fp8_bench()
    seen = []

    def fake(model):
        def row(cfg, args, device, *rest):
            seen.append((model, cfg.d_model, args.micro_batch, rest))
            return {"part": "step", "model": model, "ms": 1.0, "tokens_per_s": 100.0, "graph_breaks": 0}

        return row

    monkeypatch.setattr(fb, "ours", fake("ours"))
    monkeypatch.setattr(fb, "plain", fake("plain"))
    argv = ["step", "--device", "cpu", "--sizes", "1b", "4096", "--only-with-head"]
    result = fb.main([*argv, "--micro-batch", "16", "4"])
    got = [(r["size"], r["micro_batch"], r["model"], r["variant"]) for r in result["rows"]]
    assert got == [
        (size, mb, model, variant)
        for size, mb in (("1b", 16), ("4096", 4))
        for model, variant in (
            ("ours", "bf16"),
            ("ours", "tensorwise+head"),
            ("plain", "bf16"),
            ("plain", "tensorwise+head"),
        )
    ]
    assert [(m, d, mb) for m, d, mb, _ in seen] == [
        (m, d, mb) for d, mb in ((2048, 16), (4096, 4)) for m in ("ours", "ours", "plain", "plain")
    ]
    assert {r["micro_batch"] for r in fb.main([*argv, "--micro-batch", "8"])["rows"]} == {8}
    with pytest.raises(SystemExit) as e:
        fb.main([*argv, "--micro-batch", "16", "4", "2"])
    assert e.value.code == 2 and "--micro-batch: one positive value, or one per size (2)" in capsys.readouterr().err


def test_fp8_bench_train_smoke_runs_both_arms_and_plots_their_curves(stores, tmp_path):
    """`fp8_bench.py train --smoke --with-head`: a few steps of bf16, FP8 and FP8 with the LM head
    in FP8 too (the tests' tiny model and data), finite losses, the final validation losses and
    their ratio, one plot; a rerun reads the finished runs instead of training again."""
    pytest.importorskip("torchao.float8")
    from tests.runs import config_path

    yaml = config_path(stores, tmp_path / "unused")
    argv = ["train", "--smoke", "--train-steps", "3", "--config", str(yaml), "--work", str(tmp_path / "w")]
    argv += ["--with-head", "--out", str(tmp_path)]
    result = _fp8_bench().main(argv)
    bf16, fp8, head = result["rows"]
    assert (bf16["variant"], fp8["variant"], head["variant"]) == ("bf16", "tensorwise", "tensorwise+head")
    assert head["finite"] and head["curve"] != fp8["curve"] and abs(head["val_loss_vs_bf16"]) < 0.05
    assert [s for s, _ in fp8["curve"]] == [1, 2, 3] and bf16["finite"] and fp8["finite"]
    assert fp8["val_loss_vs_bf16"] == pytest.approx(fp8["final_val_loss"] / bf16["final_val_loss"] - 1)
    assert fp8["curve"] != bf16["curve"] and abs(fp8["val_loss_vs_bf16"]) < 0.05
    assert fp8["nonfinite_steps"] == [] and fp8["seconds"] > 0 and fp8["val_curve"][-1] == (3, fp8["final_val_loss"])
    assert fp8["accepted"] == (abs(fp8["val_loss_vs_bf16"]) <= 0.005)
    assert (tmp_path / "fp8_train.png").stat().st_size > 0 and (tmp_path / "fp8_train.json").exists()
    assert _fp8_bench().main(argv)["rows"] == result["rows"]


def test_fp8_bench_counts_the_steps_whose_loss_or_gradient_norm_is_not_finite():
    rows = [{"step": 1, "loss": 2.0, "grad_norm": 1.0}, {"step": 2, "loss": float("nan"), "grad_norm": 1.0}]
    rows += [{"step": 3, "loss": 2.0, "grad_norm": float("inf")}, {"step": 3, "val_loss": {"a": 1.0}}]
    rows += [{"step": 4, "loss": "nan", "grad_norm": 1.0}]  # as metrics.jsonl writes it
    assert _fp8_bench().nonfinite_steps(rows) == [2, 3, 4]


def test_fp8_bench_converts_the_same_linears_in_plain_and_parses_inductor_settings():
    bench = _fp8_bench()
    keep = bench.plain_filter(("gate_up", "down"))
    fqns = ["layers.0.wqkv", "layers.0.wo", "layers.0.w_gate_up", "layers.3.w_down", "output"]
    assert [f for f in fqns if keep(None, f)] == ["layers.0.w_gate_up", "layers.3.w_down"]
    assert not bench.plain_filter(tuple(bench.PLAIN_LINEARS))(None, "output")  # the head stays bf16
    assert bench.plain_filter((), head=True)(None, "output")
    settings = ["coordinate_descent_tuning=true", "max_autotune_gemm_backends=TRITON,ATEN"]
    assert bench.inductor_settings(settings) == {
        "coordinate_descent_tuning": True,
        "max_autotune_gemm_backends": "TRITON,ATEN",
    }
    with pytest.raises(ValueError, match="torch._inductor.config key, got 'no_such_key=1'"):
        bench.inductor_settings(["no_such_key=1"])


class _Parsed(Exception):
    """Raised in place of running a bench once its command line has parsed."""


def test_gpu_queue_commands_parse_write_under_out_and_fit_the_device_limit(monkeypatch):
    """Each call of experiments/tools/bench/gpu_queue.sh: every command line parses with its
    bench's own parser, names presets that exist, writes only under $OUT (nothing else comes back
    from the device machine), tees to a log name of its own (the eleventh session's call 2 wrote two
    runs to one name and kept only the second), and the timeouts of one call fit the tool's 600 s."""
    import argparse
    import subprocess

    from trainer.config.presets import PRESETS

    queue = BENCH / "gpu_queue.sh"
    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        raise _Parsed(original(self, args, namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    monkeypatch.syspath_prepend(str(BENCH))
    monkeypatch.syspath_prepend(str(BENCH.parent))  # experiments/tools/mup_transfer.py
    for call in range(1, 16):
        lines = subprocess.run(["bash", str(queue), "--print", str(call)], capture_output=True, text=True, check=True)
        rows = [line.split() for line in lines.stdout.splitlines()]
        assert sum(int(r[1]) for r in rows) <= 600 - 20, call
        labels = [r[0] for r in rows]
        assert len(set(labels)) == len(labels), (call, labels)
        for label, _, _, script, *argv in rows:
            name = Path(script).stem
            assert label.startswith(name), (label, script)
            if script.startswith("tests/"):  # the CUDA checks, run as a script, all or those the words name
                tests = re.findall(r"^def (test_\w+)", (ROOT / script).read_text(), re.M)
                assert tests and all(any(word in t for t in tests) for word in argv), (script, argv)
                continue
            module = importlib.import_module(name)
            with pytest.raises(_Parsed) as parsed:
                module.main(argv)
            args = vars(parsed.value.args[0])
            if args.get("out") is not None:
                assert str(args["out"]).startswith("$OUT/"), name
            if args.get("preset") is not None:
                assert args["preset"] in PRESETS, name
    bad = subprocess.run(
        ["bash", str(queue), "16"], capture_output=True, text=True, env={"OUT": "/tmp/x", "PATH": "/usr/bin:/bin"}
    )
    assert bad.returncode == 2 and bad.stderr.strip() == "gpu_queue.sh: expected a call number 1 to 15, got '16'"


def test_the_cuda_checks_run_in_the_order_of_the_words_given():
    """`python tests/test_gpu.py WORD ...` runs the checks whose names hold a word, in the order of
    the first word each holds (gpu_queue's call names the new checks first); none given, all in
    name order."""
    import tests.test_gpu as gpu

    names = [t.__name__ for t in gpu._in_order(["group_norm", "doge", "triton_rope"])]
    assert names == [
        "test_group_norm_backward_on_cuda_matches_the_torch_path",
        "test_doge_embedding_gradients_on_cuda_sum_in_fp32_without_a_host_sync",
        "test_doge_one_pass_on_cuda_gives_each_groups_own_gradient",
        "test_triton_rope_matches_the_compiled_torch_ops_at_the_bench_shape",
    ]
    every = [t.__name__ for t in gpu._in_order([])]
    assert every == sorted(every) and len(every) == len([n for n in vars(gpu) if n.startswith("test_")])


def test_doge_kernels_bench_norm_part_times_the_committed_launch_and_every_choice(monkeypatch):
    """The `norm` part's code on the CPU (the op's torch path; inductor left out): the plain
    reference, the committed launch and each of `NORM_CHOICES`, a step's estimate over the
    preset's norms, every choice's result the committed one's."""
    bench = bench_module("doge_kernels_bench")
    monkeypatch.setattr(torch, "compile", lambda fn: fn)
    shapes = bench.parameter_shapes("tiny")
    norms = sum(1 for n, _ in shapes if n.endswith("norm.weight"))
    rows = bench.norm_part(shapes, [2, 0, 1], 8, 1, torch.device("cpu"))
    assert [r["form"] for r in rows[:2]] == ["plain (inductor)", "one pass, committed"]
    assert len(rows) == 2 + len(bench.NORM_CHOICES)
    assert all(r["ms"] > 0 and abs(r["step_ms"] - r["ms"] * norms) < 1e-9 for r in rows)
    assert all(r["rel_diff"] == 0.0 for r in rows[2:])


def test_doge_kernels_bench_times_every_weight_gradient_form_and_checks_it(capsys, tmp_path):
    """On the CPU the bench's `dw` part runs (the Triton parts say they need CUDA): every linear
    kind of the preset in three forms, each within fp32 rounding of the committed op's per-group
    sums (plain: of their total); bad arguments exit 2 with one line."""
    bench = bench_module("doge_kernels_bench")
    out = tmp_path / "out"
    result = bench.main(["--preset", "tiny", "--seq", "16", "--reps", "1", "--device", "cpu", "--out", str(out)])
    kinds = {r["kind"] for r in result["dw"]}
    assert kinds == {"qkv", "out", "gate_up", "down", "head"}
    assert [r["form"] for r in result["dw"][:3]] == ["rows", "batch-major", "plain"]
    assert all(r["rel_diff"] < 1e-5 and r["ms"] > 0 for r in result["dw"])
    assert {r["count"] for r in result["dw"] if r["kind"] != "head"} == {2}
    assert result["notes"] == ["gram, update, norm: skipped (the Triton kernels need CUDA here)"]
    assert "A step's weight gradients: rows" in (out / "doge_kernels.md").read_text()
    assert json.loads((out / "doge_kernels.json").read_text())["groups"] == [2, 2, 2, 2, 1]
    for bad, said in ((["--parts", "gramm"], "expected --parts of"), (["--groups", "3"], "expected --groups of")):
        with pytest.raises(SystemExit) as e:
            bench.main([*bad, "--device", "cpu"])
        assert e.value.code == 2 and said in capsys.readouterr().err


def test_the_idle_report_places_each_gap_between_its_kernels():
    """`timing.idle_lines` over kernels and host ops (the profiler's fields): the idle per step,
    the gaps by length, and the longest first with its start in the span, the kernels either
    side and the innermost host op running when it began; a step's `record_function` range on
    the device (a user annotation) is no kernel."""
    timing = bench_module("timing")

    def event(name, device, start, end, annotation=False):
        return SimpleNamespace(
            name=name,
            device_type=SimpleNamespace(name=device),
            time_range=SimpleNamespace(start=start, end=end),
            is_user_annotation=annotation,
        )

    events = [
        event("bench step 0", "CUDA", 1000.0, 6100.0, annotation=True),  # a step's range: not work
        event("bench step 1", "CUDA", 1000.0, 6100.0),  # the same, where the profiler does not flag it
        event("gemm", "CUDA", 1000.0, 2000.0),
        event("gram", "CUDA", 2010.0, 2500.0),
        event("adamw", "CUDA", 2550.0, 3000.0),
        event("embedding", "CUDA", 6000.0, 6100.0),
        event("train_step", "CPU", 0.0, 7000.0),
        event("aten::fill_", "CPU", 2900.0, 5900.0),
        event("aten::cat", "CPU", 2495.0, 2540.0),
    ]
    lines = timing.idle_lines(events, steps=2)
    assert lines[0] == "GPU idle: 3.06 ms of the kernels' 5.10 ms span (2 step(s), 1.53 ms a step)"
    assert lines[1] == "  gaps by length: < 20 us: 1 (0.01 ms); 20-200 us: 1 (0.05 ms); >= 200 us: 1 (3.00 ms)"
    assert lines[3].split() == ["2.000", "ms", "3.000", "ms", "adamw", "->", "embedding", "host:", "aten::fill_"]
    assert lines[4].split() == ["1.500", "ms", "0.050", "ms", "gram", "->", "adamw", "host:", "aten::cat"]
    assert lines[5].split() == ["1.000", "ms", "0.010", "ms", "gemm", "->", "gram", "host:", "train_step"]
    assert timing.gap_sizes([]) == [("< 20 us", 0, 0.0), ("20-200 us", 0, 0.0), (">= 200 us", 0, 0.0)]


def test_idle_gaps_are_the_stretches_no_kernel_covers():
    """`timing.idle_gaps` over overlapping kernels (two streams) and out-of-order intervals: the
    span from the first start to the last end, the uncovered stretches longest first, their sum."""
    timing = bench_module("timing")
    span, idle, gaps = timing.idle_gaps([(10.0, 20.0), (0.0, 5.0), (3.0, 8.0), (30.0, 31.0), (15.0, 25.0)])
    assert (span, idle, gaps) == (31.0, 7.0, [(25.0, 30.0), (8.0, 10.0)])
    assert timing.idle_gaps([(0.0, 4.0), (4.0, 6.0)]) == (6.0, 0.0, [])
    assert timing.idle_gaps([]) == (0.0, 0.0, [])
