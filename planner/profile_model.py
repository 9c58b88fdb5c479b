"""The cost model a profile holds, and its JSON file: torch-free, so `pdserve plan` runs anywhere.

One engine step's time is a linear model of what the step computes (fitted by least squares from the
points `pdserve profile` measured):

    step_s = max(decode.a, prefill.a)                         fixed cost (launches, scheduling, sampling)
           + decode.b * decode_seqs + decode.c * context      decodes: weights once a token, K/V read
           + prefill.b * prefill_tokens + prefill.c * attn    prefill chunks: matmuls, attention

where `context` is the sum of the decoding sequences' token counts and `attn` the sum over prefill chunks
of chunk * (tokens before it + chunk) (the quadratic attention term; prefix-cache hits count as tokens
before it). A pure decode step is `decode.a + ...`, a pure prefill step `prefill.a + ...`; a mixed step
(a colocated node, or a decode node's local prefill) pays the fixed cost once.

KV transfer: `transfer_s = transfer.a + transfer.b * bytes`, bytes = tokens * kv_bytes_per_token.

Tensor parallelism: a profile's fits are those of one TP width (`Profile.tp`, 1 unless measured
otherwise); `pdserve profile --tp-widths 1,2` measures more, each kept whole (its fits, engine facts, the
KV capacity of a node of that width, points) in `Profile.by_tp` and returned by `Profile.at_tp(w)`. The
JSON holds the first width at the top level as before (`tensor_parallel_size`, 1 when absent: older
profiles are TP 1) and the others under `"tp": {"2": {...}}`.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pdserve.planner.machine import check_profile_machine

SCHEMA_VERSION = 1


@dataclass(frozen=True)
class Linear:
    """y = a + b*x1 + c*x2 (coefficients in seconds per unit); `rmse` of the fit, in seconds."""

    a: float
    b: float = 0.0
    c: float = 0.0
    rmse: float = 0.0


@dataclass(frozen=True)
class EngineFacts:
    """The engine settings the profile was measured with, which the simulator's nodes use."""

    block_size: int
    num_kv_blocks: int  # KV capacity of one node at the configured memory
    kv_bytes_per_token: int  # K/V bytes of one context token, all layers
    max_num_batched_tokens: int
    max_num_seqs: int
    local_prefill_threshold: int = 64


@dataclass
class Profile:
    """A measured (or synthetic) cost model of one model on one machine."""

    prefill: Linear
    decode: Linear
    transfer: Linear
    engine: EngineFacts
    machine: dict[str, Any] = field(default_factory=dict)
    model: dict[str, Any] = field(default_factory=dict)
    points: dict[str, list[dict[str, float]]] = field(default_factory=dict)
    schema_version: int = SCHEMA_VERSION
    tp: int = 1  # the tensor-parallel width these fits were measured at
    by_tp: dict[int, Profile] = field(default_factory=dict)  # the other widths measured (each with its own tp)

    @property
    def tp_widths(self) -> tuple[int, ...]:
        """Every width this profile has fits for, ascending."""
        return tuple(sorted({self.tp, *self.by_tp}))

    def at_tp(self, width: int) -> Profile:
        """The profile of nodes `width` ranks wide. Raises ValueError when it was not measured."""
        if width == self.tp:
            return self
        if width in self.by_tp:
            return self.by_tp[width]
        raise ValueError(f"the profile has no TP {width} measurements (it has TP "
                         f"{', '.join(map(str, self.tp_widths))}): run `pdserve profile --tp-widths "
                         f"{','.join(map(str, sorted({*self.tp_widths, width})))}`")

    def with_widths(self, others: list[Profile]) -> Profile:
        """This profile holding `others` (profiles of other widths, the same model and machine) too."""
        for o in others:
            if o.tp == self.tp or o.tp in self.by_tp:
                raise ValueError(f"TP {o.tp} given twice")
            self.by_tp[o.tp] = o
        return self

    def step_s(self, decode_seqs: int, context_tokens: int, prefill_tokens: int, prefill_attn: float) -> float:
        """One engine step's predicted time (see the module docstring); 0 for an empty step."""
        if decode_seqs == 0 and prefill_tokens == 0:
            return 0.0
        fixed = max(self.decode.a if decode_seqs else 0.0, self.prefill.a if prefill_tokens else 0.0)
        t = (fixed + self.decode.b * decode_seqs + self.decode.c * context_tokens
             + self.prefill.b * prefill_tokens + self.prefill.c * prefill_attn)
        return max(t, 1e-9)

    def prefill_s(self, tokens: int, cached: int = 0) -> float:
        """One prompt of `tokens` new tokens after `cached` hits, prefilled alone in one step."""
        return self.step_s(0, 0, tokens, tokens * (cached + tokens))

    def transfer_s(self, tokens: int) -> float:
        """Shipping the K/V of `tokens` tokens over one pair channel."""
        return max(self.transfer.a + self.transfer.b * tokens * self.engine.kv_bytes_per_token, 0.0)

    def _fits_dict(self) -> dict[str, Any]:
        return {"engine": asdict(self.engine),
                "fits": {"prefill": asdict(self.prefill), "decode": asdict(self.decode),
                         "transfer": asdict(self.transfer)},
                "points": self.points}

    def to_dict(self) -> dict[str, Any]:
        d = {"schema_version": self.schema_version, "machine": self.machine, "model": self.model,
             "tensor_parallel_size": self.tp, **self._fits_dict()}
        if self.by_tp:
            d["tp"] = {str(w): p._fits_dict() for w, p in sorted(self.by_tp.items())}
        return d

    def save(self, path: str | Path) -> None:
        """Writes the profile as JSON to `path`."""
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n", encoding="utf-8")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Profile:
        """Raises ValueError for a missing field or another schema version."""
        if d.get("schema_version") != SCHEMA_VERSION:
            raise ValueError(f"profile schema_version {d.get('schema_version')!r}, this pdserve reads "
                             f"{SCHEMA_VERSION}: measure again with `pdserve profile`")
        machine, model = d.get("machine", {}), d.get("model", {})

        def one(part: dict[str, Any], tp: Any) -> Profile:
            if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
                raise ValueError(f"not a pdserve profile: tensor_parallel_size {tp!r} is not an integer >= 1")
            try:
                fits = part["fits"]
                return cls(Linear(**fits["prefill"]), Linear(**fits["decode"]), Linear(**fits["transfer"]),
                           EngineFacts(**part["engine"]), machine, model, part.get("points", {}), tp=tp)
            except (KeyError, TypeError) as err:
                raise ValueError(f"not a pdserve profile: {err}") from None

        base = one(d, d.get("tensor_parallel_size", 1))
        others = d.get("tp", {})
        if not isinstance(others, dict):
            raise ValueError("not a pdserve profile: \"tp\" is not a mapping of widths")
        try:
            widths = {int(w): part for w, part in others.items()}
        except ValueError:
            raise ValueError(f"not a pdserve profile: TP widths {list(others)} are not integers") from None
        return base.with_widths([one(part, w) for w, part in sorted(widths.items())])


def load_profile_here(path: str | Path, allow_other_machine: bool = False) -> Profile:
    """`load_profile`, refused (ValueError) when measured on another CPU kind than this machine's unless
    `allow_other_machine`; the warnings (another kind allowed, an old profile without the record) go to
    stderr."""
    profile = load_profile(path)
    for warning in check_profile_machine(profile.machine, allow_other_machine):
        print(f"pdserve plan: {path}: {warning}", file=sys.stderr)
    return profile


def load_profile(path: str | Path) -> Profile:
    """Reads a profile JSON file. Raises ValueError (bad content) or OSError."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}: not JSON: {err.msg}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: not a pdserve profile")
    return Profile.from_dict(data)


def fit_linear(rows: list[tuple[float, float]], ys: list[float]) -> Linear:
    """Least squares y = a + b*x1 + c*x2 over `rows` of (x1, x2), with a, b, c >= 0: a cost never falls as
    work grows, so a coefficient that noise makes negative is dropped and the rest refitted. By the normal
    equations with a tiny ridge, so that a feature that never varies (e.g. a context never measured) gets
    a zero coefficient instead of a singular system."""
    if len(rows) != len(ys) or not rows:
        raise ValueError("fit_linear needs as many rows as values, at least one")
    use = [True, True, True]  # intercept, x1, x2
    while True:
        a, b, c = _least_squares([(r[0] if use[1] else 0.0, r[1] if use[2] else 0.0) for r in rows], ys, use[0])
        negative = [i for i, v in enumerate((a, b, c)) if v < 0 and use[i]]
        if not negative:
            break
        use[min(negative, key=lambda i: (a, b, c)[i])] = False
    resid = [y - (a + b * r[0] + c * r[1]) for r, y in zip(rows, ys, strict=True)]
    return Linear(a, b, c, math.sqrt(sum(e * e for e in resid) / len(resid)))


def _least_squares(rows: list[tuple[float, float]], ys: list[float],
                   intercept: bool) -> tuple[float, float, float]:
    # Scale the features so that the ridge term is the same size for each.
    scale = [max((abs(r[i]) for r in rows), default=1.0) or 1.0 for i in range(2)]
    feats = [(1.0 if intercept else 0.0, r[0] / scale[0], r[1] / scale[1]) for r in rows]
    m = [[sum(f[i] * f[j] for f in feats) + (1e-9 if i == j else 0.0) for j in range(3)] for i in range(3)]
    v = [sum(f[i] * y for f, y in zip(feats, ys, strict=True)) for i in range(3)]
    a, b, c = _solve3(m, v)
    return a, b / scale[0], c / scale[1]


def _solve3(m: list[list[float]], v: list[float]) -> tuple[float, float, float]:
    """Gaussian elimination with partial pivoting on a 3x3 system."""
    a = [row[:] + [v[i]] for i, row in enumerate(m)]
    for col in range(3):
        piv = max(range(col, 3), key=lambda r: abs(a[r][col]))
        a[col], a[piv] = a[piv], a[col]
        if abs(a[col][col]) < 1e-300:
            continue
        for r in range(3):
            if r != col:
                f = a[r][col] / a[col][col]
                a[r] = [x - f * y for x, y in zip(a[r], a[col], strict=True)]
    return tuple(a[i][3] / a[i][i] if abs(a[i][i]) > 1e-300 else 0.0 for i in range(3))  # type: ignore[return-value]
