"""The `model.mup` config (`MupConfig`); the spectral muP rules it switches on are
`trainer.model.mup`'s. A config module, so that `trainer.config.schema` holds it without
importing the model."""

from __future__ import annotations

from dataclasses import dataclass

from trainer.config.tools import ConfigError


@dataclass
class MupConfig:
    """Spectral muP: init, per-layer learning rates and multipliers relative to a base width."""

    # The d_model at which init_std and train.lr were tuned (the model there equals the model
    # without muP).
    base_width: int = 256
    # Zero init of the readout (LM head) and of the attention queries (the q rows of attn.qkv):
    # at finite width the random readout and queries add output fluctuations at init that shrink
    # with the width and that muP's infinite-width limit does not have, which shifts the best lr
    # of narrow models (Tensor Programs V, Yang et al. 2022, Appendix D.2; the `mup` package's
    # GPT-2 and Transformer examples: readout_zero_init, query_zero_init). Off: the model as before.
    zero_init: bool = False

    def validate(self, path: str = "model.mup", tie_embeddings: bool = False) -> None:
        if self.base_width < 1:
            raise ConfigError(f"{path}.base_width: expected a positive int, got {self.base_width}")
        if self.zero_init and tie_embeddings:
            parent = path.rsplit(".", 1)[0]
            raise ConfigError(
                f"{path}.zero_init: a tied head is the embedding, which cannot start at zero; "
                f"set {parent}.tie_embeddings=false or {path}.zero_init=false"
            )
