"""Spectral muP (`model.mup`): width-independent feature learning, so that a learning rate and an
init tuned at `base_width` transfer to wider models (Yang, Simon & Bernstein 2023, "A Spectral
Condition for Feature Learning", arXiv:2310.17813; Yang & Hu 2021, Tensor Programs IV/V for
the readout and attention rules).

The spectral condition (paper, Condition 1): every weight W_l [fan_out, fan_in] and its update
should have spectral norm Theta(sqrt(fan_out / fan_in)). The rules used here, as multipliers
of the configured base values (init_std, train.lr) at width ratio r = d_model / base_width, so
that the model at r = 1 is exactly the model without muP (muTransfer's base model):

- init of a hidden matrix (q/k/v, o, gate/up, down; any 2-D weight but the embedding and the
  head): std proportional to sigma(fan_in, fan_out) = (1 / sqrt(fan_in)) * min(1, sqrt(fan_out
  / fan_in)) (paper, Parametrization 1); multiplier sigma(fans) / sigma(fans / r),
  i.e. 1 / sqrt(r) when both fans grow with the width. The GPT-2 depth scaling still applies.
- Adam learning rate of a hidden matrix: proportional to 1 / fan_in, multiplier 1 / r. Adam's
  update is sign-like, so its spectral norm is about lr * sqrt(fan_in * fan_out); setting that
  to sqrt(fan_out / fan_in) (Condition 1 for the update) gives lr ~ 1 / fan_in, the muP
  Adam rule of TP-V Table 3. The paper's SGD rule lr ~ fan_out / fan_in (its Parametrization 1)
  is not what an Adam run needs: under Adam it would leave hidden updates growing like r.
- embedding (one-hot inputs, fan_in = vocabulary fixed): the condition asks for Theta(1) entries,
  so init and lr are the base ones (multiplier 1).
- readout (head): logits multiplied by 1 / r; init and lr multipliers 1, so the effective head
  weight W / r has std ~ 1 / fan_in and Adam step ~ 1 / fan_in (TP-V Table 3, the output
  multiplier form, as the `mup` package's MuReadout). With tied embeddings the same multiplier
  applies to the shared weight.
- attention logits scaled by 1 / d_head instead of 1 / sqrt(d_head) (TP-V Section 4: q and k
  become correlated during training, so q.k grows like d_head): sqrt(base_head_dim) / head_dim,
  which is 1 / sqrt(head_dim) at the base width (n_heads fixed, head_dim = d_model / n_heads).
- norms and other vectors: multiplier 1; so is the Mamba-2 depthwise convolution
  (`mamba.conv_weight` [channels, d_conv]: each channel's own d_conv taps, a fan-in that does
  not grow with the width, not a matrix acting on a width-sized vector).
- MoE: each expert's [fan_out, fan_in] slice of `mlp.experts.gate_up` / `mlp.experts.down` is a
  hidden matrix; the router [experts, d] is one whose fan_out (the expert count) stays fixed, so
  its init multiplier is sigma(d, E) / sigma(d / r, E) (1 / r for E < d / r) and its lr 1 / r.

Zero init (`model.mup.zero_init`, off by default): the head and the query rows of each
`attn.qkv` start at zero, TP-V's recommendation (Yang et al. 2022, Appendix D.2; the `mup`
package's `readout_zero_init` / `query_zero_init`). The random readout and queries of a finite
width add fluctuations of the logits and attention at init that shrink with the width (the
infinite-width limit has none), so the narrow model's best lr differs from the wide one's. The
first step moves only the head (a zero head passes no gradient back), the later ones every
weight. Refused with tied embeddings (a tied head is the embedding).

A hidden matrix's weight decay is multiplied by r as its lr is divided by it
(`trainer.optim.param_groups.scaled_weight_decay`, the `mup` package's MuAdam rule), so the
per-step decay lr * wd stays the base width's. Adam's eps (1e-8) is also unscaled: at width 1024 the hidden matrices' median sqrt(v) is
still about 1.6e-5 (a CPU check, 40 steps of the sweep), so eps does not enter the update.
Widths grow head_dim with n_heads fixed, which the 1 / d_head attention scale is for (TP-V
Section 4).

Learning-rate multipliers are set on the parameters (`_lr_scale`) and read by the optimizers'
param groups (`trainer.optim.param_groups`). Checkpoints hold the same tensors; the muP
multipliers are part of the function the weights compute, so a muP checkpoint must be loaded
with the same `model.mup`.
"""

from __future__ import annotations

import math

import torch.nn as nn

_VOCAB_MATRICES = ("embed.weight", "head.weight")
#: 2-D parameters that are not matrices acting on a width-sized vector (see the module docstring).
_NOT_MATRICES = ("mamba.conv_weight",)
#: Stacked per-expert matrices [experts, fan_out, fan_in].
_EXPERT_MATRICES = ("mlp.experts.gate_up", "mlp.experts.down")
#: Matrices whose fan_out is a count that does not grow with the width.
_FIXED_FAN_OUT = ("mlp.router.weight",)


def spectral_sigma(fan_in: float, fan_out: float) -> float:
    """The spectral init scale (1 / sqrt(fan_in)) * min(1, sqrt(fan_out / fan_in))."""
    return (1.0 / math.sqrt(fan_in)) * min(1.0, math.sqrt(fan_out / fan_in))


def width_ratio(cfg) -> float:
    return cfg.d_model / cfg.mup.base_width


def matrix_fans(name: str, shape: tuple[int, ...]) -> tuple[int, int, bool] | None:
    """(fan_out, fan_in, whether fan_out grows with the width) of a hidden matrix (`shape`: the
    single-process one); None for the embedding, the head, vectors and `_NOT_MATRICES`. fan_in
    always grows: every hidden matrix reads a width-sized vector."""
    if name.endswith(_VOCAB_MATRICES + _NOT_MATRICES):
        return None
    if len(shape) == 3 and name.endswith(_EXPERT_MATRICES):
        fan_out, fan_in = shape[1:]
    elif len(shape) == 2:
        fan_out, fan_in = shape
    else:
        return None
    return fan_out, fan_in, not name.endswith(_FIXED_FAN_OUT)


def is_hidden_matrix(name: str, shape: tuple[int, ...]) -> bool:
    return matrix_fans(name, shape) is not None


def init_multiplier(name: str, shape: tuple[int, ...], cfg) -> float:
    """Multiplier of the base init std of parameter `name` (single-process `shape` [out, in]):
    sigma of its fans over sigma of the base model's (the growing fans divided by r)."""
    fans = matrix_fans(name, shape) if getattr(cfg, "mup", None) is not None else None
    if fans is None:
        return 1.0
    r = width_ratio(cfg)
    fan_out, fan_in, out_grows = fans
    return spectral_sigma(fan_in, fan_out) / spectral_sigma(fan_in / r, fan_out / r if out_grows else fan_out)


def lr_multiplier(name: str, shape: tuple[int, ...], cfg) -> float:
    """Multiplier of train.lr for parameter `name`: Adam lr ~ 1 / fan_in for hidden matrices."""
    fans = matrix_fans(name, shape) if getattr(cfg, "mup", None) is not None else None
    if fans is None:
        return 1.0
    return 1.0 / width_ratio(cfg)


def logit_multiplier(cfg) -> float:
    return 1.0 if getattr(cfg, "mup", None) is None else 1.0 / width_ratio(cfg)


def attention_scale(cfg) -> float | None:
    """The softmax scale of q.k: sqrt(base_head_dim) / head_dim under muP, None (SDPA's
    1 / sqrt(head_dim)) without."""
    if getattr(cfg, "mup", None) is None:
        return None
    base_head_dim = cfg.head_dim / width_ratio(cfg)
    return math.sqrt(base_head_dim) / cfg.head_dim


def zero_rows(name: str, cfg) -> int:
    """How many leading rows of parameter `name`'s single-process tensor `model.mup.zero_init`
    sets to zero: all of the head's, the q rows of a fused [q; k; v] projection (the first
    n_heads x head_dim); 0 otherwise. Zeroed after the normal draw, so every other value is the
    one drawn without zero_init, and before the tp cut, so each rank holds its heads' zero q
    rows and tp1 and tp2 give the same model."""
    mup = getattr(cfg, "mup", None)
    if mup is None or not mup.zero_init:
        return 0
    if name == "head.weight":
        return cfg.vocab_size
    if name.endswith("attn.qkv.weight"):
        return cfg.n_heads * cfg.head_dim
    return 0


def apply_mup(stage: nn.Module, cfg) -> None:
    """Set the muP multipliers on a built stage: each parameter's `_lr_scale`, the attention
    softmax scale, the readout's logit multiplier. No-op without `model.mup`."""
    if getattr(cfg, "mup", None) is None:
        return
    from trainer.parallel.shard import full_shape

    for name, p in stage.named_parameters():
        p._lr_scale = lr_multiplier(name, full_shape(p), cfg)
    scale = attention_scale(cfg)
    for module in stage.modules():
        if hasattr(module, "softmax_scale"):
            module.softmax_scale = scale
    stage.logit_scale = logit_multiplier(cfg)
