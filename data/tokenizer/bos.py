"""A `tokenizer.json`'s beginning-of-sequence token: found in, or removed from, its post-processor.

Issue 42 point 4: a tokenizer whose post-processor prepends a special token (Llama 3's
`<|begin_of_text|>`: a `TemplateProcessing` whose single-sequence template starts with a special
token, alone or inside a `Sequence`) is pretrained with that token before every document, and
transformers adds it whenever it encodes with the exported file. So the stores hold it per
document, unless `data.tokenizer.add_bos: false`, in which case the template is removed from
the tokenizer itself, so that the stores, the saved `tokenizer.json` and the export agree.
Other post-processors (ByteLevel offsets, Bert/Roberta pairs) are left as they are.
"""

from __future__ import annotations

import json
from typing import Any


def _templates(post: Any) -> list[dict[str, Any]]:
    if not isinstance(post, dict):
        return []
    if post.get("type") == "TemplateProcessing":
        return [post]
    if post.get("type") == "Sequence":
        return [p for sub in post.get("processors") or [] for p in _templates(sub)]
    return []


def _leading_special(template: dict[str, Any]) -> tuple[str, int] | None:
    single = template.get("single") or []
    first = single[0] if single else None
    if not isinstance(first, dict) or "SpecialToken" not in first:
        return None
    token = first["SpecialToken"]["id"]
    ids = ((template.get("special_tokens") or {}).get(token) or {}).get("ids") or []
    return (token, int(ids[0])) if len(ids) == 1 else None


def bos_token(tokenizer_json: str) -> tuple[str, int] | None:
    """(token, id) of the special token the post-processor puts first in a single sequence, or
    None when it puts none there."""
    post = json.loads(tokenizer_json).get("post_processor")
    return next((b for t in _templates(post) if (b := _leading_special(t)) is not None), None)


def without_bos(tokenizer_json: str) -> str:
    """The same tokenizer without the BOS-adding templates (a `Sequence` keeps its other
    processors)."""
    raw = json.loads(tokenizer_json)
    post = raw.get("post_processor")
    if isinstance(post, dict) and post.get("type") == "TemplateProcessing" and _leading_special(post):
        raw["post_processor"] = None
    elif isinstance(post, dict) and post.get("type") == "Sequence":
        post["processors"] = [p for p in post["processors"] if not any(_leading_special(t) for t in _templates(p))]
    return json.dumps(raw, ensure_ascii=False)
