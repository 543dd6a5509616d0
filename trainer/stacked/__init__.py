"""Many small Llama models trained at once in one process, for offline mixture search.

Offline mixing methods fit a regression from mixture to loss over hundreds of tiny proxy runs
(RegMix, Liu et al. ICLR 2025: 512 models of 1M parameters; Data Mixing Laws, Ye et al. ICLR
2025). One by one, such a run leaves a GPU mostly idle: its matmuls are too small to fill it
and the step is bound by kernel launches. Here M models share one step instead: every weight
carries a leading model dimension M, each op is one batched kernel over all models
(`torch.bmm` over [M, tokens, d], SDPA with M merged into the batch), and one optimizer step
updates every model.

Each model m is the ordinary trainer's run on `data.domain_weights = mixtures[m]`, to fp32
rounding: the same initialisation (`Llama` with the run's seed), the same batches (a sampler
per mixture seeded as `trainer.feed.data_feed.DataFeed`), the same objective (the mean token loss), the
same clipping (each model's own global norm) and the same torch AdamW on the stacked tensors.

Modules: `layers` (the batched ops), `model` (`StackedLlama`, stacking and unstacking), `head`
(the training head's loss and gradients in the forward, all models at once, no logits kept),
`optim` (AdamW and the per-model clip), `feed` (per-mixture samplers, stacked batches),
`evaluate` (per-domain validation loss [M, k]), `run` (one chunk of models trained together),
`train` (`train_stacked`, chunking, `StackedResult`).
"""

from trainer.stacked.train import StackedResult, train_stacked

__all__ = ["StackedResult", "train_stacked"]
