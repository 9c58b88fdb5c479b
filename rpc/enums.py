"""The proto's enums as the words the rest of the cluster speaks: a value's name, lower-case, without its
enum's prefix (`FINISH_REASON_HAND_OVER` is "hand_over"). The frontend's labels and the engine's
`FinishReason` are these words; converting here keeps the two sides from drifting."""

from __future__ import annotations

from pdserve.rpc import pdserve_pb2 as pb


def finish_reason_name(value: int) -> str | None:
    """"stop", "length", "abort", "error" or "hand_over"; None for FINISH_REASON_UNSPECIFIED (not finished)."""
    return None if value == pb.FINISH_REASON_UNSPECIFIED else pb.FinishReason.Name(value).removeprefix("FINISH_REASON_").lower()


def finish_reason_value(name: str | None) -> int:
    """The FinishReason of a word `finish_reason_name` gives (None: not finished). Raises ValueError."""
    return pb.FINISH_REASON_UNSPECIFIED if name is None else pb.FinishReason.Value(f"FINISH_REASON_{name.upper()}")


def serving_path_name(value: int) -> str | None:
    """"disaggregated", "local_prefill", "retried" or "migrated"; None for SERVING_PATH_UNSPECIFIED."""
    return None if value == pb.SERVING_PATH_UNSPECIFIED else pb.ServingPath.Name(value).removeprefix("SERVING_PATH_").lower()


# Every word, in the enum's order (metric label values, the request log's vocabulary).
FINISH_REASONS = tuple(n for v in pb.FinishReason.values() if (n := finish_reason_name(v)) is not None)
SERVING_PATHS = tuple(n for v in pb.ServingPath.values() if (n := serving_path_name(v)) is not None)
