"""DoReMi (Xie et al. 2023): domain weights by Group DRO on the excess loss over a reference.

The pure update functions are importable on their own:

    >>> import torch, doremi
    >>> log_a = doremi.uniform_log_weights(3)
    >>> lam = torch.tensor([0.5, 0.0, 0.1])
    >>> log_a, alpha = doremi.update_weights(log_a, lam, eta=1.0, smoothing=1e-3)
"""

import sys as _sys
from pathlib import Path as _Path


def _own_packages_first() -> None:
    """The framework's `trainer` and `data` packages are this package's siblings (in a checkout
    or in site-packages). `python -m doremi` puts the working directory first on sys.path, where a
    user's `trainer.py` or `data/` would shadow them (both names are common): put the siblings'
    directory first, and refuse a foreign `trainer` or `data` imported before this package."""
    root = _Path(__file__).resolve().parent.parent
    if _sys.path[:1] != [str(root)]:
        _sys.path.insert(0, str(root))
    for name in ("trainer", "data"):
        mod = _sys.modules.get(name)
        where = getattr(mod, "__file__", None)
        if mod is not None and (where is None or _Path(where).resolve().parent.parent != root):
            raise ImportError(
                f"doremi: a module named {name!r} from {where} was imported before doremi; the framework's "
                f"{name} package is {root / name} (rename the other one, or import doremi first)"
            )


_own_packages_first()

from doremi.methods.doremi.update import (  # noqa: E402
    domain_excess,
    domain_excess_sums,
    per_domain_mean_loss,
    to_log_weights,
    uniform_log_weights,
    update_weights,
)
from doremi.methods.history import (  # noqa: E402
    HistoryError,
    WeightHistory,
    average_weights,
    read_history,
    read_weights_json,
    write_weights_json,
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
