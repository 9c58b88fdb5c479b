"""Embeddings (`/v1/embeddings`, served by the prefill pool).

Engine: `LLMEngine.embed` equals transformers' pooled last hidden state (AutoModel's last_hidden_state,
which is after the final norm, in float32) for the tiny llama model and the default model, for both
poolings, normalized or not, over a ragged batch; the engine's KV cache and scheduler are untouched.
Tolerance: max abs diff <= 1e-4 on normalized vectors (1e-4 times the largest norm unnormalized) and cosine
> 0.99999.

Cluster (`test_cluster_*`): the official openai SDK against a frontend over 1 prefill + 1 decode node.
"""

from __future__ import annotations

import base64
from pathlib import Path

import numpy as np
import pytest
import torch

from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine

pytest_plugins = ["tests.gguf_fixtures"]

PROMPTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hi",
    "Embeddings are pooled hidden states of the prompt; a longer prompt spans several KV blocks of sixteen "
    "tokens each, so the scratch cache has to place every prompt's blocks side by side.",
    "a b c d e f g h i j k l m n o p q",
]
MAX_ABS = 1e-4
MIN_COS = 0.99999


def reference(model_dir: Path, prompts: list[list[int]], pooling: str, normalize: bool) -> torch.Tensor:
    """transformers' pooled final hidden states (after the final norm), float32, one prompt at a time."""
    from transformers import AutoModel

    model = AutoModel.from_pretrained(str(model_dir), dtype=torch.float32)
    model.eval()
    out = []
    with torch.no_grad():
        for ids in prompts:
            h = model(torch.tensor([ids])).last_hidden_state[0].float()  # [T, H]
            v = h[-1] if pooling == "last" else h.mean(0)
            out.append(torch.nn.functional.normalize(v, dim=-1) if normalize else v)
    return torch.stack(out)


def check_close(got: torch.Tensor, want: torch.Tensor, normalized: bool) -> None:
    assert got.shape == want.shape and got.dtype == torch.float32
    scale = 1.0 if normalized else float(want.norm(dim=-1).max())
    assert float((got - want).abs().max()) <= MAX_ABS * scale
    cos = torch.nn.functional.cosine_similarity(got, want, dim=-1)
    assert float(cos.min()) > MIN_COS


def engine_for(model_dir: Path, **kw: object) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(model_dir), dtype="float32", num_kv_blocks=64, num_threads=1,
                                  block_size=16, **kw))  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def tiny_engine(tiny_llama_dir: Path) -> LLMEngine:
    return engine_for(tiny_llama_dir)


@pytest.mark.parametrize("pooling", ["last", "mean"])
@pytest.mark.parametrize("normalize", [True, False])
def test_engine_matches_transformers_tiny_llama(tiny_engine: LLMEngine, tiny_llama_dir: Path, pooling: str,
                                                normalize: bool) -> None:
    prompts = [tiny_engine.tokenizer.encode(p) for p in PROMPTS]
    assert len({len(p) for p in prompts}) == len(prompts)  # ragged
    before = tiny_engine.load()
    got = tiny_engine.embed_tensor(prompts, pooling, normalize)
    check_close(got, reference(tiny_llama_dir, prompts, pooling, normalize), normalize)
    assert tiny_engine.load() == before  # no block taken, nothing queued
    tiny_engine.check_integrity()
    # one at a time equals the batch (the scratch cache keeps prompts apart)
    single = torch.cat([tiny_engine.embed_tensor([p], pooling, normalize) for p in prompts])
    assert float((single - got).abs().max()) <= 1e-5
    if normalize:
        assert torch.allclose(got.norm(dim=-1), torch.ones(len(prompts)), atol=1e-5)


def test_engine_batches_by_token_budget(tiny_llama_dir: Path) -> None:
    """A budget smaller than the batch splits it (a prompt longer than the budget runs alone); same vectors."""
    small = engine_for(tiny_llama_dir, max_num_batched_tokens=16)
    prompts = [small.tokenizer.encode(p) for p in PROMPTS]
    assert max(len(p) for p in prompts) > 16
    got = torch.tensor(small.embed(prompts, "mean", True))
    check_close(got, reference(tiny_llama_dir, prompts, "mean", True), True)


def test_engine_embed_leaves_generation_alone(tiny_engine: LLMEngine) -> None:
    """An embedding between steps of a running generation changes none of its tokens."""
    from pdserve.engine.sampling_params import SamplingParams

    ids = tiny_engine.tokenizer.encode(PROMPTS[0])
    want = tiny_engine.generate([ids], SamplingParams(max_tokens=8, ignore_eos=True))[0].token_ids
    tiny_engine.add_request("gen", ids, SamplingParams(max_tokens=8, ignore_eos=True))
    tokens: list[int] = []
    while tiny_engine.has_unfinished():
        tiny_engine.embed([tiny_engine.tokenizer.encode(PROMPTS[2])])
        for out in tiny_engine.step():
            tokens += out.new_token_ids
    assert tokens == want
    assert tiny_engine.load().kv_blocks_used == 0
    tiny_engine.check_integrity()


def test_engine_refuses_bad_input(tiny_engine: LLMEngine) -> None:
    for bad in ([[]], [[10**7]], [[-1]], [[1] * (tiny_engine.max_model_len + 1)]):
        with pytest.raises(ValueError):
            tiny_engine.embed(bad)
    with pytest.raises(ValueError, match="pooling"):
        tiny_engine.embed([[1, 2]], pooling="cls")
    assert tiny_engine.embed([]) == []


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_engine_matches_transformers_default_model(smollm2_dir: Path, pooling: str) -> None:
    engine = engine_for(smollm2_dir)
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    for normalize in (True, False):
        got = engine.embed_tensor(prompts, pooling, normalize)
        check_close(got, reference(smollm2_dir, prompts, pooling, normalize), normalize)


def test_models_file_embedding_setting(tmp_path: Path) -> None:
    from pdserve.frontend.config import ConfigError, EmbeddingSettings, load_models_file

    def load(entry: str) -> EmbeddingSettings:
        path = tmp_path / "models.yaml"
        path.write_text(f"models:\n  - {{name: a, path: {tmp_path}, {entry}}}\n")
        return load_models_file(path)[0].embedding

    assert load("weight: 1") == EmbeddingSettings("last", True)  # the default: vLLM's for a generative model
    assert load("embedding: {pooling: mean, normalize: false}") == EmbeddingSettings("mean", False)
    for bad, message in (("embedding: {pooling: cls}", "embedding.pooling"), ("embedding: {poling: mean}", "poling"),
                         ("embedding: {normalize: 1}", "embedding.normalize"), ("embedding: 5", "mapping")):
        with pytest.raises(ConfigError, match=message):
            load(bad)


def test_split_inputs_balances_tokens() -> None:
    from pdserve.frontend.embeddings import split_inputs

    assert split_inputs([5], 3) == [range(0, 1)]
    assert split_inputs([1, 1, 1, 1], 2) == [range(0, 2), range(2, 4)]
    assert split_inputs([100, 1, 1, 1], 2) == [range(0, 1), range(1, 4)]
    assert split_inputs([1, 1, 1, 100], 3) == [range(0, 2), range(2, 3), range(3, 4)]
    for lengths in ([3, 1, 4, 1, 5, 9, 2, 6], [1] * 7, [50, 1]):
        for parts in (1, 2, 3, 5):
            out = split_inputs(lengths, parts)
            assert [i for r in out for i in r] == list(range(len(lengths))) and all(out)
            assert len(out) == min(parts, len(lengths))


def test_base64_is_little_endian_float32() -> None:
    """What the frontend's `encoding_format: base64` renders (numpy reads it back as OpenAI's SDK does)."""
    from pdserve.frontend.embeddings import encode_vector

    vec = [0.5, -1.25, 3.0e-8, 1.0]
    raw = np.asarray(vec, dtype="<f4").tobytes()
    assert encode_vector(raw, "base64") == base64.b64encode(raw).decode()
    assert encode_vector(raw, "float") == pytest.approx(vec)


# -- the cluster -----------------------------------------------------------------------------------------

CLUSTER_MODEL = "tiny-llama"
COLOCATED_MODEL = "tiny-colo"  # a pool of one colocated decode node (no prefill node)
KEYS = {"alpha": "sk-alpha-0123456789abcdef", "gamma": "sk-gamma-0123456789ab"}


@pytest.fixture(scope="module")
def cluster_env(tmp_path_factory: pytest.TempPathFactory, tiny_llama_dir: Path):  # type: ignore[no-untyped-def]
    import orjson

    from pdserve.frontend.tenants import hash_key
    from pdserve.registry.etcd_server import free_port
    from testing.cluster import LocalCluster
    from testing.procs import start_frontend

    tmp = tmp_path_factory.mktemp("embeddings-cluster")
    tenants = tmp / "tenants.yaml"
    tenants.write_bytes(orjson.dumps({"tenants": [
        {"name": "alpha", "keys_sha256": [hash_key(KEYS["alpha"])]},
        {"name": "gamma", "keys_sha256": [hash_key(KEYS["gamma"])], "models": ["another-model"]},
    ]}))
    models = tmp / "models.yaml"  # the colocated pool's model pools by mean, unnormalized (ModelSpec.embedding)
    models.write_bytes(orjson.dumps({"models": [
        {"name": CLUSTER_MODEL, "path": str(tiny_llama_dir)},
        {"name": COLOCATED_MODEL, "path": str(tiny_llama_dir), "embedding": {"pooling": "mean", "normalize": False}},
    ]}))
    node_args = ["--num-threads", "1", "--num-kv-blocks", "256", "--block-size", "16", "--model-name", CLUSTER_MODEL]
    with LocalCluster(tmp / "cluster", tiny_llama_dir, node_args=node_args) as cluster:
        cluster.start_etcd()
        nodes = [cluster.spawn_node("prefill", f"p{i}") for i in range(2)]
        nodes += [cluster.spawn_node("decode", "d0"),
                  cluster.spawn_node("decode", "c0", ["--colocated", "--model-name", COLOCATED_MODEL])]
        cluster.wait_ready(nodes)
        cluster.wait_registry(lambda m: {"p0", "p1", "d0", "c0"} <= m.keys(), timeout_s=30, what="every node")
        fe = start_frontend("frontend", tmp, cluster.etcd_endpoints, free_port(), "--cluster", cluster.cluster,
                            "--models", str(models), "--tenants", str(tenants), "--request-log",
                            str(tmp / "requests.jsonl"), "--log-level", "warning")
        try:
            yield cluster, fe
            cluster.wait_clean()  # every KV block on every node is free
        finally:
            assert fe.stop() == 0, fe.proc.tail()
            assert "Traceback" not in fe.proc.log_text(), fe.proc.tail(80)


def sdk(fe, tenant: str = "alpha"):  # type: ignore[no-untyped-def]
    import openai

    return openai.OpenAI(base_url=f"{fe.base_url}/v1", api_key=KEYS[tenant], max_retries=0, timeout=120)


def httpx_json(fe, body: dict) -> dict:  # type: ignore[no-untyped-def]
    import httpx

    r = httpx.post(f"{fe.base_url}/v1/embeddings", json=body, headers={"authorization": f"Bearer {KEYS['alpha']}"},
                   timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def counters(cluster, node: str) -> tuple[float, float]:  # type: ignore[no-untyped-def]
    return (cluster.metric(node, "pdserve_embedding_requests_total"), cluster.metric(node, "pdserve_embedding_inputs_total"))


def test_cluster_sdk_embeddings(cluster_env, tiny_engine: LLMEngine) -> None:  # type: ignore[no-untyped-def]
    cluster, fe = cluster_env
    client = sdk(fe)
    decode_before = {k: cluster.metric("d0", k) for k in (
        "pdserve_embedding_requests_total", "pdserve_prefix_cache_queries_total", "pdserve_decode_tokens_total")}
    prefill_before = {n: counters(cluster, n) for n in ("p0", "p1")}
    tok = tiny_engine.tokenizer
    want = tiny_engine.embed_tensor([tok.encode(p) for p in PROMPTS], "last", True)

    one = client.embeddings.create(model=CLUSTER_MODEL, input=PROMPTS[0])
    assert len(one.data) == 1 and one.data[0].index == 0 and one.model == CLUSTER_MODEL
    assert float((torch.tensor(one.data[0].embedding) - want[0]).abs().max()) <= 1e-5
    assert one.usage.prompt_tokens == one.usage.total_tokens == len(tok.encode(PROMPTS[0]))

    many = client.embeddings.create(model=CLUSTER_MODEL, input=PROMPTS, encoding_format="float")
    assert [d.index for d in many.data] == list(range(len(PROMPTS)))
    got = torch.tensor([d.embedding for d in many.data])
    assert float((got - want).abs().max()) <= 1e-5
    assert many.usage.prompt_tokens == sum(len(tok.encode(p)) for p in PROMPTS)

    ids = tok.encode(PROMPTS[2])
    by_ids = client.embeddings.create(model=CLUSTER_MODEL, input=ids)
    assert float((torch.tensor(by_ids.data[0].embedding) - want[2]).abs().max()) <= 1e-5
    lists = client.embeddings.create(model=CLUSTER_MODEL, input=[tok.encode(p) for p in PROMPTS[:2]])
    assert float((torch.tensor([d.embedding for d in lists.data]) - want[:2]).abs().max()) <= 1e-5

    # base64: little-endian float32 bytes, the same values exactly
    raw = client.with_raw_response.embeddings.create(model=CLUSTER_MODEL, input=PROMPTS, encoding_format="base64")
    body = raw.http_response.json()
    from testing.openapi import OpenAPISchemas

    # the official spec's response object (its schema knows floats only: the base64 form is the SDK's)
    OpenAPISchemas().validate("CreateEmbeddingResponse", httpx_json(fe, {"model": CLUSTER_MODEL, "input": PROMPTS}))
    for d, f in zip(body["data"], many.data, strict=True):
        assert np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4").tolist() == f.embedding
    # the SDK's own default asks for base64 and decodes it
    default = client.embeddings.create(model=CLUSTER_MODEL, input=PROMPTS[1])
    assert np.allclose(default.data[0].embedding, want[1].numpy(), atol=1e-5)

    # served by the prefill pool: a list is split over both prefill nodes; the decode node never moves
    after = {n: counters(cluster, n) for n in ("p0", "p1")}
    assert all(after[n][1] > prefill_before[n][1] for n in ("p0", "p1")), (prefill_before, after)
    for k, v in decode_before.items():
        assert cluster.metric("d0", k) == v, k
    assert cluster.get_load("d0").kv_blocks_used == 0


def test_cluster_colocated_pool(cluster_env, tiny_engine: LLMEngine) -> None:  # type: ignore[no-untyped-def]
    cluster, fe = cluster_env
    before = counters(cluster, "c0")
    resp = sdk(fe).embeddings.create(model=COLOCATED_MODEL, input=PROMPTS[:3], encoding_format="float")
    want = tiny_engine.embed_tensor([tiny_engine.tokenizer.encode(p) for p in PROMPTS[:3]], "mean", False)
    assert float((torch.tensor([d.embedding for d in resp.data]) - want).abs().max()) <= 1e-5 * float(want.abs().max())
    assert counters(cluster, "c0") == (before[0] + 1, before[1] + 3)


def test_cluster_bad_requests(cluster_env, tiny_engine: LLMEngine) -> None:  # type: ignore[no-untyped-def]
    import httpx
    import openai

    cluster, fe = cluster_env
    client = sdk(fe)
    vocab = tiny_engine.model_config.vocab_size
    cases = [
        ({"input": ""}, "input", None),
        ({"input": []}, "input", None),
        ({"input": ["ok", ""]}, "input[1]", None),
        ({"input": [[]]}, "input[0]", None),
        ({"input": [vocab + 5]}, "input[0]", None),
        ({"input": [1] * (tiny_engine.max_model_len + 1)}, "input", "context_length_exceeded"),
        ({"input": "hi", "dimensions": 8}, "dimensions", None),
        ({"input": "hi", "encoding_format": "int8"}, "encoding_format", None),
        ({"input": 5}, "input", "invalid_type"),
        ({}, "input", "missing_required_parameter"),
    ]
    for extra, param, code in cases:
        r = httpx.post(f"{fe.base_url}/v1/embeddings", json={"model": CLUSTER_MODEL, **extra},
                       headers={"authorization": f"Bearer {KEYS['alpha']}"}, timeout=60)
        assert r.status_code == 400, (extra, r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["param"] == param, (extra, err)
        if code is not None:
            assert err["code"] == code, (extra, err)
    with pytest.raises(openai.BadRequestError, match="does not support specifying dimensions"):
        client.embeddings.create(model=CLUSTER_MODEL, input="hi", dimensions=16)
    with pytest.raises(openai.PermissionDeniedError):
        sdk(fe, "gamma").embeddings.create(model=CLUSTER_MODEL, input="hi")
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model="no-such-model", input="hi")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{fe.base_url}/v1", api_key="sk-wrong-key", max_retries=0).embeddings.create(
            model=CLUSTER_MODEL, input="hi")
    # the frontend counts them per pool and tenant
    text = httpx.get(f"{fe.base_url}/metrics", timeout=10).text
    assert 'pdserve_frontend_embedding_requests_total{model="tiny-llama",model_pool="tiny-llama",node=' in text
    assert 'tenant="alpha"' in text


def test_cluster_decode_node_refuses_embed(cluster_env) -> None:  # type: ignore[no-untyped-def]
    """A decode node of a disaggregated pool leaves embeddings to the prefill pool; the call needs the token."""
    import grpc

    from pdserve.rpc import pdserve_pb2 as pb
    from pdserve.rpc import pdserve_pb2_grpc as pb_grpc

    cluster, _ = cluster_env
    request = pb.EmbedRequest(request_id="x", inputs=[pb.TokenIds(ids=[1, 2, 3])], pooling="last", normalize=True)
    with pytest.raises(grpc.RpcError) as err:
        cluster.decode_stub("d0").Embed(request, timeout=30)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    resp = cluster.prefill_stub("p0").Embed(request, timeout=30)
    assert len(resp.vectors) == 4 * resp.dimensions and list(resp.num_tokens) == [3]
    bare = grpc.insecure_channel(cluster.nodes["p0"].grpc_address)
    with pytest.raises(grpc.RpcError) as unauth:
        pb_grpc.PrefillNodeStub(bare).Embed(request, timeout=30)
    assert unauth.value.code() == grpc.StatusCode.UNAUTHENTICATED
    bare.close()


def test_cluster_retries_a_dead_prefill_node(cluster_env, tiny_engine: LLMEngine) -> None:  # type: ignore[no-untyped-def]
    """A prefill node killed while still in the registry: its part is served by the other one (last test:
    p1 stays dead)."""
    cluster, fe = cluster_env
    cluster.kill("p1")
    resp = sdk(fe).embeddings.create(model=CLUSTER_MODEL, input=PROMPTS, encoding_format="float")
    want = tiny_engine.embed_tensor([tiny_engine.tokenizer.encode(p) for p in PROMPTS], "last", True)
    assert float((torch.tensor([d.embedding for d in resp.data]) - want).abs().max()) <= 1e-5


@pytest.mark.timeout(300)
def test_bench_smoke(tiny_llama_dir: Path) -> None:
    """`bench/embeddings_bench.py --smoke` runs end to end in seconds, names the CPU ISA and both paths."""
    import subprocess
    import sys

    from testing.procs import REPO_ROOT

    run = subprocess.run([sys.executable, "bench/embeddings_bench.py", "--smoke"], cwd=REPO_ROOT, capture_output=True,
                         text=True, timeout=280)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    out = run.stdout
    assert "CPU ISA " in out and "inputs/s" in out and "tokens/s" in out, out
    assert "pdserve engine" in out and "transformers AutoModel" in out and "max abs diff" in out, out
