"""The domain weights and the batches drawn from them: the weights' forms and file, the
exact-count sampler and the sequences held back from every run."""
