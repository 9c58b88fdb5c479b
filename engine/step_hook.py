"""A hook into the step that completes a sequence's prefill, so the engine's owner can act on each
layer's K/V as soon as it is in the KV cache (the prefill node ships it layer by layer) instead of after
the whole forward. The engine knows nothing of what the owner does with it.

Order within one `LLMEngine.step` (all on the engine thread):
  1. the scheduler decides the step (block tables of every scheduled sequence are final from here on);
  2. if some prefill chunk in it reaches its sequence's last token, the owner's `PrefillWatcher` is
     called with those sequences and may return a `LayerHook` for this step;
  3. the forward calls `hook.layer_done(l)` after layer l of the step was issued: from then on layer
     l's K/V of every token of the step are in the KV cache (earlier chunks were computed in earlier steps);
  4. `hook.step_done(ok)` follows the forward, also when it raised (ok False; the step's outputs are
     then lost and the owner must treat the layers as garbage).

On CPU the forward is synchronous, so "issued" means "computed". On CUDA it means "enqueued on the
engine thread's current stream": a consumer on another thread or stream must record a CUDA event in
`layer_done` (it runs on that thread, with that stream current) and wait for it, never read the KV cache
directly. Hook methods must be quick and must not call into the engine or raise (an exception fails
the step, which aborts every request). Cost when no watcher is set: one attribute test per step and
one `is None` test per layer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from pdserve.engine.sequence import Sequence


class LayerHook(Protocol):
    def layer_done(self, layer: int) -> None:
        """Layer `layer`'s K/V of this step were written (issued, on CUDA) into the KV cache."""

    def step_done(self, ok: bool) -> None:
        """The step's forward is over: every layer was computed (ok), or it raised (not ok)."""


# Called (engine thread) before the forward of a step in which the given sequences' prefill completes
# (their last prompt chunk is computed and their next token sampled). The sequences are the engine's
# own: read them (seq_id, block_table), change nothing. Returns the step's hook, or None.
PrefillWatcher = Callable[[list[Sequence]], LayerHook | None]
