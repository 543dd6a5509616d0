"""What a run writes beside its checkpoints: the run directory's identity, metrics, reports and pairing."""
