"""The data-mixing methods, one file each, on the trainer's method interface (trainer/hooks.py).
`registry.py` builds them by name; docs/design.md section 2 says what each reads."""
