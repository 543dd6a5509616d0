import json

import numpy as np
import pytest

from data.config import TokenizerConfig
from data.errors import DataError
from data.tokenizer.tokenizer import (
    ByteTokenizer,
    build_tokenizer,
    expected_identity,
    flat_with_eos,
    save_tokenizer,
    tokenizer_from_spec,
)

TEXTS = [
    "def f(x):\n    return x + 1\n",
    "Héllo, wörld — ünïcode ✓ 日本語",
    "tab\tand\r\nnewlines\n\n",
    "The quick brown fox jumps over the lazy dog. " * 20,
]


@pytest.fixture(scope="module")
def bpe():
    return build_tokenizer(TokenizerConfig(kind="bpe", vocab_size=300), TEXTS * 5)


def test_byte_tokenizer_round_trip_and_identity():
    tok = ByteTokenizer()
    for t in TEXTS:
        ids = tok.encode(t)
        assert ids == list(t.encode("utf-8"))
        assert tok.decode(ids) == t
    assert (tok.vocab_size, tok.eos_id) == (257, 256)
    assert tok.decode([104, 105, 256, 33]) == "hi<|endoftext|>!"
    assert tok.identity["name"] == "byte" and tok.identity["vocab_size"] == 257
    assert [a.tolist() for a in tok.encode_arrays(TEXTS)] == tok.encode_batch(TEXTS)


def test_bpe_round_trip_vocab_and_determinism(bpe):
    assert bpe.vocab_size == 300 and bpe.eos_id == 0 and bpe.identity["name"] == "bpe-300"
    for t in TEXTS:
        assert bpe.decode(bpe.encode(t)) == t
    assert len(bpe.encode(TEXTS[3])) < len(TEXTS[3].encode()) / 2
    again = build_tokenizer(TokenizerConfig(kind="bpe", vocab_size=300), TEXTS * 5)
    assert again.identity == bpe.identity
    assert tokenizer_from_spec(bpe.spec()).identity == bpe.identity
    assert [a.tolist() for a in bpe.encode_arrays(TEXTS)] == bpe.encode_batch(TEXTS)


def test_bpe_needs_training_texts():
    with pytest.raises(DataError, match="needs texts"):
        build_tokenizer(TokenizerConfig(kind="bpe", vocab_size=300))


def test_file_and_hf_local_tokenizers_load_saved_json(bpe, tmp_path):
    save_tokenizer(bpe, tmp_path / "tokenizer.json")
    by_file = build_tokenizer(TokenizerConfig(kind="file", path=str(tmp_path / "tokenizer.json")))
    by_dir = build_tokenizer(TokenizerConfig(kind="hf", path=str(tmp_path)))
    for tok in (by_file, by_dir):
        assert tok.identity["hash"] == bpe.identity["hash"]
        assert tok.eos_id == 0 and tok.encode(TEXTS[1]) == bpe.encode(TEXTS[1])
    assert by_file.identity["name"] == "file:tokenizer.json"
    assert expected_identity(TokenizerConfig(kind="file", path=str(tmp_path / "tokenizer.json"))) == by_file.identity
    assert expected_identity(TokenizerConfig(kind="bpe", vocab_size=300)) == {"name": "bpe-300"}


def test_file_tokenizer_errors(bpe, tmp_path):
    with pytest.raises(DataError, match="not found"):
        build_tokenizer(TokenizerConfig(kind="file", path=str(tmp_path / "nope.json")))
    with pytest.raises(DataError, match="has no tokenizer.json"):
        build_tokenizer(TokenizerConfig(kind="hf", path=str(tmp_path)))
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(DataError, match="not a valid tokenizer.json"):
        build_tokenizer(TokenizerConfig(kind="file", path=str(tmp_path / "bad.json")))
    save_tokenizer(bpe, tmp_path / "t.json")
    with pytest.raises(DataError, match="no end-of-document token <missing>"):
        build_tokenizer(TokenizerConfig(kind="file", path=str(tmp_path / "t.json"), eos_token="<missing>"))


def test_word_level_tokenizer_without_eos_is_rejected(tmp_path):
    from tokenizers import Tokenizer, models

    tok = Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    tok.save(str(tmp_path / "w.json"))
    with pytest.raises(DataError, match=r"no end-of-document token .*set data.tokenizer.eos_token"):
        build_tokenizer(TokenizerConfig(kind="file", path=str(tmp_path / "w.json")))
    ok = build_tokenizer(TokenizerConfig(kind="file", path=str(tmp_path / "w.json"), eos_token="b"))
    assert ok.eos_id == 1 and json.loads(ok.to_json())["model"]["type"] == "WordLevel"


@pytest.mark.parametrize("dtype", ["uint16", "int32"])
def test_encode_flat_is_the_documents_ids_with_eos_after_each(bpe, tmp_path, dtype):
    """`encode_flat` (what the stores append, data.preprocess.encode) is `flat_with_eos` of the per-document
    arrays, in the store's dtype, for the byte tokenizer, a BPE and a BOS-adding tokenizer; the
    BPE's ids are those of the library's `encode_batch` (ours calls `encode_batch_fast`)."""
    from tests.test_data_bos import llama3_like_tokenizer

    llama3_like_tokenizer(tmp_path / "tokenizer.json")
    with_bos = build_tokenizer(TokenizerConfig(kind="file", path=str(tmp_path / "tokenizer.json")))
    assert with_bos.bos_id == 0
    for tok in (ByteTokenizer(), bpe, with_bos):
        flat, lengths = tok.encode_flat(TEXTS, np.dtype(dtype))
        want_flat, want_lengths = flat_with_eos(tok.encode_arrays(TEXTS), tok.eos_id, np.dtype(dtype))
        assert flat.dtype == np.dtype(dtype) and lengths.dtype == np.int64
        assert flat.tolist() == want_flat.tolist() and lengths.tolist() == want_lengths.tolist()
        assert lengths.tolist() == [len(tok.encode(t)) + 1 for t in TEXTS]
        assert flat[np.cumsum(lengths) - 1].tolist() == [tok.eos_id] * len(TEXTS)
    library = [e.ids for e in bpe._tok.encode_batch(TEXTS, add_special_tokens=False)]
    assert bpe.encode_batch(TEXTS) == library
    assert with_bos.encode_batch(TEXTS[:1])[0][0] == 0
    assert ByteTokenizer().encode_flat([], np.dtype(dtype))[0].tolist() == []
