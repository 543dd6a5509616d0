"""DoReMi: Group DRO over domains on the excess loss over a reference model (Xie, Pham, Dong,
Du, Liu, Lu, Liang, Le, Ma and Yu 2023, "DoReMi: Optimizing Data Mixtures Speeds Up Language
Model Pretraining", NeurIPS, Algorithm 1; released code sangmichaelxie/doremi).

Its options are `mixing.doremi` (config.py); the update is method.py over update.py's math, the
reference losses come from reference.py (a frozen model run online) or reference_cache.py (a
cache written by `doremi score`). It needs a reference, so it runs as a proxy only: the pipeline
trains the reference first (docs/design.md section 4)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from doremi.methods.doremi.config import DoReMiConfig
from doremi.methods.spec import PROXY, MethodSpec, Reads
from trainer.run.hooks import MethodContext, MixingHook


def build(cfg: Any, ctx: MethodContext) -> MixingHook:
    """The proxy's hook, its reference losses read from `reference_cache` when set, else from
    the frozen reference checkpoint run online (its linears in FP8 with `reference_fp8`)."""
    from data.sampling.weights import resolve_weights
    from data.store.store import read_manifest
    from doremi.methods.doremi.method import DoReMi
    from doremi.methods.reference import (
        CachedReference,
        OnlineReference,
        fp8_reference,
        load_frozen,
        reference_config,
        require_reference,
    )
    from doremi.methods.reference_cache import open_cache
    from trainer.build import RunFacts

    d = cfg.mixing.doremi
    manifest = read_manifest(cfg.data.store_dir)
    sampling = resolve_weights(d.proxy_sampling, manifest, "mixing.doremi.proxy_sampling", cfg.budget_tokens)
    if d.reference_cache:
        arrays = open_cache(
            Path(d.reference_cache),
            ctx.domains,
            cfg.data.seq_len,
            steps=cfg.train.steps,
            global_batch_size=cfg.train.global_batch_size,
            seed=cfg.data.seed,
            sampling=sampling.tolist(),
            reference=d.reference,
        )
        ref = CachedReference(d.reference_cache, ctx.domains, arrays, ctx.device)
    else:
        ck = require_reference(cfg)
        ref_cfg = reference_config(cfg, ck)
        if d.reference_fp8:
            ref_cfg = fp8_reference(ref_cfg, "mixing.doremi.reference_fp8")
        ref_facts = RunFacts.resolve(ref_cfg, ctx.pc)
        ref = OnlineReference(load_frozen(ref_cfg, ck, ctx.pc, ref_facts), ref_facts, ctx.pc)
    return DoReMi(d, ctx, sampling, ref)


SPEC = MethodSpec(
    name="doremi",
    cite="Xie et al. 2023, DoReMi (NeurIPS), Algorithm 1; github sangmichaelxie/doremi",
    # the proxy's and the reference's per-token losses on the training batch (excess loss)
    reads=Reads(training_batches=True, reference_losses=True),
    roles=(PROXY,),
    config=DoReMiConfig,
    build=build,
    needs_reference=True,
    moved_from="doremi",
    # the options that change alpha_t, which a weights file averaged from the proxy records: the
    # update (eta, smoothing, update, mode), the data the proxy draws (proxy_sampling) and the
    # reference losses it reads (reference_fp8: FP8 rounding). The reference's identity is in
    # the proxy's fingerprint (`reference`, `reference_cache` are path options), which the
    # file's `sources` names; `reference_weights` is not read by a proxy given its reference.
    average_keys=("eta", "smoothing", "update", "mode", "proxy_sampling", "reference_fp8"),
    path_options=("reference", "reference_weights", "proxy_sampling", "reference_cache"),
    bookkeeping_options=("rounds", "rounds_tolerance", "average_from_step"),
)
