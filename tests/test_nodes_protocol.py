"""The control-plane protocol: the checked-in generated modules match rpc/pdserve.proto, and the
message conversions the nodes use lose nothing."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

from pdserve.engine.sampling_params import SamplingParams
from pdserve.engine.sequence import TokenLogprob
from pdserve.node_common.convert import (
    logprob_from_proto,
    logprob_to_proto,
    params_from_proto,
    params_to_proto,
)
from pdserve.rpc import pdserve_pb2 as pb

REPO_ROOT = Path(__file__).resolve().parents[1]
GENERATED = ("pdserve_pb2.py", "pdserve_pb2.pyi", "pdserve_pb2_grpc.py")
# The generator's own version stamps: a newer grpcio-tools or protobuf writes a newer floor, not another protocol.
_STAMPS = re.compile(r"(GRPC_GENERATED_VERSION = '[^']*'|# Protobuf Python Version: \S+|"
                     r"Domain\.PUBLIC,\s*\d+,\s*\d+,\s*\d+,)")


def _protocol(text: str) -> str:
    return _STAMPS.sub("<version>", text)


def test_generated_modules_are_up_to_date(tmp_path: Path) -> None:
    (tmp_path / "rpc").mkdir()
    shutil.copy(REPO_ROOT / "rpc" / "pdserve.proto", tmp_path / "rpc")
    (tmp_path / "scripts").mkdir()
    shutil.copy(REPO_ROOT / "scripts" / "gen_protos.sh", tmp_path / "scripts")
    subprocess.run(
        ["bash", "scripts/gen_protos.sh"], cwd=tmp_path, check=True, env={"PYTHON": sys.executable, "PATH": "/usr/bin:/bin"}
    )
    for name in GENERATED:
        fresh = (tmp_path / "rpc" / name).read_text()
        committed = (REPO_ROOT / "rpc" / name).read_text()
        assert _protocol(fresh) == _protocol(committed), f"rpc/{name} is stale: run scripts/gen_protos.sh"


def test_sampling_params_and_logprobs_round_trip() -> None:
    cases = [
        SamplingParams(),
        SamplingParams(temperature=0.7, top_p=0.9, top_k=40, seed=0, presence_penalty=-0.5, frequency_penalty=1.5,
                       repetition_penalty=1.2, max_tokens=99, stop=["\n\n", "END"], stop_token_ids=[7, 9],
                       ignore_eos=True, logprobs=0),
        SamplingParams(seed=123456789012, logprobs=5),
    ]
    for sp in cases:
        assert params_from_proto(params_to_proto(sp)) == sp
    lp = TokenLogprob(17, -0.25, [(17, -0.25), (3, -1.5)])
    back = logprob_from_proto(logprob_to_proto(lp))
    assert (back.token_id, back.top) == (17, [(17, -0.25), (3, -1.5)]) and abs(back.logprob + 0.25) < 1e-6
    assert pb.PrefillResponse(transfer_done=pb.TransferDone(ok=True, skipped=True)).WhichOneof("event") == "transfer_done"
