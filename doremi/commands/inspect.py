"""`doremi inspect STORES_RUN_OR_CONFIG`: what the token stores hold, and a few of their
sequences decoded, so that a wrong text field, a broken tokenizer or a mislabelled domain shows
before any training."""

from __future__ import annotations

from pathlib import Path

from data.progress import si
from data.store.store import MANIFEST_FILE, Manifest, open_stores
from data.tokenizer.tokenizer import load_tokenizer
from doremi.errors import DoReMiError


def store_dir_of(target: str, overrides: list[str]) -> Path:
    """A directory with a manifest.json is the stores; a run directory (its saved
    `config.yaml`) reads the stores it trained on; anything else is read as a config."""
    from doremi.config import ExperimentConfig, load_saved_config
    from trainer.config.schema import load_config

    p = Path(target)
    if not p.exists():
        raise DoReMiError(f"{target}: not found (expected stores, a run directory or a config file)")
    if p.is_dir():
        saved = p / "config.yaml"
        if (p / MANIFEST_FILE).is_file() or not saved.is_file():
            return p
        return Path(load_saved_config(saved, overrides).data.store_dir)
    return Path(load_config(p, overrides, cls=ExperimentConfig).data.store_dir)


#: Widest domain name shown whole in `counts_table`: the table then fits 100 columns.
NAME_WIDTH = 26


def _bytes(count: int | None) -> str:
    return "-" if count is None else si(count, "B")


def counts_table(m: Manifest) -> list[str]:
    """Per domain and split: documents, tokens and UTF-8 bytes (`-` for a synthetic domain), in
    at most 100 columns (a longer domain name is cut, its end marked `~`): what `doremi
    preprocess` built, read at a glance (issue 43 item 4)."""
    width = min(max(len(d) for d in m.domain_names + ["domain"]), NAME_WIDTH)
    out = [
        f"{'domain':<{width}}  {'train docs':>10}  {'train tokens':>13}  {'train bytes':>11}  "
        f"{'val docs':>8}  {'val tokens':>11}  {'val bytes':>9}"
    ]
    for d in m.domains:
        name = d.name if len(d.name) <= width else d.name[: width - 1] + "~"
        t, v = d.train, d.validation
        out.append(
            f"{name:<{width}}  {t.documents:>10}  {t.tokens:>13}  {_bytes(t.bytes):>11}  "
            f"{v.documents:>8}  {v.tokens:>11}  {_bytes(v.bytes):>9}"
        )
    return out


def inspect_stores(store_dir: Path, domain: str | None = None, n: int = 2, chars: int = 400) -> str:
    """The manifest's summary, then the first `n` training documents of each domain (or of
    `domain`), decoded and cut at `chars` characters."""
    if not (store_dir / MANIFEST_FILE).is_file():
        raise DoReMiError(f"{store_dir / MANIFEST_FILE}: no token stores here; build them with `doremi preprocess`")
    if n < 0:
        raise DoReMiError(f"-n: expected >= 0, got {n}")
    stores = open_stores(store_dir)
    m = stores.manifest
    tok = m.tokenizer
    names = m.domain_names if domain is None else [m.domain(domain).name]
    out = [
        f"stores: {store_dir}",
        f"tokenizer: {tok.get('name')} (vocab_size {tok.get('vocab_size')}, eos_id {tok.get('eos_id')}), "
        f"token dtype {m.dtype}",
    ]
    out += counts_table(m)
    if n:
        tokenizer = load_tokenizer(store_dir)
        for name in names:
            count = min(n, m.domain(name).train.documents)
            out += ["", f"== {name}: {count} of {m.domain(name).train.documents} training documents"]
            for i in range(count):
                ids = stores.document(name, "train", i)
                text = tokenizer.decode(int(t) for t in ids)
                cut = text if len(text) <= chars else text[:chars] + " [...]"
                out.append(f"-- [{i}] {len(ids)} tokens")
                out.append(cut)
    return "\n".join(out) + "\n"
