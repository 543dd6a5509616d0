"""One training run: the loop, its step, the hooks a mixing method plugs into, evaluation and stopping."""
