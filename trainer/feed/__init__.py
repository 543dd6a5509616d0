"""The data a step trains on: this rank's micro-batches, their per-domain sums and the loss weighting."""
