"""The DoReMi domain-weight update (Xie et al. 2023, Algorithm 1), as pure tensor functions.

With k domains, step size eta, smoothing c and u = 1/k, one step is

    excess per token   e = max(loss_proxy - loss_ref, 0)            (before any averaging)
    lambda_t[i]        = sum of e over domain i's tokens / number of domain i's tokens
                         (over the global batch; an absent domain keeps lambda_{t-1}[i])
    alpha'_t           = alpha_{t-1} * exp(eta * lambda_t)
    alpha_t            = (1 - c) * alpha'_t / sum(alpha'_t) + c * u

and the tuned weights are the mean of alpha_t over t = 1..T (see `doremi.methods.history`).

The carried state is log(alpha_t), *after* smoothing, so that weights carry over from step to
step exactly as in the paper. Everything is computed in log space with logsumexp / logaddexp:
losses in the thousands never overflow and the smoothing floor c/k is never lost to rounding.

Nothing here talks to a process group: `domain_excess_sums` and `per_domain_mean_loss` return
*sums and counts* of the local micro-batch, which the caller all-reduces over data-parallel
ranks and adds over micro-batches before calling `domain_excess`. Functions run on the device
of their inputs and compute in at least fp32 (fp64 inputs stay fp64).
"""

from __future__ import annotations

import math

import torch

from trainer.feed.domains import domain_sums


def _float_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.promote_types(t.dtype, torch.float32) if t.is_floating_point() else torch.float32


def _check_batch(name: str, values: torch.Tensor, domain_ids: torch.Tensor, mask: torch.Tensor, k: int) -> None:
    if k < 1:
        raise ValueError(f"k: expected a number of domains >= 1, got {k}")
    if values.dim() != 2:
        raise ValueError(f"{name}: expected shape [b, s], got {tuple(values.shape)}")
    if mask.shape != values.shape:
        raise ValueError(f"mask: expected shape {tuple(values.shape)} like {name}, got {tuple(mask.shape)}")
    if mask.dtype != torch.bool:
        raise ValueError(f"mask: expected dtype torch.bool, got {mask.dtype}")
    if domain_ids.shape != values.shape[:1]:
        raise ValueError(
            f"domain_ids: expected shape ({values.shape[0]},) (one domain per sequence), got {tuple(domain_ids.shape)}"
        )
    if domain_ids.is_floating_point() or domain_ids.is_complex() or domain_ids.dtype == torch.bool:
        raise ValueError(f"domain_ids: expected an integer dtype, got {domain_ids.dtype}")


def domain_excess_sums(
    proxy_loss: torch.Tensor, ref_loss: torch.Tensor, domain_ids: torch.Tensor, mask: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Local per-domain sums of the per-token excess loss max(loss_proxy - loss_ref, 0).

    Args:
        proxy_loss, ref_loss: per-token losses [b, s] (``reduction="none"``).
        domain_ids: [b], the domain of each packed sequence, in [0, k).
        mask: [b, s] bool, True on tokens that count (labels != ignore index).
        k: number of domains.

    Returns:
        (excess_sum [k] float, token_count [k] int64). The clip is per token, before any
        averaging (Algorithm 1). All-reduce both (SUM) over dp and add over micro-batches,
        then pass them to `domain_excess`. Counts are int64 so they stay exact at any batch
        size.
    """
    _check_batch("proxy_loss", proxy_loss, domain_ids, mask, k)
    if ref_loss.shape != proxy_loss.shape:
        raise ValueError(
            f"ref_loss: expected shape {tuple(proxy_loss.shape)} like proxy_loss, got {tuple(ref_loss.shape)}"
        )
    return domain_sums(token_excess(proxy_loss, ref_loss), domain_ids, mask, k)


def token_excess(proxy_loss: torch.Tensor, ref_loss: torch.Tensor) -> torch.Tensor:
    """Per-token excess loss max(loss_proxy - loss_ref, 0), in the wider of the two dtypes
    (at least fp32)."""
    dtype = torch.promote_types(_float_dtype(proxy_loss), _float_dtype(ref_loss))
    return (proxy_loss.to(dtype) - ref_loss.to(dtype)).clamp_min(0)


def per_domain_mean_loss(
    loss: torch.Tensor, domain_ids: torch.Tensor, mask: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-domain (loss sum [k], token count [k] int64) over non-masked tokens, for logging.

    The mean is sum / count after the caller has reduced both over the global batch.
    """
    _check_batch("loss", loss, domain_ids, mask, k)
    return domain_sums(loss, domain_ids, mask, k)


def domain_excess(
    excess_sum: torch.Tensor, token_count: torch.Tensor, previous: torch.Tensor | None = None
) -> torch.Tensor:
    """lambda_t [k]: per-domain mean excess over the global batch.

    lambda_t[i] = excess_sum[i] / token_count[i]; a domain with no token in the global batch
    keeps previous[i] (0 when `previous` is None, i.e. before any step has seen it).
    """
    if excess_sum.dim() != 1 or token_count.shape != excess_sum.shape:
        raise ValueError(
            f"token_count: expected shape {tuple(excess_sum.shape)} like "
            f"excess_sum [k], got {tuple(token_count.shape)} and "
            f"{tuple(excess_sum.shape)}"
        )
    dtype = _float_dtype(excess_sum)
    if previous is None:
        previous = torch.zeros_like(excess_sum, dtype=dtype)
    elif previous.shape != excess_sum.shape:
        raise ValueError(f"previous: expected shape {tuple(excess_sum.shape)}, got {tuple(previous.shape)}")
    counts = token_count.to(device=excess_sum.device)
    present = counts > 0
    mean = excess_sum.to(dtype) / counts.clamp_min(1).to(dtype)
    return torch.where(present, mean, previous.to(device=excess_sum.device, dtype=dtype))


def _check_hyper(eta: float, smoothing: float) -> None:
    if not (math.isfinite(eta) and eta >= 0):
        raise ValueError(f"eta: expected a finite step size >= 0, got {eta!r}")
    if not (0.0 <= smoothing <= 1.0):
        raise ValueError(f"smoothing: expected a value in [0, 1], got {smoothing!r}")


def update_weights(
    log_alpha_prev: torch.Tensor, excess: torch.Tensor, eta: float = 1.0, smoothing: float = 1e-3
) -> tuple[torch.Tensor, torch.Tensor]:
    """One DoReMi step on the *log* weights: (log alpha_t, alpha_t) from log alpha_{t-1}.

        alpha_t = (1 - c) * softmax(log alpha_{t-1} + eta * lambda_t) + c / k

    computed as log alpha_t = logaddexp(log(1 - c) + log_softmax(...), log(c / k)), which is
    exact for losses of any size (the max is subtracted inside log_softmax) and keeps the floor
    alpha_t >= c / k. Start from `uniform_log_weights(k)`; to start from weights rather than
    log weights, pass `to_log_weights(alpha)`.

    Args:
        log_alpha_prev: [k] log alpha_{t-1} (the smoothed weights of the previous step).
        excess: [k] lambda_t from `domain_excess`.
        eta: step size (Algorithm 1's eta; 1.0 in the paper).
        smoothing: c in [0, 1] (1e-3 in the paper).
    """
    _check_hyper(eta, smoothing)
    if log_alpha_prev.dim() != 1 or excess.shape != log_alpha_prev.shape:
        raise ValueError(
            f"excess: expected shape {tuple(log_alpha_prev.shape)} like "
            f"log_alpha_prev [k], got {tuple(excess.shape)} and "
            f"{tuple(log_alpha_prev.shape)}"
        )
    dtype = torch.promote_types(_float_dtype(log_alpha_prev), _float_dtype(excess))
    k = log_alpha_prev.numel()
    logits = log_alpha_prev.to(dtype) + eta * excess.to(device=log_alpha_prev.device, dtype=dtype)
    log_p = torch.log_softmax(logits, dim=0)
    if smoothing == 0.0:
        log_alpha = log_p
    else:
        keep = math.log1p(-smoothing) if smoothing < 1.0 else -math.inf
        floor = torch.full_like(log_p, math.log(smoothing / k))
        log_alpha = torch.logaddexp(log_p + keep, floor)
    return log_alpha, log_alpha.exp()


def uniform_log_weights(
    k: int, device: torch.device | str | None = None, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """log alpha_0 = log(1/k) for each of k domains (Algorithm 1's initialisation)."""
    if k < 1:
        raise ValueError(f"k: expected a number of domains >= 1, got {k}")
    return torch.full((k,), -math.log(k), device=device, dtype=dtype)


def to_log_weights(alpha: torch.Tensor) -> torch.Tensor:
    """log alpha for weights given as a distribution [k] (checked: finite, >= 0, sum 1).

    A zero weight becomes -inf: with smoothing c > 0 the next update lifts it to >= c/k.
    The check reads values on the host; call this once at start-up, not per step.
    """
    if alpha.dim() != 1 or alpha.numel() == 0:
        raise ValueError(f"alpha: expected weights of shape [k], got {tuple(alpha.shape)}")
    a = alpha.to(_float_dtype(alpha))
    total = float(a.sum())
    if not bool(torch.isfinite(a).all()) or bool((a < 0).any()) or abs(total - 1.0) > 1e-5:
        raise ValueError(f"alpha: expected finite non-negative weights summing to 1, got {a.tolist()} (sum {total})")
    return a.log()
