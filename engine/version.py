"""The pdserve version and content digests that name what a process serves, for logs, metrics,
`/v1/models` and node records: two processes that report the same digests read the same tokenizer and chat
template (the frontend keeps a node whose digests differ from its own out of the pool)."""

from __future__ import annotations

import functools
import hashlib
import json
from importlib import metadata
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pdserve.engine.tokenizer import Tokenizer


@functools.cache
def pdserve_version() -> str:
    """The installed pdserve distribution's version ("0+unknown" when run from a tree not installed)."""
    try:
        return metadata.version("pdserve")
    except metadata.PackageNotFoundError:
        return "0+unknown"


def short_digest(text: str) -> str:
    """The first 16 hex digits of the SHA-256 of `text`: short enough for a label, long enough to tell
    versions apart."""
    return hashlib.sha256(text.encode()).hexdigest()[:16]


# The chat template digest of a model without one (a digest never looks like this).
NO_CHAT_TEMPLATE = "none"


def tokenizer_digest(tokenizer: Tokenizer) -> str:
    """`short_digest` of how `tokenizer` turns text into ids and back: its serialization as loaded
    (tokenizer.json with tokenizer_config's added tokens and BOS/EOS flags applied) and which tokens are
    BOS/EOS/PAD and stop generation. The frontend and every node of a pool must agree on it."""
    specials = json.dumps({"special_tokens": tokenizer.special_tokens, "eos_token_ids": sorted(tokenizer.eos_token_ids)},
                          sort_keys=True)
    return short_digest(tokenizer.backend.to_str() + "\0" + specials)


def chat_template_digest(template: str | None) -> str:
    """`short_digest` of the chat template's text, or NO_CHAT_TEMPLATE for a model without one."""
    return NO_CHAT_TEMPLATE if template is None else short_digest(template)
