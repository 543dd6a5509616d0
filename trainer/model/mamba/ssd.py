"""The Mamba-2 selective state-space scan: the token-by-token recurrence and its chunked form.

Dao & Gu 2024, "Transformers are SSMs: Generalized Models and Efficient Algorithms Through
Structured State Space Duality" (SSD). Per head h with state size N and head dimension P, a
scalar decay A_h < 0 and per-token step dt_t > 0 (eq. 1 with the scalar-times-identity A of
Mamba-2, discretised by zero-order hold on A and Euler on B):

    H_t = exp(dt_t A) H_{t-1} + dt_t x_t B_t^T        H_t: [P, N], x_t: [P], B_t, C_t: [N]
    y_t = H_t C_t + D x_t

`ssd_reference` runs that loop, one token at a time: the definition the fast path is tested
against. `ssd_chunked` is the paper's block decomposition of the same semiseparable matrix
(section 6, Listing 1 "ssd_minimal"): within a chunk of Q tokens the output is a masked
quadratic form (attention-like, with decays L = exp(segsum(dt A))); between chunks only the
[P, N] states travel, through a recurrence over the chunks. Work is O(T Q (N + P)) instead of
O(T^2) and every step is a batched matmul, so `torch.compile` fuses it well.

B and C are shared by the heads of a group (ngroups G, heads per group H / G, contiguous: head
h belongs to group h // (H / G)), as in the paper's multi-value / grouped-head form (section
7.2). Shapes, batch-first: x [b, T, H, P], dt [b, T, H] (already positive), A [H], B and C
[b, T, G, N], D [H]; the output is [b, T, H, P]. A sequence length that is not a multiple of the
chunk is padded at the end with dt = 0 (a decay of exp(0) = 1 and no input), which cannot change
an earlier token's output, and cut back.

Precision: `ssd_chunked` computes in fp32 whatever its inputs' dtype and the autocast state, and
returns fp32 (the caller casts back): with bf16 parameters x, B, C and D arrive in bf16 while dt
and A are fp32 (einsum refuses the mix), and the decays exp(segsum) and the state recurrence are
what mamba_ssm's kernels also keep in fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _grouped(t: torch.Tensor, groups: int) -> torch.Tensor:
    """[..., H, X] -> [..., G, H / G, X] (heads of one group contiguous)."""
    return t.unflatten(-2, (groups, t.shape[-2] // groups))


def ssd_reference(
    x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor, D: torch.Tensor
) -> torch.Tensor:
    """The recurrence, token by token (slow; the definition). Shapes: see the module docstring."""
    b, T, H, P = x.shape
    G, N = B.shape[-2], B.shape[-1]
    h = x.new_zeros(b, G, H // G, P, N)
    ys = []
    for t in range(T):
        decay = torch.exp(dt[:, t] * A).view(b, G, H // G, 1, 1)
        xt = _grouped(x[:, t], G)
        inp = (dt[:, t].view(b, G, H // G, 1) * xt).unsqueeze(-1) * B[:, t].view(b, G, 1, 1, N)
        h = decay * h + inp
        ys.append((h * C[:, t].view(b, G, 1, 1, N)).sum(-1).flatten(1, 2))
    return torch.stack(ys, dim=1) + D.view(1, 1, H, 1) * x


def prefix_sum(a: torch.Tensor) -> torch.Tensor:
    """[..., Q] -> [..., Q]: the inclusive prefix sum over the last dim, by doubling (Hillis &
    Steele 1986: log2 Q shifted adds), not `cumsum`. Why: under `torch.compile` on CUDA inductor
    lowers cumsum through its scan IR, whose SplitScan crashed on the scan's [b, g, r, c, Q]
    cumsum (issue 37); shifted adds are pointwise ops, which inductor fuses, forward and
    backward (the backward of cumsum is a scan too). Exact for integers, fp32 rounding otherwise."""
    q, shift = a.shape[-1], 1
    while shift < q:
        a = a + F.pad(a[..., :-shift], (shift, 0))
        shift *= 2
    return a


def segsum(a: torch.Tensor) -> torch.Tensor:
    """[..., Q] -> [..., Q, Q]: out[i, j] = a[j + 1] + ... + a[i] for j <= i (0 on the diagonal),
    -inf above it, so that exp() of it is the lower-triangular decay matrix L of the paper. Summed
    down a masked copy (each entry a sum of its own terms) rather than as a difference of prefix
    sums, which cancels: used between chunks, where the prefix sums grow with the sequence."""
    q = a.shape[-1]
    strict = torch.ones(q, q, dtype=torch.bool, device=a.device).tril(-1)
    x = a.unsqueeze(-1).expand(*a.shape, q).masked_fill(~strict, 0.0)
    x = prefix_sum(x.transpose(-1, -2)).transpose(-1, -2)
    return x.masked_fill(~strict.logical_or(torch.eye(q, dtype=torch.bool, device=a.device)), float("-inf"))


def within_chunk_segsum(cum: torch.Tensor) -> torch.Tensor:
    """`segsum` from the prefix sums [..., Q] of one chunk: cum[i] - cum[j] on and below the
    diagonal, -inf above; mamba_ssm's kernels compute the decays so (exp(dA_cumsum_i -
    dA_cumsum_j)). The exponent's absolute error is about 6e-8 |cum| in fp32, the decay's relative
    one: 2e-5 where a chunk's total decay reaches 400 (dt A of -1.6 over 256 tokens), whose far
    decays are exp(-400) = 0 anyway; the masked copy of `segsum` would cost log2 Q passes over
    the [Q, Q] decays of every chunk and head."""
    q = cum.shape[-1]
    lower = torch.ones(q, q, dtype=torch.bool, device=cum.device).tril()
    return (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(~lower, float("-inf"))


def ssd_chunked(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    chunk_size: int,
) -> torch.Tensor:
    """The chunked scan (SSD), equal to `ssd_reference` up to rounding. Shapes: see the module
    docstring. Indices below: b batch, c chunk, l / s position in a chunk, g group, r head
    within the group, p head dim, n state. fp32 (module docstring)."""
    with torch.autocast(device_type=x.device.type, enabled=False):
        x, dt, A, B, C, D = (t.float() for t in (x, dt, A, B, C, D))
        b, T, H, P = x.shape
        G = B.shape[-2]
        pad = -T % chunk_size
        if pad:
            x, B, C = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (x, B, C))
            dt = F.pad(dt, (0, 0, 0, pad))
        c = (T + pad) // chunk_size

        def chunks(t: torch.Tensor) -> torch.Tensor:
            return t.unflatten(1, (c, chunk_size))

        xs = chunks(_grouped(x * dt.unsqueeze(-1), G))  # b c l g r p: dt x_t, the discretised input
        Bc, Cc = chunks(B), chunks(C)  # b c l g n
        a = chunks(dt * A).unflatten(-1, (G, H // G)).permute(0, 3, 4, 1, 2)  # b g r c l
        a_cum = prefix_sum(a)

        # 1. within each chunk: y_l = sum_{s <= l} C_l . B_s exp(a_{s+1} + ... + a_l) dt_s x_s
        decay = torch.exp(within_chunk_segsum(a_cum))  # b g r c l s
        scores = torch.einsum("bclgn,bcsgn->bgcls", Cc, Bc)
        y = torch.einsum("bgcls,bgrcls,bcsgrp->bclgrp", scores, decay, xs)

        # 2. each chunk's final state from its own inputs
        to_end = torch.exp(a_cum[..., -1:] - a_cum)  # b g r c l
        states = torch.einsum("bclgn,bgrcl,bclgrp->bcgrpn", Bc, to_end, xs)

        # 3. the states entering each chunk: a recurrence over chunks, as one (c+1) x (c+1) product
        states = torch.cat([torch.zeros_like(states[:, :1]), states], dim=1)
        chunk_decay = torch.exp(segsum(F.pad(a_cum[..., -1], (1, 0))))  # b g r z c
        states = torch.einsum("bgrzc,bcgrpn->bzgrpn", chunk_decay, states)[:, :-1]

        # 4. the entering state's contribution to each position
        y = y + torch.einsum("bclgn,bcgrpn,bgrcl->bclgrp", Cc, states, torch.exp(a_cum))
        y = y.reshape(b, c * chunk_size, H, P)[:, :T]
        return y + D.view(1, 1, H, 1) * x[:, :T]
