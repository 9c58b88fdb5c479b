"""What to send and when: length distributions, synthetic prompts of a controlled token length, shared
system prompts, trace files, and Poisson arrival schedules. Pure functions of a seeded RNG, so a run is
reproducible and testable without a server."""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Common English words: every one is a single token (with its leading space) in SmolLM2's 49k BPE
# vocabulary, and in any large BPE vocabulary we looked at, so N words approximate N tokens when no
# tokenizer is given. The server's `usage` reports the real count either way.
WORDS = (
    "the of and to in is it that for on with as was at by be this have from or one had not but what all "
    "were when we there can an your which their said if do will each about how up out them then she many "
    "some so these would other into has more her two like him see time could no make than first been its "
    "who now people my made over did down only way find use may water long little very after words called "
    "just where most know get through back much before go good new write our used me man too any day same "
    "right look think also around another came come work three word must because does part even place well "
    "such here take why things help put years different away again off went old number great tell men say "
    "small every found still between name should home big give air line set own under read last never us "
    "left end along while might next sound below saw something thought both few those always looks show "
    "large often together asked house world going want school important until form food keep children feet "
    "land side without boy once animals life enough took sometimes four head above kind began almost live "
    "page got earth need far hand high year mother light parts country father let night following picture "
    "being study second eyes soon times story boys since white days ever paper hard near sentence better "
    "best across during today others however sure means knew try told young miles sun ways thing whole "
    "hear example heard several change answer room sea against top turned learn point city play toward "
    "five using himself usually"
).split()


@dataclass(frozen=True)
class LengthDist:
    """A token-count distribution: fixed `a`, uniform integers in [a, b], or normal(mean a, std b)
    rounded; every sample is at least 1."""

    kind: str  # "fixed" | "uniform" | "normal"
    a: float
    b: float = 0.0

    def sample(self, rng: random.Random) -> int:
        """One length; advances `rng` (not for "fixed")."""
        if self.kind == "fixed":
            return max(1, int(self.a))
        if self.kind == "uniform":
            return max(1, rng.randint(int(self.a), int(self.b)))
        return max(1, round(rng.gauss(self.a, self.b)))

    def __str__(self) -> str:
        if self.kind == "fixed":
            return str(int(self.a))
        return f"{self.kind}:{self.a:g}:{self.b:g}"


@dataclass(frozen=True)
class MixtureDist:
    """A weighted mixture of `LengthDist`s, e.g. 80% short chats and 20% long documents: each sample first
    picks a component by weight, then draws from it."""

    components: tuple[tuple[float, LengthDist], ...]  # (weight > 0, distribution); weights need not sum to 1

    def sample(self, rng: random.Random) -> int:
        """One length; advances `rng` (the pick, then the component's draw)."""
        pick = rng.random() * sum(w for w, _ in self.components)
        for weight, dist in self.components:
            pick -= weight
            if pick < 0:
                return dist.sample(rng)
        return self.components[-1][1].sample(rng)

    def __str__(self) -> str:
        return "+".join(f"{w:g}*{d}" for w, d in self.components)


def parse_dist(text: str) -> LengthDist | MixtureDist:
    """Parses `512`, `uniform:32:512`, `normal:mean:std`, or a mixture of them with weights:
    `0.8*uniform:64:256+0.2*uniform:1024:4096`. Raises ValueError with the accepted forms."""
    if "+" in text or "*" in text:
        components = []
        for term in text.split("+"):
            weight, star, dist = term.strip().partition("*")
            try:
                w = float(weight)
            except ValueError:
                w = -1.0
            if not star or not w > 0:
                raise ValueError(f"bad length {text!r}: a mixture is W*DIST+W*DIST+..., weights > 0")
            components.append((w, _parse_one(dist)))
        return MixtureDist(tuple(components))
    return _parse_one(text)


def _parse_one(text: str) -> LengthDist:
    forms = "expected N, uniform:LO:HI or normal:MEAN:STD"
    parts = text.strip().split(":")
    try:
        if len(parts) == 1:
            n = int(parts[0])
            if n < 1:
                raise ValueError
            return LengthDist("fixed", n)
        kind, a, b = parts[0].lower(), float(parts[1]), float(parts[2])
    except (ValueError, IndexError):
        raise ValueError(f"bad length {text!r}: {forms}, with positive integers") from None
    if len(parts) != 3 or kind not in ("uniform", "normal"):
        raise ValueError(f"bad length {text!r}: {forms}")
    if kind == "uniform" and not (1 <= a <= b and a.is_integer() and b.is_integer()):
        raise ValueError(f"bad length {text!r}: uniform needs integers 1 <= LO <= HI")
    if kind == "normal" and not (a >= 1 and b >= 0):
        raise ValueError(f"bad length {text!r}: normal needs MEAN >= 1 and STD >= 0")
    return LengthDist(kind, a, b)


@dataclass
class RequestSpec:
    """One request to send. `system` (a shared prefix) goes first: as the system message for chat,
    prepended to the prompt for completions. `prompt_tokens` is the length of system + prompt by the
    local tokenizer when one was used (None when approximated by words)."""

    index: int
    prompt: str
    max_tokens: int
    system: str | None = None
    group: int | None = None
    arrival_s: float | None = None  # trace replay: offset from the start of the run
    prompt_tokens: int | None = None


class TextMaker:
    """Random word text of a given token length: exact with a tokenizer.json, approximate without."""

    def __init__(self, tokenizer_path: str | Path | None = None) -> None:
        self.tokenizer: Any = None
        if tokenizer_path is not None:
            from tokenizers import Tokenizer  # optional dependency, only for exact lengths

            path = Path(tokenizer_path)
            self.tokenizer = Tokenizer.from_file(str(path / "tokenizer.json" if path.is_dir() else path))

    def count(self, text: str) -> int | None:
        """Tokens of `text` (no special tokens), or None without a tokenizer."""
        if self.tokenizer is None:
            return None
        return len(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def make(self, n_tokens: int, rng: random.Random) -> str:
        """Text of `n_tokens` tokens (exactly, with a tokenizer; else `n_tokens` words); advances `rng`."""
        if self.tokenizer is None:
            return " ".join(rng.choice(WORDS) for _ in range(n_tokens))
        text = ""
        for _ in range(8):  # cutting at a token boundary is exact for word-level BPE; retry otherwise
            have = self.count(text) or 0
            if have < n_tokens:
                extra = " ".join(rng.choice(WORDS) for _ in range(n_tokens - have + 4))
                text = f"{text} {extra}" if text else extra
            enc = self.tokenizer.encode(text, add_special_tokens=False)
            if len(enc.ids) > n_tokens:
                text = text[: enc.offsets[n_tokens - 1][1]]
            if self.count(text) == n_tokens:
                return text
        return text


@dataclass
class WorkloadConfig:
    """How synthetic requests are drawn."""

    prompt_tokens: LengthDist | MixtureDist
    output_tokens: LengthDist | MixtureDist
    shared_prefix_groups: int = 0
    shared_prefix_tokens: int = 0
    seed: int = 0
    tokenizer: str | None = None


def draw_lengths(cfg: WorkloadConfig, rng: random.Random) -> tuple[int, int]:
    """Request lengths (prompt tokens without the shared prefix, output tokens); advances `rng`. The
    `i`-th request draws from `random.Random(f"{seed}-{i}")`, so the simulator (`planner`) sees the
    lengths `pdserve bench` sends."""
    return cfg.prompt_tokens.sample(rng), cfg.output_tokens.sample(rng)


class Workload:
    """Draws request `i` deterministically from the seed (so a sweep's rates see the same requests)."""

    def __init__(self, cfg: WorkloadConfig) -> None:
        self.cfg = cfg
        self.maker = TextMaker(cfg.tokenizer)
        rng = random.Random(f"{cfg.seed}-prefix")
        self.prefixes = [self.maker.make(cfg.shared_prefix_tokens, rng)
                         for _ in range(cfg.shared_prefix_groups if cfg.shared_prefix_tokens > 0 else 0)]

    def spec(self, i: int) -> RequestSpec:
        """The `i`-th request; changes nothing."""
        rng = random.Random(f"{self.cfg.seed}-{i}")
        n_prompt, n_out = draw_lengths(self.cfg, rng)
        group = i % len(self.prefixes) if self.prefixes else None
        return self._finish(RequestSpec(i, self.maker.make(n_prompt, rng), n_out, group=group))

    def from_trace(self, i: int, entry: TraceEntry) -> RequestSpec:
        """The request of a trace line: its text, or synthetic text of its `prompt_tokens`."""
        prompt = entry.prompt
        if prompt is None:
            prompt = self.maker.make(entry.prompt_tokens or 1, random.Random(f"{self.cfg.seed}-{i}"))
        return self._finish(RequestSpec(i, prompt, entry.output_tokens, arrival_s=entry.arrival_s))

    def _finish(self, spec: RequestSpec) -> RequestSpec:
        if spec.group is not None:
            spec.system = self.prefixes[spec.group]
        n = self.maker.count(spec.prompt)
        if n is not None and spec.system is not None:
            n += self.maker.count(spec.system) or 0
        spec.prompt_tokens = n
        return spec


def poisson_arrivals(rate: float, rng: random.Random, n: int | None = None,
                     duration: float | None = None) -> list[float]:
    """Arrival offsets (s) of a Poisson process at `rate` req/s: the first at 0, then exponential gaps,
    until `n` arrivals or past `duration`. An infinite rate sends everything at once. Advances `rng`."""
    if n is None and duration is None:
        raise ValueError("a Poisson schedule needs a request count or a duration")
    if rate <= 0:
        raise ValueError(f"the request rate must be positive, got {rate}")
    if math.isinf(rate):
        if n is None:
            raise ValueError("an infinite rate needs a request count")
        return [0.0] * n
    out: list[float] = []
    t = 0.0
    while (n is None or len(out) < n) and (duration is None or t < duration):
        out.append(t)
        t += rng.expovariate(rate)
    return out


@dataclass(frozen=True)
class TraceEntry:
    """One line of a trace: when to send, what (text or a token count), and how many tokens to ask."""

    arrival_s: float
    output_tokens: int
    prompt: str | None = None
    prompt_tokens: int | None = None


class TraceError(ValueError):
    """A malformed trace file; the message names the file and line."""


def _positive_int(obj: dict[str, Any], key: str, where: str) -> int:
    value = obj.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise TraceError(f"{where}: {key!r} must be a positive integer, got {value!r}")
    return value


def parse_trace_line(line: str, where: str) -> TraceEntry:
    """One JSONL line -> TraceEntry. Raises TraceError naming `where` (file:line)."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as err:
        raise TraceError(f"{where}: not JSON: {err.msg}") from None
    if not isinstance(obj, dict):
        raise TraceError(f"{where}: each line must be a JSON object")
    arrival = obj.get("arrival_s")
    if isinstance(arrival, bool) or not isinstance(arrival, int | float) or not 0 <= arrival < math.inf:
        raise TraceError(f"{where}: 'arrival_s' must be a number >= 0, got {arrival!r}")
    prompt = obj.get("prompt")
    if prompt is not None and (not isinstance(prompt, str) or not prompt):
        raise TraceError(f"{where}: 'prompt' must be a non-empty string")
    if (prompt is None) == (obj.get("prompt_tokens") is None):
        raise TraceError(f"{where}: give exactly one of 'prompt' (text) or 'prompt_tokens' (a count)")
    n_prompt = None if prompt is not None else _positive_int(obj, "prompt_tokens", where)
    return TraceEntry(float(arrival), _positive_int(obj, "output_tokens", where), prompt, n_prompt)


def read_trace(path: str | Path) -> list[TraceEntry]:
    """The entries of a JSONL trace, sorted by arrival (blank lines skipped). Raises TraceError."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise TraceError(f"{path}: cannot read the trace: {err}") from None
    entries = [parse_trace_line(line, f"{path}:{i}") for i, line in enumerate(lines, 1) if line.strip()]
    if not entries:
        raise TraceError(f"{path}: the trace has no requests")
    return sorted(entries, key=lambda e: e.arrival_s)
