"""DoReMi (Xie et al. 2023): domain weights by Group DRO on the excess loss over a reference.

The pure update functions are importable on their own:

    >>> import torch, doremi
    >>> log_a = doremi.uniform_log_weights(3)
    >>> lam = torch.tensor([0.5, 0.0, 0.1])
    >>> log_a, alpha = doremi.update_weights(log_a, lam, eta=1.0, smoothing=1e-3)
"""

from doremi.history import (
    HistoryError,
    WeightHistory,
    average_weights,
    read_history,
    read_weights_json,
    write_weights_json,
)
from doremi.update import (
    domain_excess,
    domain_excess_sums,
    per_domain_mean_loss,
    to_log_weights,
    uniform_log_weights,
    update_weights,
)

__all__ = [
    "HistoryError",
    "WeightHistory",
    "average_weights",
    "domain_excess",
    "domain_excess_sums",
    "per_domain_mean_loss",
    "read_history",
    "read_weights_json",
    "to_log_weights",
    "uniform_log_weights",
    "update_weights",
    "write_weights_json",
]
