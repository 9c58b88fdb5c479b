from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]
    FINISH_REASON_ERROR: _ClassVar[FinishReason]
    FINISH_REASON_HAND_OVER: _ClassVar[FinishReason]

class ServingPath(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SERVING_PATH_UNSPECIFIED: _ClassVar[ServingPath]
    SERVING_PATH_DISAGGREGATED: _ClassVar[ServingPath]
    SERVING_PATH_LOCAL_PREFILL: _ClassVar[ServingPath]
    SERVING_PATH_RETRIED: _ClassVar[ServingPath]
    SERVING_PATH_MIGRATED: _ClassVar[ServingPath]

class KVTierKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_TIER_POOL: _ClassVar[KVTierKind]
    KV_TIER_DISK: _ClassVar[KVTierKind]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason
FINISH_REASON_ERROR: FinishReason
FINISH_REASON_HAND_OVER: FinishReason
SERVING_PATH_UNSPECIFIED: ServingPath
SERVING_PATH_DISAGGREGATED: ServingPath
SERVING_PATH_LOCAL_PREFILL: ServingPath
SERVING_PATH_RETRIED: ServingPath
SERVING_PATH_MIGRATED: ServingPath
KV_TIER_POOL: KVTierKind
KV_TIER_DISK: KVTierKind

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "seed", "presence_penalty", "frequency_penalty", "repetition_penalty", "max_tokens", "stop", "stop_token_ids", "ignore_eos", "logprobs", "logit_bias", "structured", "priority", "speculative")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    seed: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    max_tokens: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    logprobs: int
    logit_bias: _containers.ScalarMap[int, float]
    structured: StructuredOutput
    priority: int
    speculative: str
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., max_tokens: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[int] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., structured: _Optional[_Union[StructuredOutput, _Mapping]] = ..., priority: _Optional[int] = ..., speculative: _Optional[str] = ...) -> None: ...

class StructuredOutput(_message.Message):
    __slots__ = ("kind", "schema_json")
    KIND_FIELD_NUMBER: _ClassVar[int]
    SCHEMA_JSON_FIELD_NUMBER: _ClassVar[int]
    kind: str
    schema_json: str
    def __init__(self, kind: _Optional[str] = ..., schema_json: _Optional[str] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "top_token_ids", "top_logprobs")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class Timing(_message.Message):
    __slots__ = ("prefill_queue_s", "prefill_s", "transfer_s", "first_decode_step_s", "reservation_wait_s")
    PREFILL_QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_S_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_S_FIELD_NUMBER: _ClassVar[int]
    FIRST_DECODE_STEP_S_FIELD_NUMBER: _ClassVar[int]
    RESERVATION_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    prefill_queue_s: float
    prefill_s: float
    transfer_s: float
    first_decode_step_s: float
    reservation_wait_s: float
    def __init__(self, prefill_queue_s: _Optional[float] = ..., prefill_s: _Optional[float] = ..., transfer_s: _Optional[float] = ..., first_decode_step_s: _Optional[float] = ..., reservation_wait_s: _Optional[float] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "attempt", "prompt_token_ids", "params", "prefill_node_id", "force_local_prefill", "return_text", "resume_token_ids", "resume_text_chars")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_NODE_ID_FIELD_NUMBER: _ClassVar[int]
    FORCE_LOCAL_PREFILL_FIELD_NUMBER: _ClassVar[int]
    RETURN_TEXT_FIELD_NUMBER: _ClassVar[int]
    RESUME_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    RESUME_TEXT_CHARS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    attempt: int
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    params: SamplingParams
    prefill_node_id: str
    force_local_prefill: bool
    return_text: bool
    resume_token_ids: _containers.RepeatedScalarFieldContainer[int]
    resume_text_chars: int
    def __init__(self, request_id: _Optional[str] = ..., attempt: _Optional[int] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[SamplingParams, _Mapping]] = ..., prefill_node_id: _Optional[str] = ..., force_local_prefill: _Optional[bool] = ..., return_text: _Optional[bool] = ..., resume_token_ids: _Optional[_Iterable[int]] = ..., resume_text_chars: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "token_ids", "text", "logprobs", "finished", "finish_reason", "stop_reason", "num_prompt_tokens", "num_cached_tokens", "num_completion_tokens", "timing", "prefill_node_id", "decode_node_id", "error", "num_cached_tokens_decode", "num_cached_tokens_prefill", "serving_path")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_REASON_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    PREFILL_NODE_ID_FIELD_NUMBER: _ClassVar[int]
    DECODE_NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_DECODE_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_PREFILL_FIELD_NUMBER: _ClassVar[int]
    SERVING_PATH_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    finished: bool
    finish_reason: FinishReason
    stop_reason: str
    num_prompt_tokens: int
    num_cached_tokens: int
    num_completion_tokens: int
    timing: Timing
    prefill_node_id: str
    decode_node_id: str
    error: str
    num_cached_tokens_decode: int
    num_cached_tokens_prefill: int
    serving_path: ServingPath
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ..., finished: _Optional[bool] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., stop_reason: _Optional[str] = ..., num_prompt_tokens: _Optional[int] = ..., num_cached_tokens: _Optional[int] = ..., num_completion_tokens: _Optional[int] = ..., timing: _Optional[_Union[Timing, _Mapping]] = ..., prefill_node_id: _Optional[str] = ..., decode_node_id: _Optional[str] = ..., error: _Optional[str] = ..., num_cached_tokens_decode: _Optional[int] = ..., num_cached_tokens_prefill: _Optional[int] = ..., serving_path: _Optional[_Union[ServingPath, str]] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id", "attempt")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    attempt: int
    def __init__(self, request_id: _Optional[str] = ..., attempt: _Optional[int] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("request_id", "attempt", "prompt_token_ids", "params", "decode_node_id", "num_skip_blocks", "dst_block_ids", "block_size", "kv_dtype", "layout_version", "model_fingerprint", "num_prompt_tokens")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ATTEMPT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    DECODE_NODE_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_SKIP_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    DST_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    KV_DTYPE_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_VERSION_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    attempt: int
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    params: SamplingParams
    decode_node_id: str
    num_skip_blocks: int
    dst_block_ids: _containers.RepeatedScalarFieldContainer[int]
    block_size: int
    kv_dtype: str
    layout_version: int
    model_fingerprint: str
    num_prompt_tokens: int
    def __init__(self, request_id: _Optional[str] = ..., attempt: _Optional[int] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., params: _Optional[_Union[SamplingParams, _Mapping]] = ..., decode_node_id: _Optional[str] = ..., num_skip_blocks: _Optional[int] = ..., dst_block_ids: _Optional[_Iterable[int]] = ..., block_size: _Optional[int] = ..., kv_dtype: _Optional[str] = ..., layout_version: _Optional[int] = ..., model_fingerprint: _Optional[str] = ..., num_prompt_tokens: _Optional[int] = ...) -> None: ...

class FirstToken(_message.Message):
    __slots__ = ("token_id", "logprob", "num_cached_tokens", "queue_s", "prefill_s")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    PREFILL_S_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: TokenLogprob
    num_cached_tokens: int
    queue_s: float
    prefill_s: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[_Union[TokenLogprob, _Mapping]] = ..., num_cached_tokens: _Optional[int] = ..., queue_s: _Optional[float] = ..., prefill_s: _Optional[float] = ...) -> None: ...

class TransferStart(_message.Message):
    __slots__ = ("channel_epoch", "seq_no", "num_blocks", "num_tokens", "layout_version", "dtype", "geometry", "layers_per_message", "prefill_kv_address")
    CHANNEL_EPOCH_FIELD_NUMBER: _ClassVar[int]
    SEQ_NO_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_VERSION_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    GEOMETRY_FIELD_NUMBER: _ClassVar[int]
    LAYERS_PER_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_KV_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    channel_epoch: int
    seq_no: int
    num_blocks: int
    num_tokens: int
    layout_version: int
    dtype: str
    geometry: _containers.RepeatedScalarFieldContainer[int]
    layers_per_message: int
    prefill_kv_address: str
    def __init__(self, channel_epoch: _Optional[int] = ..., seq_no: _Optional[int] = ..., num_blocks: _Optional[int] = ..., num_tokens: _Optional[int] = ..., layout_version: _Optional[int] = ..., dtype: _Optional[str] = ..., geometry: _Optional[_Iterable[int]] = ..., layers_per_message: _Optional[int] = ..., prefill_kv_address: _Optional[str] = ...) -> None: ...

class TransferDone(_message.Message):
    __slots__ = ("ok", "error", "transfer_s", "skipped", "kv_checksum", "kv_checksum_algo")
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_S_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_FIELD_NUMBER: _ClassVar[int]
    KV_CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    KV_CHECKSUM_ALGO_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    error: str
    transfer_s: float
    skipped: bool
    kv_checksum: int
    kv_checksum_algo: str
    def __init__(self, ok: _Optional[bool] = ..., error: _Optional[str] = ..., transfer_s: _Optional[float] = ..., skipped: _Optional[bool] = ..., kv_checksum: _Optional[int] = ..., kv_checksum_algo: _Optional[str] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("first_token", "transfer_start", "transfer_done")
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_START_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_DONE_FIELD_NUMBER: _ClassVar[int]
    first_token: FirstToken
    transfer_start: TransferStart
    transfer_done: TransferDone
    def __init__(self, first_token: _Optional[_Union[FirstToken, _Mapping]] = ..., transfer_start: _Optional[_Union[TransferStart, _Mapping]] = ..., transfer_done: _Optional[_Union[TransferDone, _Mapping]] = ...) -> None: ...

class EmbedRequest(_message.Message):
    __slots__ = ("request_id", "inputs", "pooling", "normalize", "dimensions")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    INPUTS_FIELD_NUMBER: _ClassVar[int]
    POOLING_FIELD_NUMBER: _ClassVar[int]
    NORMALIZE_FIELD_NUMBER: _ClassVar[int]
    DIMENSIONS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    inputs: _containers.RepeatedCompositeFieldContainer[TokenIds]
    pooling: str
    normalize: bool
    dimensions: int
    def __init__(self, request_id: _Optional[str] = ..., inputs: _Optional[_Iterable[_Union[TokenIds, _Mapping]]] = ..., pooling: _Optional[str] = ..., normalize: _Optional[bool] = ..., dimensions: _Optional[int] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class EmbedResponse(_message.Message):
    __slots__ = ("vectors", "dimensions", "num_tokens", "node_id")
    VECTORS_FIELD_NUMBER: _ClassVar[int]
    DIMENSIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    vectors: bytes
    dimensions: int
    num_tokens: _containers.RepeatedScalarFieldContainer[int]
    node_id: str
    def __init__(self, vectors: _Optional[bytes] = ..., dimensions: _Optional[int] = ..., num_tokens: _Optional[_Iterable[int]] = ..., node_id: _Optional[str] = ...) -> None: ...

class LoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LoadResponse(_message.Message):
    __slots__ = ("node_id", "role", "waiting", "running", "kv_blocks_total", "kv_blocks_used", "kv_blocks_free", "kv_blocks_cached", "kv_blocks_held_for_transfer", "tokens_per_s", "kv_blocks_reserved", "reservation_queue", "in_flight", "draining", "members")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_FREE_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_CACHED_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_HELD_FOR_TRANSFER_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_S_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_RESERVED_FIELD_NUMBER: _ClassVar[int]
    RESERVATION_QUEUE_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    role: str
    waiting: int
    running: int
    kv_blocks_total: int
    kv_blocks_used: int
    kv_blocks_free: int
    kv_blocks_cached: int
    kv_blocks_held_for_transfer: int
    tokens_per_s: float
    kv_blocks_reserved: int
    reservation_queue: int
    in_flight: int
    draining: bool
    members: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, node_id: _Optional[str] = ..., role: _Optional[str] = ..., waiting: _Optional[int] = ..., running: _Optional[int] = ..., kv_blocks_total: _Optional[int] = ..., kv_blocks_used: _Optional[int] = ..., kv_blocks_free: _Optional[int] = ..., kv_blocks_cached: _Optional[int] = ..., kv_blocks_held_for_transfer: _Optional[int] = ..., tokens_per_s: _Optional[float] = ..., kv_blocks_reserved: _Optional[int] = ..., reservation_queue: _Optional[int] = ..., in_flight: _Optional[int] = ..., draining: _Optional[bool] = ..., members: _Optional[_Iterable[str]] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class IntegrityRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class IntegrityReport(_message.Message):
    __slots__ = ("ok", "problem")
    OK_FIELD_NUMBER: _ClassVar[int]
    PROBLEM_FIELD_NUMBER: _ClassVar[int]
    ok: bool
    problem: str
    def __init__(self, ok: _Optional[bool] = ..., problem: _Optional[str] = ...) -> None: ...

class KVEventsRequest(_message.Message):
    __slots__ = ("epoch", "after_seq")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    AFTER_SEQ_FIELD_NUMBER: _ClassVar[int]
    epoch: str
    after_seq: int
    def __init__(self, epoch: _Optional[str] = ..., after_seq: _Optional[int] = ...) -> None: ...

class KVEvent(_message.Message):
    __slots__ = ("stored", "tier", "block_hashes")
    STORED_FIELD_NUMBER: _ClassVar[int]
    TIER_FIELD_NUMBER: _ClassVar[int]
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    stored: bool
    tier: KVTierKind
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, stored: _Optional[bool] = ..., tier: _Optional[_Union[KVTierKind, str]] = ..., block_hashes: _Optional[_Iterable[bytes]] = ...) -> None: ...

class KVEventBatch(_message.Message):
    __slots__ = ("epoch", "seq", "snapshot", "events")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    epoch: str
    seq: int
    snapshot: bool
    events: _containers.RepeatedCompositeFieldContainer[KVEvent]
    def __init__(self, epoch: _Optional[str] = ..., seq: _Optional[int] = ..., snapshot: _Optional[bool] = ..., events: _Optional[_Iterable[_Union[KVEvent, _Mapping]]] = ...) -> None: ...
