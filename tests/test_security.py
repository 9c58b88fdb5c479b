"""Internal gRPC calls are authenticated and, when configured, encrypted (real etcd and node processes
on loopback): a call without the cluster token, or with a wrong one, is refused UNAUTHENTICATED before
any handler runs (Generate, GetLoad, NodeControl/Drain alike) while health stays open for probes; the
decode node's own calls to a prefill node carry the token; with TLS, a plaintext client cannot talk to
the nodes at all while a disaggregated request over TLS still returns the reference's greedy tokens."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.engine.config import EngineConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams
from pdserve.node_common.config import NodeConfig
from pdserve.rpc import TOKEN_ENV, RpcSecurity
from pdserve.rpc import pdserve_pb2 as pb
from pdserve.rpc import pdserve_pb2_grpc as pb_grpc
from testing.cluster import LocalCluster

pytestmark = pytest.mark.timeout(300)

NODE_ARGS = ["--num-threads", "1", "--num-kv-blocks", "256", "--block-size", "16", "--log-level", "DEBUG"]
DECODE_ARGS = ["--local-prefill-threshold", "8"]  # every test prompt is prefilled remotely
PROMPT = list(range(40, 100))
PARAMS = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def expected(model_dir: Path) -> list[int]:
    engine = LLMEngine(EngineConfig(model=str(model_dir), dtype="float32", num_kv_blocks=256, num_threads=1))
    return engine.generate([PROMPT], PARAMS)[0].token_ids


# -- configuration ----------------------------------------------------------------------------------


def test_settings_are_validated(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="at least 16"):
        RpcSecurity(token="short")
    with pytest.raises(ValueError, match="go together"):
        RpcSecurity(tls_cert=str(tmp_path / "cert.pem"))
    with pytest.raises(ValueError, match="does not exist"):
        RpcSecurity(tls_ca=str(tmp_path / "missing.pem"))
    token_file = tmp_path / "token"
    token_file.write_text("t" * 32 + "\n")
    assert RpcSecurity.from_env(str(token_file)).token == "t" * 32  # a mounted Secret's trailing newline


def test_a_node_serving_beyond_loopback_needs_a_token(model_dir: Path) -> None:
    engine = EngineConfig(model=str(model_dir))
    with pytest.raises(ValueError, match="beyond loopback, without a cluster token"):
        NodeConfig("n", "c", ("127.0.0.1:2379",), engine, grpc_host="0.0.0.0", rpc=RpcSecurity())
    NodeConfig("n", "c", ("127.0.0.1:2379",), engine, grpc_host="0.0.0.0", rpc=RpcSecurity(token="x" * 20))
    NodeConfig("n", "c", ("127.0.0.1:2379",), engine, grpc_host="0.0.0.0",
               rpc=RpcSecurity(allow_unauthenticated=True))
    NodeConfig("n", "c", ("127.0.0.1:2379",), engine, grpc_host="127.0.0.1", rpc=RpcSecurity())


# -- the cluster token ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[LocalCluster]:
    assert os.environ.get(TOKEN_ENV), "tests/conftest.py gives every test cluster a token"
    with LocalCluster(tmp_path_factory.mktemp("rpc-token"), model_dir, node_args=NODE_ARGS) as c:
        c.start(1, 1, decode_args=DECODE_ARGS)
        yield c
        c.wait_clean()


def _refused(call: grpc.RpcError) -> None:
    assert call.code() == grpc.StatusCode.UNAUTHENTICATED, call
    assert "cluster token" in (call.details() or "")


@pytest.mark.parametrize("token", ["", "wrong-token-of-enough-length"], ids=["missing", "wrong"])
def test_calls_without_the_token_are_refused(cluster: LocalCluster, token: str) -> None:
    for node_id, stub in (("d0", pb_grpc.DecodeNodeStub), ("p0", pb_grpc.PrefillNodeStub)):
        address = cluster.nodes[node_id].grpc_address
        with RpcSecurity(token=token).channel(address) if token else grpc.insecure_channel(address) as channel:
            with pytest.raises(grpc.RpcError) as err:
                stub(channel).GetLoad(pb.LoadRequest(), timeout=10)
            _refused(err.value)
            with pytest.raises(grpc.RpcError) as err:  # a method the node does not have: refused all the same
                (pb_grpc.PrefillNodeStub if stub is pb_grpc.DecodeNodeStub else pb_grpc.DecodeNodeStub)(
                    channel).GetLoad(pb.LoadRequest(), timeout=10)
            _refused(err.value)
            # Nobody without the token can drain a node (the call never reaches the drainer).
            with pytest.raises(grpc.RpcError) as err:
                pb_grpc.NodeControlStub(channel).Drain(pb.DrainRequest(), timeout=10)
            _refused(err.value)
            # Health stays open: probes carry no token.
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
            assert health.status == health_pb2.HealthCheckResponse.SERVING
    address = cluster.nodes["d0"].grpc_address
    with grpc.insecure_channel(address) as channel:
        request = pb.GenerateRequest(prompt_token_ids=PROMPT, params=pb.SamplingParams(max_tokens=4))
        with pytest.raises(grpc.RpcError) as err:
            list(pb_grpc.DecodeNodeStub(channel).Generate(request, timeout=10))
        _refused(err.value)
    assert cluster.get_load("d0").in_flight == 0 and not cluster.get_load("d0").draining


def test_authenticated_calls_reach_the_prefill_node(cluster: LocalCluster, expected: list[int]) -> None:
    """The decode node's Prefill call carries the token too: the request is prefilled remotely."""
    res = cluster.generate("d0", PROMPT, PARAMS)
    assert res.finish_reason == "length" and res.token_ids == expected
    assert res.prefill_node_id == "p0"


# -- TLS --------------------------------------------------------------------------------------------


def _self_signed(directory: Path) -> tuple[str, str]:
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=pdserve-test",
         "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )
    return str(cert), str(key)


def test_tls_between_every_process(tmp_path: Path, model_dir: Path, expected: list[int]) -> None:
    cert, key = _self_signed(tmp_path)
    tls = ["--grpc-tls-cert", cert, "--grpc-tls-key", key, "--grpc-tls-ca", cert]
    client = RpcSecurity.from_env(tls_ca=cert)
    with LocalCluster(tmp_path / "cluster", model_dir, node_args=[*NODE_ARGS, *tls], rpc=client) as c:
        c.start(1, 1, decode_args=DECODE_ARGS)
        res = c.generate("d0", PROMPT, PARAMS)  # frontend-side call and decode -> prefill, both over TLS
        assert res.finish_reason == "length" and res.token_ids == expected and res.prefill_node_id == "p0"
        with grpc.insecure_channel(c.nodes["d0"].grpc_address) as plain:
            with pytest.raises(grpc.RpcError) as err:
                pb_grpc.DecodeNodeStub(plain).GetLoad(pb.LoadRequest(), timeout=5)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE  # no TLS handshake, no call
        c.wait_clean()


# -- what the logs hold -----------------------------------------------------------------------------


def test_no_prompt_text_in_any_log_unless_enabled(cluster: LocalCluster, tmp_path: Path) -> None:
    """A request whose prompt holds a marker, served with debug logging on every process: the marker is
    in no log (frontend, its request log, both nodes) unless the frontend was told --log-prompts."""
    import openai

    from pdserve.registry.etcd_server import free_port
    from testing.procs import start_frontend

    marker = "zebra-quartz-7731"
    name = Path(cluster.model_dir).name
    for log_prompts in (False, True):
        request_log = tmp_path / f"requests-{log_prompts}.jsonl"
        fe = start_frontend(f"frontend-{log_prompts}", tmp_path, cluster.etcd_endpoints, free_port(),
                            "--cluster", cluster.cluster, "--model", f"{name}={cluster.model_dir}",
                            "--request-log", str(request_log), "--log-level", "debug",
                            *(["--log-prompts"] if log_prompts else []))
        try:
            client = openai.OpenAI(base_url=f"{fe.base_url}/v1", api_key="k", max_retries=0)
            out = client.chat.completions.create(
                model=name, messages=[{"role": "user", "content": f"Say {marker} twice."}], max_tokens=4)
            assert out.choices[0].finish_reason in ("length", "stop")
        finally:
            fe.stop()
        logs = {"frontend": fe.proc.log_text(), "request log": request_log.read_text()}
        logs |= {node_id: node.log_path.read_text(errors="replace") for node_id, node in cluster.nodes.items()}
        holding = sorted(where for where, text in logs.items() if marker in text)
        assert holding == (["request log"] if log_prompts else []), holding
