"""The data-mixing methods, one file each, on the trainer's method interface (trainer/run/hooks.py).
`registry.py` builds them by name; docs/design.md section 2 says what each reads. Beside them what
they share: the weight log and its average (log.py, history.py), DoReMi's update math
(doremi_update.py) and its reference losses (reference.py, reference_cache.py)."""
