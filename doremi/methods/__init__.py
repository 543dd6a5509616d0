"""The data-mixing methods on the trainer's method interface (trainer/run/hooks.py): a catalog,
one folder per method exporting its `MethodSpec` (spec.py), listed one line each in registry.py,
from which everything that names methods is derived (docs/design.md section 2a). Beside them what
they share: the weight log and its average (log.py, history.py) and a reference model's losses
for a method that needs one (reference.py, reference_cache.py)."""
