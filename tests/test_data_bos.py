"""BOS decided per tokenizer (issue 42 point 4, data/tokenizer/bos.py): a `tokenizer.json` whose
post-processor prepends a special token (as Llama 3's) puts it before every document in the
stores, unless `data.tokenizer.add_bos: false`; the exported tokenizer gives, in transformers,
the ids the stores hold."""

import json

import numpy as np
import pytest

from data.config import DataConfig, DomainSource, TokenizerConfig
from data.preprocess.preprocess import preprocess, tokenizer_fingerprint
from data.store.store import open_stores
from data.tokenizer.bos import bos_token, without_bos
from data.tokenizer.export import tokenizer_files
from data.tokenizer.tokenizer import load_tokenizer

BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
TEXTS = [f"Document {i}: the weights of domain {i % 5} are {i * 0.125} ünï ✓" for i in range(40)]


def llama3_like_tokenizer(path):
    """A byte-level BPE with Llama 3's post-processor: Sequence[ByteLevel, TemplateProcessing
    with `<|begin_of_text|> $A`]."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(TEXTS, trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
            ),
        ]
    )
    tok.save(str(path))
    return bos_id


def test_bos_token_is_found_and_removed(tmp_path):
    bos_id = llama3_like_tokenizer(tmp_path / "tokenizer.json")
    text = (tmp_path / "tokenizer.json").read_text()
    assert bos_token(text) == (BOS, bos_id) == (BOS, 0)
    stripped = without_bos(text)
    assert bos_token(stripped) is None
    assert [p["type"] for p in json.loads(stripped)["post_processor"]["processors"]] == ["ByteLevel"]


@pytest.mark.parametrize("add_bos", [True, False])
def test_stores_hold_the_ids_of_the_exported_tokenizer_in_transformers(tmp_path, add_bos):
    transformers = pytest.importorskip("transformers")
    bos_id = llama3_like_tokenizer(tmp_path / "tokenizer.json")
    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    cfg = DataConfig(
        domains=[DomainSource(name="a", paths=[str(tmp_path / "a.jsonl")])],
        store_dir=str(tmp_path / "stores"),
        tokenizer=TokenizerConfig(kind="file", path=str(tmp_path / "tokenizer.json"), add_bos=add_bos),
        num_proc=1,
        validation_fraction=0.1,
    )
    manifest = preprocess(cfg, progress=False)
    stores = open_stores(cfg.store_dir)
    docs = [
        stores.document("a", split, i).tolist()
        for split in ("train", "validation")
        for i in range(len(stores.documents("a", split)) - 1)
    ]
    assert len(docs) == len(TEXTS)
    assert all((d[0] == bos_id) == add_bos for d in docs)
    assert manifest.tokenizer.get("bos_id") == (bos_id if add_bos else None)

    out = tmp_path / "export"
    out.mkdir()
    for name, text in tokenizer_files(load_tokenizer(cfg.store_dir), 128).items():
        (out / name).write_text(text)
    hf = transformers.AutoTokenizer.from_pretrained(str(out))
    assert sorted(docs) == sorted(hf(t)["input_ids"] for t in TEXTS)
    assert json.loads((out / "tokenizer_config.json").read_text())["add_bos_token"] is add_bos
    eos = np.asarray(stores.tokens("a", "train"))[np.asarray(stores.documents("a", "train"))[1:] - 1]
    assert set(eos.tolist()) == {hf.convert_tokens_to_ids(EOS)}


def test_add_bos_is_part_of_the_fingerprint_only_where_a_bos_is_defined(tmp_path):
    llama3_like_tokenizer(tmp_path / "tokenizer.json")
    on, off = (
        tokenizer_fingerprint(TokenizerConfig(kind="file", path=str(tmp_path / "tokenizer.json"), add_bos=b))
        for b in (True, False)
    )
    assert on != off and on[-1] == {"add_bos": True}
    from tokenizers import Tokenizer, models

    Tokenizer(models.WordLevel({"a": 0, EOS: 1}, unk_token="a")).save(str(tmp_path / "plain.json"))
    plain = [
        tokenizer_fingerprint(TokenizerConfig(kind="file", path=str(tmp_path / "plain.json"), add_bos=b))
        for b in (True, False)
    ]
    assert plain[0] == plain[1] and len(plain[0]) == 3  # unchanged for tokenizers without a BOS
