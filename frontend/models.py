"""The served models: names and aliases, their tokenizer and context limits, and token strings for logprobs.

The tokenizer is used once per request, here in the frontend: chat rendering, prompt token counts and
context checks. Nodes receive token ids and never re-tokenize. Only the tokenizer and config.json are
read; no weights are loaded.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import time
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from pdserve.engine.model_config import ModelLoadError, parse_model_config, read_json
from pdserve.engine.tokenizer import ChatTemplateError, Tokenizer
from pdserve.engine.version import chat_template_digest, tokenizer_digest
from pdserve.frontend.config import ConfigError, ModelSpec
from pdserve.frontend.degrade import NO_POLICY, DegradePolicy
from pdserve.frontend.errors import APIError, bad_request
from pdserve.frontend.pricing import Prices
from pdserve.frontend.reasoning import ReasoningFormat, ReasoningFormatError, reasoning_format
from pdserve.frontend.tools import ToolSpec, template_input

log = logging.getLogger(__name__)


def _byte_decoder() -> dict[str, int]:
    # Inverse of the GPT-2 byte-to-unicode table that byte-level BPE vocabularies are written in.
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    codes = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            codes.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, codes, strict=True)}


@dataclass(frozen=True)
class TokenText:
    """A token as logprobs report it: its text and its exact UTF-8 bytes."""

    text: str
    bytes: list[int]


class TokenTexts:
    """Maps token ids to `TokenText` for one tokenizer (cached; read-only otherwise)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tok = tokenizer
        decoder = json.loads(tokenizer.backend.to_str()).get("decoder") or {}
        self._byte_level = decoder.get("type") == "ByteLevel" or any(
            d.get("type") == "ByteLevel" for d in decoder.get("decoders", []) if isinstance(d, dict)
        )
        self._byte_map = _byte_decoder()
        self._added = {i: t.content for i, t in tokenizer.backend.get_added_tokens_decoder().items()}
        self.get = lru_cache(maxsize=65536)(self._compute)

    def _compute(self, token_id: int) -> TokenText:
        if token_id in self._added:
            content = self._added[token_id]
            return TokenText(content, list(content.encode("utf-8")))
        piece = self._tok.id_to_token(token_id)
        if piece is None:
            return TokenText("", [])
        if self._byte_level and all(c in self._byte_map for c in piece):
            raw = bytes(self._byte_map[c] for c in piece)
        elif len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            raw = bytes([int(piece[3:5], 16)])  # sentencepiece byte fallback
        else:
            raw = piece.replace("\u2581", " ").encode("utf-8")  # sentencepiece's word boundary marker
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            # Part of a multi-byte character: name the bytes, as OpenAI does; `bytes` stays exact.
            text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
        return TokenText(text, list(raw))


# Fill-in-the-middle control tokens (prefix, suffix, middle) of the tokenizer families that have them; the
# prompt is laid out prefix-suffix-middle and the model generates the middle.
FIM_TOKENS: tuple[tuple[str, str, str], ...] = (
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),
    ("<\uff5cfim\u2581begin\uff5c>", "<\uff5cfim\u2581hole\uff5c>", "<\uff5cfim\u2581end\uff5c>"),
)


def fim_token_ids(tokenizer: Tokenizer) -> tuple[int, int, int] | None:
    """(prefix, suffix, middle) token ids when the tokenizer has a fill-in-the-middle set, else None."""
    for names in FIM_TOKENS:
        ids = [tokenizer.token_to_id(n) for n in names]
        if all(i is not None for i in ids):
            return ids[0], ids[1], ids[2]  # type: ignore[return-value]
    return None


@dataclass(eq=False)
class ServedModel:
    """One served model with its tokenizer; shared by every request for it."""

    spec: ModelSpec
    tokenizer: Tokenizer
    texts: TokenTexts
    max_context: int
    created: int
    tokenizer_digest: str  # `engine.version.tokenizer_digest`; a node must publish the same one to serve it
    chat_template_digest: str  # `engine.version.chat_template_digest` ("none" without a template); likewise
    reasoning: ReasoningFormat | None = None  # how its chat answers mark their thinking span (None: not split)
    prices: Prices | None = None  # the models file's price table (None: requests cost nothing)
    # Its degradation policies (`frontend.degrade`): the models file's, replaced when the file is re-read.
    degrade: DegradePolicy = NO_POLICY

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def pool(self) -> str:
        return self.spec.pool

    @property
    def version(self) -> str:
        return self.spec.version

    def encode_chat(self, messages: list[dict[str, Any]], tools: ToolSpec | None = None,
                    template_kwargs: dict[str, Any] | None = None) -> list[int]:
        """Token ids of the chat prompt (with the tools the model may call; `template_kwargs`: the request's
        extra template variables, e.g. enable_thinking, never replacing the server's own). Raises a 400
        APIError when the template rejects the messages."""
        messages, kwargs = template_input(messages, tools, self.tokenizer.renders_tools)
        try:
            return self.tokenizer.encode_chat(messages, add_generation_prompt=True,
                                              **{**(template_kwargs or {}), **kwargs})
        except ChatTemplateError as err:
            raise bad_request(f"The chat template of model {self.name!r} rejected the messages: {err}",
                              param="messages", code="invalid_messages") from None

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def fill_in_middle(self, prefix_ids: list[int], suffix: str, param: str = "suffix") -> list[int]:
        """The prompt that asks for the text between `prefix_ids` and `suffix` (prefix-suffix-middle order,
        after BOS when the prefix starts with it). A 400 APIError when the model has no such tokens."""
        fim = fim_token_ids(self.tokenizer)
        if fim is None:
            raise APIError(400, f"Model {self.name!r} cannot insert text: its tokenizer has no fill-in-the-middle "
                           "tokens, so 'suffix' is not supported.", param=param, code="unsupported_parameter")
        pre, suf, mid = fim
        bos = self.tokenizer.bos_token_id
        head = prefix_ids[:1] if prefix_ids and bos is not None and prefix_ids[0] == bos else []
        return [*head, pre, *prefix_ids[len(head):], suf, *self.tokenizer.encode(suffix, add_special_tokens=False), mid]

    def check_token_ids(self, ids: list[int], param: str) -> None:
        vocab = self.tokenizer.vocab_size
        for j, tok in enumerate(ids):
            if tok >= vocab:
                raise APIError(400, f"Invalid value for '{param}[{j}]': token id {tok} is outside the vocabulary "
                               f"of model {self.name!r} (size {vocab}).", param=f"{param}[{j}]", code="invalid_value")


def _max_model_len(path: Path) -> int | None:
    config_path = path / "config.json"
    if not config_path.is_file():
        return None
    gen_path = path / "generation_config.json"
    generation = read_json(gen_path) if gen_path.exists() else None
    return parse_model_config(read_json(config_path), generation, config_path).max_model_len


class ModelCatalog:
    """Served names and aliases -> ServedModel, one per version of each model. Loaded once at startup;
    afterwards only the versions' routing weights and prices change (`set_weights`, `set_prices`: the
    models file re-read), and the round-robin credit that `rank` keeps."""

    def __init__(self, specs: tuple[ModelSpec, ...]) -> None:
        self._versions: dict[str, list[ServedModel]] = {}  # model name -> its versions, in file order
        self._names: dict[str, str] = {}  # served name or alias -> model name
        self._weights: dict[tuple[str, str], float] = {}  # (name, version) -> routing weight
        self._credit: dict[tuple[str, str], float] = {}  # smooth weighted round-robin state
        now = int(time.time())
        for spec in specs:
            path = Path(spec.path)
            try:
                tokenizer = Tokenizer(path)
                model_len = _max_model_len(path)
                reasoning = reasoning_format(spec.reasoning_parser, tokenizer.chat_template, tokenizer.token_to_id,
                                             tokenizer.all_special_ids)
            except (ModelLoadError, ReasoningFormatError) as err:
                raise ConfigError(f"model {spec.name!r}: {err}") from err
            limits = [x for x in (model_len, spec.max_context) if x is not None]
            if not limits:
                raise ConfigError(f"model {spec.name!r}: no config.json in {path}; set max_context")
            served = ServedModel(spec, tokenizer, TokenTexts(tokenizer), min(limits), now, tokenizer_digest(tokenizer),
                                 chat_template_digest(tokenizer.chat_template), reasoning, spec.prices)
            served.degrade = spec.degrade
            self._versions.setdefault(spec.name, []).append(served)
            self._weights[(spec.name, spec.version)] = spec.weight
            self._credit[(spec.name, spec.version)] = 0.0
            for name in (spec.name, *spec.aliases):
                self._names[name] = spec.name
        log.info("serving models: %s", ", ".join(
            f"{m.name}{'@' + m.version if m.version else ''} (pool {m.pool}, context {m.max_context}"
            f"{', reasoning ' + m.reasoning.style if m.reasoning else ''})"
            for m in self.all_versions))

    def resolve(self, name: str) -> ServedModel:
        """The model served under `name` (a name or an alias; its first version stands for it until `rank`
        picks one); 404 APIError when there is none."""
        model = self.get(name)
        if model is None:
            raise APIError(404, f"The model `{name}` does not exist or you do not have access to it.",
                           type="invalid_request_error", param="model", code="model_not_found")
        return model

    def get(self, name: str) -> ServedModel | None:
        key = self._names.get(name)
        return None if key is None else self._versions[key][0]

    def version(self, name: str, version: str) -> ServedModel:
        """One version of a model (KeyError when there is no such version)."""
        return next(m for m in self._versions[self._names[name]] if m.version == version)

    def versions_of(self, model: ServedModel) -> list[ServedModel]:
        return list(self._versions[model.name])

    def weight(self, model: ServedModel) -> float:
        return self._weights[(model.name, model.version)]

    def rank(self, model: ServedModel, session_key: str | None) -> list[ServedModel]:
        """The versions of `model` that take new requests (weight > 0), the one this request goes to
        first, then the others by weight. With a session key the first is a weighted rendezvous hash of it
        (a session keeps its version; a weight change moves only the sessions it must); without one,
        smooth weighted round-robin (exactly the weights' split). Changes the round-robin credit."""
        versions = [v for v in self._versions[model.name] if self.weight(v) > 0]
        if len(versions) <= 1:
            return versions
        by_weight = sorted(versions, key=lambda v: -self.weight(v))
        if session_key:
            first = max(versions, key=lambda v: self.weight(v) / -math.log(_unit_hash(session_key, v.version)))
        else:
            total = 0.0
            for v in versions:
                self._credit[(v.name, v.version)] += self.weight(v)
                total += self.weight(v)
            first = max(versions, key=lambda v: self._credit[(v.name, v.version)])
            self._credit[(first.name, first.version)] -= total
        return [first, *(v for v in by_weight if v is not first)]

    def set_weights(self, weights: dict[tuple[str, str], float]) -> list[str]:
        """Sets the weight of each known (name, version) in `weights` (others unchanged); returns a line per
        change. Round-robin credit restarts, so the new split holds from the next request."""
        changes = []
        for key, weight in weights.items():
            if key in self._weights and self._weights[key] != weight:
                changes.append(f"{key[0]}@{key[1] or '-'}: weight {self._weights[key]:g} -> {weight:g}")
                self._weights[key] = weight
        if changes:
            self._credit = dict.fromkeys(self._credit, 0.0)
        return changes

    def set_prices(self, prices: dict[tuple[str, str], Prices | None]) -> list[str]:
        """Sets the price table of each known (name, version) in `prices` (others unchanged); requests
        ending from now on are charged at it. Returns a line per change."""
        changes = []
        for m in self.all_versions:
            key = (m.name, m.version)
            if key in prices and prices[key] != m.prices:
                changes.append(f"{m.name}@{m.version or '-'}: prices {_price_text(m.prices)} -> {_price_text(prices[key])}")
                m.prices = prices[key]
        return changes

    def set_degrade(self, policies: dict[tuple[str, str], DegradePolicy]) -> list[str]:
        """Puts in force the degradation policies of each known (name, version) in `policies`; returns a
        line per change."""
        changes = []
        for m in self.all_versions:
            policy = policies.get((m.name, m.version))
            if policy is not None and policy != m.degrade:
                changes.append(f"{m.name}@{m.version or '-'}: degrade {m.degrade.describe()} -> {policy.describe()}")
                m.degrade = policy
        return changes

    def names_of(self, model: ServedModel) -> tuple[str, ...]:
        return (model.spec.name, *model.spec.aliases)

    @property
    def models(self) -> list[ServedModel]:
        """One entry per served model (its first version)."""
        return [versions[0] for versions in self._versions.values()]

    @property
    def all_versions(self) -> list[ServedModel]:
        return [v for versions in self._versions.values() for v in versions]

    @property
    def served_names(self) -> set[str]:
        return set(self._names)


def _price_text(prices: Prices | None) -> str:
    if prices is None:
        return "none"
    return (f"input {prices.input:g}, cached_input {prices.cached_input:g}, output {prices.output:g} USD/1M tokens, "
            f"batch_discount {prices.batch_discount:g}")


def _unit_hash(key: str, version: str) -> float:
    """A uniform number in (0, 1) from a session key and a version name (stable across processes)."""
    digest = hashlib.blake2b(f"{key}\0{version}".encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "big") + 0.5) / 2.0**64
