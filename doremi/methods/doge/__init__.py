"""DoGE: domain reweighting with generalization estimation (Fan, Pagliardini and Jaggi 2024,
ICML, Algorithm 1; released code Olivia-fsm/DoGE at commit 88400e9). Options `mixing.doge`
(config.py), the update in method.py, whose docstring names each difference from the paper and
the released code."""

from __future__ import annotations

from typing import Any

from doremi.methods.doge.config import DoGEConfig
from doremi.methods.spec import ONLINE, PROXY, MethodSpec, Reads
from trainer.run.hooks import MethodContext, MixingHook


def check_layout(cfg: Any) -> None:
    """DoGE's step runs each domain's sequences of a rank as their own micro-batches, so dp ranks
    run different numbers of forwards; expert parallelism's all-to-all needs every rank of its
    group in every forward, so the two would wait on each other for ever: refused."""
    from trainer.config.tools import ConfigError

    if cfg.parallelism.ep > 1:
        raise ConfigError(
            f"mixing.doge: DoGE's per-domain gradients do not run under expert parallelism "
            f"(parallelism.ep = {cfg.parallelism.ep}); expected parallelism.ep: 1"
        )


def extra_sequences(options: dict[str, Any], global_batch_size: int) -> int:
    """The target batch's sequences per step, trained on top of the batch (the cost ledger)."""
    from doremi.methods.doge.method import target_sequences

    return target_sequences(DoGEConfig(target_sequences=options.get("target_sequences")), global_batch_size)


def build(cfg: Any, ctx: MethodContext) -> MixingHook:
    from data.store import read_manifest
    from data.weights import resolve_weights
    from doremi.methods.doge.method import DoGE, target_sequences

    check_layout(cfg)
    manifest = read_manifest(cfg.data.store_dir)
    d = cfg.mixing.doge
    sampling = resolve_weights(d.sampling, manifest, "mixing.doge.sampling", cfg.budget_tokens)
    target = resolve_weights(d.target, manifest, "mixing.doge.target", cfg.budget_tokens)
    return DoGE(d, ctx, sampling, target, target_sequences(d, cfg.train.global_batch_size))


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
