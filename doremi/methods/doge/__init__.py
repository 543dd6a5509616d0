"""DoGE: domain reweighting with generalization estimation (Fan, Pagliardini and Jaggi 2024,
ICML, Algorithm 1; released code Olivia-fsm/DoGE at commit 88400e9). Options `mixing.doge`
(config.py), the update in method.py, whose docstring names each difference from the paper and
the released code."""

from __future__ import annotations

from typing import Any

from doremi.methods.doge.config import DoGEConfig
from doremi.methods.spec import ONLINE, PROXY, MethodSpec, Reads
from trainer.run.hooks import MethodContext, MixingHook


def one_pass_blocker(cfg: Any) -> str | None:
    """Why the one pass (`mixing.doge.one_pass`, trainer/run/group_grads.py: per-domain weight
    gradients of dense linears, norms and the embedding) cannot run this layout, or None."""
    from trainer.config.mamba import has_mamba

    m, par = cfg.model, cfg.parallelism
    reasons = [
        (par.tp > 1, f"parallelism.tp = {par.tp}"),
        (par.pp > 1, f"parallelism.pp = {par.pp}"),
        (m.moe is not None, "model.moe is set"),
        (has_mamba(m), "model.block_pattern has Mamba blocks"),
        (m.fp8 is not None, "model.fp8 is set"),
    ]
    return next((text for bad, text in reasons if bad), None)


def one_pass(cfg: Any) -> bool:
    """Whether the run takes the one pass: `mixing.doge.one_pass` null (the default) takes it
    wherever the layout allows (measured at 1B on one H100: 0.784 of a plain step, the k passes
    0.484; experiments/results/gpu_session15), true insists on it, false takes the k passes."""
    chosen = cfg.mixing.doge.one_pass
    return one_pass_blocker(cfg) is None if chosen is None else chosen


def check_layout(cfg: Any) -> None:
    """DoGE's step runs each domain's sequences of a rank as their own micro-batches, so dp ranks
    run different numbers of forwards; expert parallelism's all-to-all needs every rank of its
    group in every forward, so the two would wait on each other for ever: refused. The one pass
    asked for (`one_pass: true`) where tp, pp, MoE or Mamba blocks or FP8 linears are set is
    refused; left null, those layouts take the k passes."""
    from trainer.config.tools import ConfigError

    if cfg.parallelism.ep > 1:
        raise ConfigError(
            f"mixing.doge: DoGE's per-domain gradients do not run under expert parallelism "
            f"(parallelism.ep = {cfg.parallelism.ep}); expected parallelism.ep: 1"
        )
    why = one_pass_blocker(cfg) if cfg.mixing.doge.one_pass else None
    if why:
        raise ConfigError(
            f"mixing.doge.one_pass: per-domain gradients in one pass need a dense model at tp 1 and pp 1 "
            f"without FP8, got {why}; set mixing.doge.one_pass: false (or null: the k passes where the "
            f"layout needs them)"
        )


def extra_sequences(options: dict[str, Any], global_batch_size: int) -> int:
    """The target batch's sequences per step, trained on top of the batch (the cost ledger)."""
    from doremi.methods.doge.method import target_sequences

    return target_sequences(DoGEConfig(target_sequences=options.get("target_sequences")), global_batch_size)


def build(cfg: Any, ctx: MethodContext) -> MixingHook:
    from data.sampling.weights import resolve_weights
    from data.store.store import read_manifest
    from doremi.methods.doge.method import DoGE, target_sequences

    check_layout(cfg)
    manifest = read_manifest(cfg.data.store_dir)
    d = cfg.mixing.doge
    sampling = resolve_weights(d.sampling, manifest, "mixing.doge.sampling", cfg.budget_tokens)
    target = resolve_weights(d.target, manifest, "mixing.doge.target", cfg.budget_tokens)
    return DoGE(d, ctx, sampling, target, target_sequences(d, cfg.train.global_batch_size), one_pass(cfg))


SPEC = MethodSpec(
    name="doge",
    cite="Fan, Pagliardini and Jaggi 2024, DoGE (ICML), Algorithm 1; github Olivia-fsm/DoGE 88400e9",
    # per-domain training gradients and the gradient of target batches drawn from validation
    reads=Reads(training_batches=True, gradients=True, validation=("method_target",)),
    roles=(PROXY, ONLINE),
    config=DoGEConfig,
    build=build,
    check=check_layout,
    extra_sequences=extra_sequences,
    # its builder reads the stores' manifest; its config checks its keys
    preflight_builds=False,
)
