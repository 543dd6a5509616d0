"""The token stores and what reads them: the format and manifest, packed sequences, batches,
validation."""
