"""Tokenizer and chat template of a Hugging Face model directory.

`tokenizer.json` is loaded with the `tokenizers` library as is (a transformers tokenizer class may rebuild
the pre-tokenizer and change ids); `tokenizer_config.json` supplies the named special tokens, explicit
add_bos_token/add_eos_token and extra added tokens; the chat template comes from `chat_template.jinja`
(what transformers 5 writes; it wins when both exist) or `tokenizer_config.json["chat_template"]`, and is
rendered in a sandboxed jinja2 environment set up like transformers'.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
import jinja2.meta
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, processors

from pdserve.engine.model_config import ModelLoadError, read_json

NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")


class ChatTemplateError(ValueError):
    """The chat template rejected the messages (raise_exception) or failed to render."""


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # jinja2's own tojson HTML-escapes <, >, & and ', which would change what the model sees.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def chat_environment() -> ImmutableSandboxedEnvironment:
    """A sandboxed jinja2 environment with the globals and filters Hub chat templates expect."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _token_content(value: Any) -> str | None:
    # Older configs store special tokens as AddedToken dicts; newer ones as plain strings.
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _eos_ids(value: Any) -> set[int]:
    items = value if isinstance(value, list) else [value]
    return {i for i in items if isinstance(i, int) and not isinstance(i, bool)}


class Tokenizer:
    """Encodes, decodes and renders chat prompts for one model directory. Immutable after construction."""

    def __init__(self, path: str | Path) -> None:
        root = Path(path)
        tok_path = root / "tokenizer.json"
        if not tok_path.is_file():
            raise ModelLoadError(f"{tok_path}: file not found (only tokenizer.json tokenizers are supported)")
        try:
            self._tok = tokenizers.Tokenizer.from_file(str(tok_path))
        except Exception as e:  # tokenizers raises its own exception type for malformed files
            raise ModelLoadError(f"{tok_path}: not a valid tokenizer ({e})") from e
        cfg_path = root / "tokenizer_config.json"
        cfg = read_json(cfg_path) if cfg_path.exists() else {}
        map_path = root / "special_tokens_map.json"
        special_map = read_json(map_path) if map_path.exists() else {}

        self._add_missing_tokens(cfg.get("added_tokens_decoder") or {})
        self.special_tokens: dict[str, str] = {}  # e.g. {"bos_token": "<s>"}; only the tokens that are set
        for key in NAMED_SPECIAL_TOKENS:
            content = _token_content(cfg.get(key)) or _token_content(special_map.get(key))
            if content is not None:
                if self._tok.token_to_id(content) is None:
                    self._tok.add_special_tokens([AddedToken(content, special=True, normalized=False)])
                self.special_tokens[key] = content
        self._apply_bos_eos_flags(cfg)

        self.chat_template: str | None = self._read_chat_template(root, cfg, cfg_path)
        gen_path, model_cfg_path = root / "generation_config.json", root / "config.json"
        generation = read_json(gen_path) if gen_path.exists() else {}
        if generation.get("eos_token_id") is None and model_cfg_path.exists():
            generation = read_json(model_cfg_path)  # what generation falls back to without generation_config
        eos = _eos_ids(generation.get("eos_token_id"))
        if self.eos_token_id is not None:
            eos.add(self.eos_token_id)
        self.eos_token_ids: frozenset[int] = frozenset(eos)

    def _add_missing_tokens(self, added_tokens_decoder: dict[str, Any]) -> None:
        # Tokens listed in tokenizer_config but absent from tokenizer.json are added like transformers does.
        for _, spec in sorted(added_tokens_decoder.items(), key=lambda kv: int(kv[0])):
            content = _token_content(spec)
            if content is None or self._tok.token_to_id(content) is not None:
                continue
            token = AddedToken(
                content,
                single_word=bool(spec.get("single_word", False)),
                lstrip=bool(spec.get("lstrip", False)),
                rstrip=bool(spec.get("rstrip", False)),
                normalized=bool(spec.get("normalized", not spec.get("special", False))),
                special=bool(spec.get("special", False)),
            )
            if token.special:
                self._tok.add_special_tokens([token])
            else:
                self._tok.add_tokens([token])

    def _apply_bos_eos_flags(self, cfg: dict[str, Any]) -> None:
        # Explicit add_bos_token/add_eos_token (or no post-processor at all) replace the post-processor,
        # as transformers does; otherwise tokenizer.json's own post-processor decides.
        explicit = "add_bos_token" in cfg or "add_eos_token" in cfg
        if not explicit and self._tok.post_processor is not None:
            return
        parts_single, parts_pair, specials = ["$A:0"], ["$A:0", "$B:1"], []
        bos, eos = self.special_tokens.get("bos_token"), self.special_tokens.get("eos_token")
        if cfg.get("add_bos_token", False) and bos is not None:
            parts_single.insert(0, f"{bos}:0")
            parts_pair = [f"{bos}:0", "$A:0", f"{bos}:1", "$B:1"]
            specials.append((bos, self._tok.token_to_id(bos)))
        if cfg.get("add_eos_token", False) and eos is not None:
            parts_single.append(f"{eos}:0")
            a_end = parts_pair.index("$A:0") + 1
            parts_pair.insert(a_end, f"{eos}:0")
            parts_pair.append(f"{eos}:1")
            specials.append((eos, self._tok.token_to_id(eos)))
        self._tok.post_processor = processors.TemplateProcessing(
            single=" ".join(parts_single), pair=" ".join(parts_pair), special_tokens=specials
        )

    @staticmethod
    def _read_chat_template(root: Path, cfg: dict[str, Any], cfg_path: Path) -> str | None:
        jinja_path = root / "chat_template.jinja"
        if jinja_path.is_file():
            return jinja_path.read_text(encoding="utf-8")
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        if template is not None and not isinstance(template, str):
            raise ModelLoadError(f"{cfg_path}: field 'chat_template' must be a string or a list of named templates")
        return template

    @cached_property
    def _compiled_template(self) -> jinja2.Template:
        if self.chat_template is None:
            raise ChatTemplateError("this model has no chat template")
        try:
            return chat_environment().from_string(self.chat_template)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template does not compile: {e}") from e

    @cached_property
    def renders_tools(self) -> bool:
        """Whether the chat template reads the `tools` variable (renders tool definitions itself)."""
        if self.chat_template is None:
            return False
        try:
            ast = chat_environment().parse(self.chat_template)
        except jinja2.TemplateError:
            return False
        return "tools" in jinja2.meta.find_undeclared_variables(ast)

    @cached_property
    def _bos_prefix(self) -> bool:
        # True when plain encode() puts BOS in front of the text, so chat prompts need exactly one BOS too.
        bos = self.bos_token_id
        if bos is None:
            return False
        with_specials = self._tok.encode("a", add_special_tokens=True).ids
        return bool(with_specials) and with_specials[0] == bos

    def _special_id(self, key: str) -> int | None:
        content = self.special_tokens.get(key)
        return None if content is None else self._tok.token_to_id(content)

    @property
    def bos_token_id(self) -> int | None:
        return self._special_id("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        """The tokenizer's own EOS (eos_token_ids also holds generation_config's)."""
        return self._special_id("eos_token")

    @property
    def pad_token_id(self) -> int | None:
        return self._special_id("pad_token")

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included (may be below the model's padded vocab_size)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    @cached_property
    def all_special_ids(self) -> frozenset[int]:
        """Ids of every special added token and of the named special tokens."""
        ids = {i for i, t in self._tok.get_added_tokens_decoder().items() if t.special}
        ids.update(i for k in NAMED_SPECIAL_TOKENS if (i := self._special_id(k)) is not None)
        return frozenset(ids)

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The underlying `tokenizers.Tokenizer` (read-only use: e.g. id_to_token for detokenizing)."""
        return self._tok

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; with add_special_tokens the post-processor adds BOS/EOS as configured."""
        # encode_batch releases the GIL while the Rust side works (encode holds it), so a long prompt
        # tokenized on a worker thread (the frontend's) does not stall the threads around it.
        return self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids` through tokenizer.json's decoder (byte-level: invalid UTF-8 tails come out as U+FFFD)."""
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **template_kwargs: Any
    ) -> str:
        """Renders `messages` ([{"role": ..., "content": ...}, ...]) through the chat template. Keys set to
        None are dropped and the named special tokens are visible (bos_token, ...), as in transformers;
        template_kwargs (tools, enable_thinking, ...) are passed through. Raises ChatTemplateError."""
        if not messages:
            raise ChatTemplateError("cannot render an empty conversation")
        clean = [{k: v for k, v in m.items() if v is not None} for m in messages]
        context: dict[str, Any] = {"tools": None, "documents": None, **self.special_tokens, **template_kwargs}
        try:
            return self._compiled_template.render(
                messages=clean, add_generation_prompt=add_generation_prompt, **context
            )
        except jinja2.TemplateError as e:
            raise ChatTemplateError(str(e)) from e
        except (TypeError, ValueError, AttributeError, KeyError, IndexError, ZeroDivisionError) as e:
            # A template doing arithmetic or string work on a value it did not expect (e.g. a request's
            # chat_template_kwargs): the messages' fault, not the server's.
            raise ChatTemplateError(f"{type(e).__name__}: {e}") from e

    def encode_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **template_kwargs: Any
    ) -> list[int]:
        """Token ids of the rendered chat. The template's special tokens are taken as written; BOS is added
        only when the tokenizer normally adds one and the template did not, so there is never a double BOS."""
        text = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **template_kwargs)
        ids = self.encode(text, add_special_tokens=False)
        bos = self.bos_token_id
        if self._bos_prefix and bos is not None and (not ids or ids[0] != bos):
            ids.insert(0, bos)
        return ids
