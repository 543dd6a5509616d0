"""A run's tokenizer as Hugging Face tokenizer files (`tokenizer.json` for a `tokenizers`
Tokenizer, `tokenizer_config.json` for transformers' `PreTrainedTokenizerFast`).

Every tokenizer kind maps:
- a `tokenizers` tokenizer (a BPE trained on the data, a tokenizer file, a hub tokenizer): its
  own `tokenizer.json`, as it is;
- the byte tokenizer: a `tokenizers` BPE with no merges whose vocabulary is the 256 byte tokens
  `<0x00>`..`<0xFF>` (ids 0..255, byte fallback: every character becomes its UTF-8 bytes, as in
  Llama 2's tokenizer) and `<|endoftext|>` = 256, the same ids as `data.tokenizer.tokenizer.ByteTokenizer`
  for any text (except the literal text `<|endoftext|>`, which the HF one reads as the EOS).

Neither adds a BOS token, except a tokenizer whose post-processor puts one first (data.tokenizer.bos):
the stores hold it before every document (unless `data.tokenizer.add_bos: false` removed the
template from the tokenizer), so the exported file adds it as training saw it.
"""

from __future__ import annotations

import json
from typing import Any

from data.tokenizer.tokenizer import EOS_TEXT, ByteTokenizer, HFTokenizer

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def byte_tokenizer_json() -> str:
    """`tokenizer.json` of the byte tokenizer (see the module docstring)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models

    vocab = {f"<0x{b:02X}>": b for b in range(256)} | {EOS_TEXT: ByteTokenizer.eos_id}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True))
    tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    tok.add_special_tokens([AddedToken(EOS_TEXT, special=True, normalized=False)])
    return tok.to_str()


def tokenizer_files(tok: ByteTokenizer | HFTokenizer, max_length: int) -> dict[str, str]:
    """File name -> text of the HF tokenizer files of `tok`."""
    from tokenizers import Tokenizer

    text = byte_tokenizer_json() if isinstance(tok, ByteTokenizer) else tok.to_json()
    raw = Tokenizer.from_str(text)
    eos = raw.id_to_token(tok.eos_id)
    bos_id = getattr(tok, "bos_id", None)
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": eos,
        "bos_token": None if bos_id is None else raw.id_to_token(bos_id),
        "pad_token": None,
        "unk_token": None,
        "add_bos_token": bos_id is not None,
        "add_eos_token": False,
        "model_max_length": max_length,
        "clean_up_tokenization_spaces": False,
    }
    return {"tokenizer.json": text, "tokenizer_config.json": json.dumps(config, indent=2) + "\n"}
