"""The pdserve version and content digests that name what a process serves, for logs, metrics and
`/v1/models`: two processes that report the same digests read the same tokenizer and chat template."""

from __future__ import annotations

import functools
import hashlib
from importlib import metadata


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
