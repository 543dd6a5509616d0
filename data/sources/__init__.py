"""Where each domain's documents come from: local files, one dataset split by a column, the
hub, the embedded corpus or a synthetic generator."""
