"""The one place node messages are mapped between the control-plane protocol and Python: sampling
parameters, logprobs, transfer announcements (`TransferMeta`) and load records (`NodeLoad`). Pure
functions; nothing here changes state.
"""

from __future__ import annotations

from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.sequence import TokenLogprob
from pdserve.engine.structured_spec import StructuredSpec
from pdserve.kv_transfer import TransferMeta
from pdserve.registry import NodeLoad
from pdserve.rpc import pdserve_pb2 as pb


def params_from_proto(p: pb.SamplingParams) -> SamplingParams:
    """Raises ValueError for out-of-range values (SamplingParams and StructuredSpec validate; whether
    the grammar compiles is the engine's check, when the request is added)."""
    return SamplingParams(
        temperature=p.temperature,
        top_p=p.top_p if p.top_p > 0 else 1.0,
        top_k=p.top_k if p.top_k > 0 else -1,
        seed=p.seed if p.HasField("seed") else None,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        repetition_penalty=p.repetition_penalty if p.repetition_penalty > 0 else 1.0,
        max_tokens=p.max_tokens if p.max_tokens > 0 else 16,
        stop=list(p.stop),
        stop_token_ids=list(p.stop_token_ids),
        ignore_eos=p.ignore_eos,
        logprobs=p.logprobs if p.HasField("logprobs") else None,
        logit_bias=dict(p.logit_bias),
        priority=p.priority,
        speculative=p.speculative,
        structured=StructuredSpec(p.structured.kind, p.structured.schema_json)  # type: ignore[arg-type]
        if p.HasField("structured") else None,
    )


def params_to_proto(sp: SamplingParams) -> pb.SamplingParams:
    msg = pb.SamplingParams(
        temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k if sp.top_k > 0 else 0,
        presence_penalty=sp.presence_penalty, frequency_penalty=sp.frequency_penalty,
        repetition_penalty=sp.repetition_penalty, max_tokens=sp.max_tokens, stop=sp.stop,
        stop_token_ids=sp.stop_token_ids, ignore_eos=sp.ignore_eos, priority=sp.priority,
        speculative=sp.speculative,
    )
    if sp.seed is not None:
        msg.seed = sp.seed
    if sp.logprobs is not None:
        msg.logprobs = sp.logprobs
    msg.logit_bias.update(sp.logit_bias)
    if sp.structured is not None:
        msg.structured.CopyFrom(structured_to_proto(sp.structured))
    return msg


def structured_to_proto(spec: StructuredSpec) -> pb.StructuredOutput:
    return pb.StructuredOutput(kind=spec.kind, schema_json=spec.schema_json)


def logprob_to_proto(lp: TokenLogprob) -> pb.TokenLogprob:
    return pb.TokenLogprob(
        token_id=lp.token_id, logprob=lp.logprob,
        top_token_ids=[t for t, _ in lp.top], top_logprobs=[v for _, v in lp.top],
    )


def logprob_from_proto(p: pb.TokenLogprob) -> TokenLogprob:
    return TokenLogprob(p.token_id, p.logprob, list(zip(p.top_token_ids, p.top_logprobs, strict=True)))


def transfer_start_to_proto(meta: TransferMeta, prefill_kv_address: str) -> pb.TransferStart:
    """The announcement of a queued send (every `TransferMeta` field but the three ids, which are the
    Prefill stream's own)."""
    return pb.TransferStart(
        channel_epoch=meta.epoch, seq_no=meta.seq_no, num_blocks=meta.num_blocks, num_tokens=meta.num_tokens,
        layout_version=meta.layout_version, dtype=meta.dtype, geometry=list(meta.geometry),
        layers_per_message=meta.layers_per_message, prefill_kv_address=prefill_kv_address,
    )


def transfer_meta_from_proto(ts: pb.TransferStart, request_id: str, prefill_id: str, decode_id: str) -> TransferMeta:
    """The `TransferMeta` a receiver posts for an announced send."""
    geometry = tuple(ts.geometry)
    if len(geometry) != 4:
        raise ValueError(f"transfer geometry must have 4 entries, got {list(geometry)}")
    return TransferMeta(
        request_id=request_id, prefill_id=prefill_id, decode_id=decode_id, epoch=ts.channel_epoch,
        seq_no=ts.seq_no, num_blocks=ts.num_blocks, num_tokens=ts.num_tokens, layout_version=ts.layout_version,
        dtype=ts.dtype, geometry=(geometry[0], geometry[1], geometry[2], geometry[3]),
        layers_per_message=ts.layers_per_message,
    )


def load_to_proto(node_id: str, role: str, load: NodeLoad) -> pb.LoadResponse:
    """A node's load record as GetLoad and Drain answer it."""
    return pb.LoadResponse(
        node_id=node_id, role=role, waiting=load.waiting, running=load.running,
        kv_blocks_total=load.kv_blocks_total, kv_blocks_used=load.kv_blocks_used,
        kv_blocks_free=load.kv_blocks_free, kv_blocks_cached=load.kv_blocks_cached,
        kv_blocks_held_for_transfer=load.kv_blocks_held, tokens_per_s=load.tokens_per_s,
        kv_blocks_reserved=load.kv_blocks_reserved, reservation_queue=load.reservation_queue,
        in_flight=load.in_flight, draining=load.draining,
    )


def call_key(request_id: str, attempt: int) -> str:
    """What a node knows one attempt of a request by (its tables, its engine, its KV transfers): the
    request's id, and from the second attempt on the attempt after a '#'. A node can meet a request again
    (a retry or a migration that lands where an earlier attempt is still ending); keyed this way the two
    never meet, while the request keeps one id on the wire, in logs' `request` fields and in traces."""
    return request_id if attempt == 0 else f"{request_id}#{attempt}"
