"""The optimizers of one rank: AdamW or Adafactor, plain data parallel or ZeRO-1, state by name.

Two implementations behind one interface (`Optimizer`), chosen by `trainer.optim.build.build_optimizer` from the
resolved parameter dtype (`trainer.plan.resolve.param_dtype`, train.param_dtype in the config):
- fp32 parameters: `ShardedOptimizer` (`trainer.optim.sharded`), a torch AdamW or Adafactor;
- bf16 parameters: `trainer.optim.master_weights.MasterWeightAdamW`, fp32 main grads, fp32 master
  weights and moments, one fused update (AdamW only).
Both shard their state over dp with ZeRO-1 by the same owner partition
(`trainer.parallel.data_parallel.partition_params`), which is also what clipping counts by.

Per step: `reduce_gradients()` (dp sum, once, after every micro-batch's backward and the tp/tied
syncs; `step` calls it if the caller did not), `clip_grad_norm(max_norm)` (the global norm as a
device tensor, `trainer.optim.clip`), `step(lr)` (the update, then under ZeRO-1 the owners
broadcast the updated parameters), `zero_grad()`.

`ShardedOptimizer` wraps a torch optimizer over the parameters whose update this rank computes:
all of them without ZeRO-1, the ones it owns with ZeRO-1 (`trainer.parallel.data_parallel`).

Weight decay applies to matrices only, not to norms or biases (1-D parameters). AdamW is fused
when the parameters are on CUDA, foreach otherwise. Adafactor is `torch.optim.Adafactor`
(Shazeer & Stern 2018 as implemented in torch >= 2.5: relative step min(lr, 1/sqrt(t)) scaled by
max(eps2, RMS(param)), factored second moment for >= 2-D parameters, no first moment); under
tp > 1 its factored statistics and parameter RMS are those of the tp-local shard.

`state_dict()` is keyed by parameter name, holding only this rank's state (the owned parameters
under ZeRO-1), so a checkpoint can regroup it under any other layout. The AdamW keys ("step",
"exp_avg", "exp_avg_sq") are torch's in both implementations; the bf16 one adds "master", so
either loads the other's state (`trainer.checkpoint.checkpoint` moves the master into fp32 parameters,
and fp32 parameters into the master).
"""
