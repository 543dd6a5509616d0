"""Tokenizers (byte-level, a trained BPE, a `tokenizer.json`), their beginning-of-sequence
token, and a run's tokenizer as Hugging Face files."""
