"""A minimal command-line client: `python -m decode_node.client --target HOST:PORT ...`.

Prints one JSON object: a Generate result (token ids, text, finish reason, who prefilled, time to first
token) or, with --load, a node's GetLoad answer. Meant for smoke checks and for tests that must talk
to nodes from inside another network namespace.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from google.protobuf.json_format import MessageToDict

from pdserve.engine.sampling_params import SamplingParams
from pdserve.node_common.convert import params_to_proto
from pdserve.rpc import add_rpc_args, rpc_security_from_args
from pdserve.rpc import pdserve_pb2 as pb
from pdserve.rpc import pdserve_pb2_grpc as pb_grpc
from pdserve.rpc.enums import finish_reason_name


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pdserve.decode_node.client")
    parser.add_argument("--target", required=True, help="host:port of a decode node (or any node with --load)")
    parser.add_argument("--load", choices=("decode", "prefill"), help="print GetLoad of a node of this role")
    parser.add_argument("--prompt-ids", default="", help="comma-separated prompt token ids")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--prefill-node-id", default="")
    parser.add_argument("--force-local-prefill", action="store_true")
    parser.add_argument("--timeout", type=float, default=120.0)
    add_rpc_args(parser, server=False)
    args = parser.parse_args(argv)
    with rpc_security_from_args(args).channel(args.target) as channel:
        if args.load:
            stub = pb_grpc.DecodeNodeStub(channel) if args.load == "decode" else pb_grpc.PrefillNodeStub(channel)
            load = stub.GetLoad(pb.LoadRequest(), timeout=args.timeout)
            print(json.dumps(MessageToDict(load, always_print_fields_with_no_presence=True)))
            return 0
        params = SamplingParams(
            max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed, ignore_eos=args.ignore_eos
        )
        request = pb.GenerateRequest(
            prompt_token_ids=[int(t) for t in args.prompt_ids.split(",") if t.strip()],
            params=params_to_proto(params), prefill_node_id=args.prefill_node_id,
            force_local_prefill=args.force_local_prefill, return_text=True,
        )
        start = time.monotonic()
        ttft = 0.0
        messages = []
        for msg in pb_grpc.DecodeNodeStub(channel).Generate(request, timeout=args.timeout):
            if not ttft and msg.token_ids:
                ttft = time.monotonic() - start
            messages.append(msg)
    last = messages[-1]
    print(json.dumps({
        "request_id": last.request_id,
        "token_ids": [t for m in messages for t in m.token_ids],
        "text": "".join(m.text for m in messages),
        "finish_reason": finish_reason_name(last.finish_reason),
        "error": last.error,
        "prefill_node_id": messages[0].prefill_node_id,
        "decode_node_id": messages[0].decode_node_id,
        "ttft_s": ttft,
        "total_s": time.monotonic() - start,
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
