"""Checkpoints: saving, loading and resharding a run's state, and the model keys they are checked against."""
