"""The `pdserve` command line."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path


def _cmd_generate(args: argparse.Namespace) -> int:
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams
    from engine.tiny import default_model_dir

    model = args.model or str(default_model_dir())
    t0 = time.perf_counter()
    engine = LLMEngine(EngineConfig(model=model, dtype=args.dtype, kv_cache_memory_bytes=args.kv_memory_mib << 20))
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
        f"[pdserve] model={model} load={t_load:.2f}s prompt_tokens={seq.num_prompt_tokens} "
        f"completion_tokens={n} ttft={1000 * (ttft or 0):.1f}ms total={elapsed:.2f}s "
        f"tok/s={n / max(elapsed, 1e-9):.1f} finish_reason={final.finish_reason if final else None}",
        file=sys.stderr,
    )
    return 0


def _cmd_make_tiny(args: argparse.Namespace) -> int:
    from engine.tiny import make_tiny_model

    out = make_tiny_model(Path(args.dir), arch=args.arch, seed=args.seed)
    print(out)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve", description="Disaggregated prefill/decode LLM serving")
    p.add_argument("--log-level", default="WARNING")
    sub = p.add_subparsers(dest="cmd", required=True)

    g = sub.add_parser("generate", help="offline generation with the embedded engine")
    g.add_argument("--prompt", required=True)
    g.add_argument("--model", default=None, help="HF model directory (default: the embedded tiny model)")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--chat", action="store_true", help="wrap the prompt as one user message (chat template)")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--kv-memory-mib", type=int, default=512)
    g.set_defaults(fn=_cmd_generate)

    for name, (_, help_text) in _SERVERS.items():
        sub.add_parser(name, help=f"{help_text} (flags: pdserve {name} --help)", add_help=False)

    m = sub.add_parser("model", help="model utilities")
    msub = m.add_subparsers(dest="model_cmd", required=True)
    mt = msub.add_parser("make-tiny", help="write a deterministic tiny HF model directory")
    mt.add_argument("dir")
    mt.add_argument("--arch", default="llama", choices=["llama", "qwen2", "qwen3"])
    mt.add_argument("--seed", type=int, default=0)
    mt.set_defaults(fn=_cmd_make_tiny)
    return p


# Server processes own their flags; `pdserve ROLE ...` hands the rest of the command line to them.
_SERVERS = {
    "prefill": ("prefill_node.server", "run a prefill node"),
    "decode": ("decode_node.server", "run a decode node"),
    "frontend": ("frontend.server", "run the OpenAI-compatible frontend"),
}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in _SERVERS:
        import importlib

        module = importlib.import_module(_SERVERS[argv[0]][0])
        raise SystemExit(module.main(argv[1:]))
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        rc = args.fn(args)
    except (ValueError, OSError) as e:
        print(f"pdserve: error: {e}", file=sys.stderr)
        rc = 2
    raise SystemExit(rc)
