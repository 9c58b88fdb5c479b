"""Degradation policies through a real cluster (etcd, one colocated decode node running the tiny llama, the
frontend process with a models file, the openai SDK): each policy where it applies and where it does not,
what the client sees (the `x-pdserve-degraded` header on whole and streamed responses, fewer output tokens,
a trimmed prompt's usage, a short prompt done before a long one queued in the long-prompt lane), the
request log line and `pdserve_frontend_degradations_total`; then a changed models file puts a new policy in
force without a restart, and one that cannot be used keeps the old one.

Pressure for cap_max_tokens is a queue threshold of 0, which an idle pool reaches: it applies every time."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.frontend.config import ModelSpec
from pdserve.frontend.models import ModelCatalog
from pdserve.registry.etcd_server import free_port
from testing.cluster import LocalCluster
from testing.procs import FrontendProc, start_frontend
from testing.waits import wait_until

pytestmark = pytest.mark.timeout(300)

POOL = "tiny"
TRIM_CONTEXT = 160
LONG_ABOVE = 200  # tiny-lane's long prompts: over this many tokens
HEADER = "x-pdserve-degraded"
WORDS = "amber basin cedar delta ember fjord glade harbor inlet juniper kestrel lagoon meadow".split()


def _models_yaml(model_dir: Path, cap: int = 4, cap_policy: str | None = None) -> str:
    cap_policy = cap_policy or f"{{cap_max_tokens: {{max_tokens: {cap}, queue_above: 0}}}}"
    entries = [
        f"{{name: tiny, pool: {POOL}, path: '{model_dir}'}}",
        f"{{name: tiny-cap, pool: {POOL}, path: '{model_dir}', degrade: {cap_policy}}}",
        f"{{name: tiny-gone, pool: gone, path: '{model_dir}', fallback: tiny-cap}}",  # no node: served by tiny-cap
        f"{{name: tiny-trim, pool: {POOL}, path: '{model_dir}', max_context: {TRIM_CONTEXT}}}",
        f"{{name: tiny-trim-auto, pool: {POOL}, path: '{model_dir}', max_context: {TRIM_CONTEXT}, "
        "degrade: {trim_history: {default: auto}}}",
        f"{{name: tiny-lane, pool: {POOL}, path: '{model_dir}', "
        f"degrade: {{long_prompt_lane: {{above_tokens: {LONG_ABOVE}, max_concurrent: 1}}}}}}",
    ]
    return "models:\n" + "".join(f"  - {e}\n" for e in entries)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, tiny_llama_dir: Path) -> Iterator[LocalCluster]:
    args = ["--dtype", "float32", "--num-threads", "1", "--num-kv-blocks", "512", "--block-size", "16"]
    with LocalCluster(tmp_path_factory.mktemp("degrade"), tiny_llama_dir, node_args=args) as c:
        c.start_etcd()
        c.wait_ready([c.spawn_node("decode", "d0", ["--model-name", POOL, "--colocated"])])
        yield c
        c.wait_clean()


@pytest.fixture(scope="module")
def env(cluster: LocalCluster, tiny_llama_dir: Path,
        tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[FrontendProc, Path, Path]]:
    tmp = tmp_path_factory.mktemp("degrade-fe")
    models, request_log = tmp / "models.yaml", tmp / "requests.jsonl"
    models.write_text(_models_yaml(tiny_llama_dir))
    fe = start_frontend("frontend", tmp, cluster.etcd_endpoints, free_port(), "--cluster", cluster.cluster,
                        "--models", str(models), "--request-log", str(request_log), "--log-level", "info")
    try:
        yield fe, models, request_log
    finally:
        assert fe.stop() == 0, fe.proc.tail()
        assert "Traceback" not in fe.proc.log_text(), fe.proc.tail(80)


@pytest.fixture(scope="module")
def client(env: tuple[FrontendProc, Path, Path]) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{env[0].base_url}/v1", api_key="sk-test", max_retries=0)


def degradations(fe: FrontendProc, model: str, policy: str) -> float:
    text = httpx.get(f"{fe.base_url}/metrics", timeout=10).text
    return sum(s.value for family in text_string_to_metric_families(text)
               if family.name == "pdserve_frontend_degradations" for s in family.samples
               if s.name.endswith("_total") and s.labels["model"] == model and s.labels["policy"] == policy)


def log_line(request_log: Path, request_id: str) -> dict[str, Any]:
    def find() -> dict[str, Any] | None:
        lines = request_log.read_text().splitlines() if request_log.exists() else []
        return next((r for r in map(json.loads, lines) if r["request_id"] == request_id), None)
    return wait_until(find, 10, f"the request log line of {request_id}")


def text_of(words: int, seed: int) -> str:
    return f"note {seed}: " + " ".join(WORDS[(seed * 7 + i * 3) % len(WORDS)] for i in range(words))


# --- cap_max_tokens --------------------------------------------------------------------------------


def test_cap_max_tokens_shortens_output_under_pressure(env: tuple[FrontendProc, Path, Path],
                                                        client: openai.OpenAI) -> None:
    fe, _, request_log = env
    before = degradations(fe, "tiny-cap", "cap_max_tokens")
    messages = [{"role": "user", "content": "Count to twenty."}]
    extra = {"ignore_eos": True}
    plain = client.chat.completions.with_raw_response.create(model="tiny", messages=messages, max_tokens=16,
                                                             temperature=0, extra_body=extra)
    assert HEADER not in plain.headers and plain.parse().usage.completion_tokens == 16
    raw = client.chat.completions.with_raw_response.create(model="tiny-cap", messages=messages, max_tokens=16,
                                                           temperature=0, extra_body=extra)
    capped = raw.parse()
    assert raw.headers[HEADER] == "cap_max_tokens"
    assert capped.usage.completion_tokens == 4 and capped.choices[0].finish_reason == "length"
    assert log_line(request_log, capped.id)["degraded"] == ["cap_max_tokens"]
    # Without max_tokens (the rest of the context) and streamed: the header comes before the first chunk.
    raw_stream = client.chat.completions.with_raw_response.create(
        model="tiny-cap", messages=messages, temperature=0, stream=True, stream_options={"include_usage": True},
        extra_body=extra)
    assert raw_stream.headers[HEADER] == "cap_max_tokens"
    chunks = list(raw_stream.parse())
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 4
    # max_tokens already under the cap: nothing to lower, nothing named or counted.
    small = client.chat.completions.with_raw_response.create(model="tiny-cap", messages=messages, max_tokens=2,
                                                             temperature=0, extra_body=extra)
    assert HEADER not in small.headers and small.parse().usage.completion_tokens == 2
    assert log_line(request_log, small.parse().id)["degraded"] is None
    # A model whose pool has no node falls back to tiny-cap, and tiny-cap's cap applies to it.
    fell = client.chat.completions.with_raw_response.create(model="tiny-gone", messages=messages, max_tokens=16,
                                                            temperature=0, extra_body=extra)
    assert fell.headers[HEADER] == "cap_max_tokens" and fell.parse().usage.completion_tokens == 4
    assert degradations(fe, "tiny-cap", "cap_max_tokens") - before == 3


# --- trim_history ----------------------------------------------------------------------------------


def _history(turns: int) -> list[dict[str, str]]:
    messages = [{"role": "system", "content": "You are terse."}]
    for i in range(turns):
        messages += [{"role": "user", "content": text_of(12, i)}, {"role": "assistant", "content": text_of(12, 50 + i)}]
    return [*messages, {"role": "user", "content": "And the last one?"}]


def _expected_trim(model_dir: Path, messages: list[dict[str, str]], max_tokens: int) -> int:
    """The prompt length after dropping the oldest non-system messages one at a time until it fits, counted
    with the frontend's own tokenizer and chat template."""
    model = ModelCatalog((ModelSpec(name="t", path=str(model_dir)),)).resolve("t")
    rest = messages[1:]
    while True:
        n = len(model.encode_chat([messages[0], *rest]))
        if n + max_tokens <= TRIM_CONTEXT:
            return n
        rest = rest[1:]


def test_trim_history_drops_the_oldest_turns_when_the_request_allows_it(
        env: tuple[FrontendProc, Path, Path], client: openai.OpenAI, tiny_llama_dir: Path) -> None:
    fe, _, request_log = env
    messages = _history(6)
    full = client.chat.completions.create(model="tiny", messages=messages, max_tokens=1)
    assert full.usage.prompt_tokens > TRIM_CONTEXT
    with pytest.raises(openai.BadRequestError) as err:  # not allowed: today's context-length error
        client.chat.completions.create(model="tiny-trim", messages=messages, max_tokens=8)
    assert err.value.code == "context_length_exceeded"
    before = degradations(fe, "tiny-trim", "trim_history")
    raw = client.chat.completions.with_raw_response.create(model="tiny-trim", messages=messages, max_tokens=8,
                                                           extra_body={"truncation": "auto"})
    trimmed = raw.parse()
    assert raw.headers[HEADER] == "trim_history"
    assert trimmed.usage.prompt_tokens == _expected_trim(tiny_llama_dir, messages, 8)
    assert trimmed.usage.prompt_tokens + 8 <= TRIM_CONTEXT
    assert log_line(request_log, trimmed.id)["degraded"] == ["trim_history"]
    assert degradations(fe, "tiny-trim", "trim_history") - before == 1
    # A chat that fits is not trimmed, truncation "auto" or not.
    short = client.chat.completions.with_raw_response.create(model="tiny-trim", messages=_history(0), max_tokens=4,
                                                             extra_body={"truncation": "auto"})
    assert HEADER not in short.headers


def test_trim_history_default_auto_applies_unless_the_request_disables_it(
        env: tuple[FrontendProc, Path, Path], client: openai.OpenAI) -> None:
    fe = env[0]
    messages = _history(6)
    before = degradations(fe, "tiny-trim-auto", "trim_history")
    raw = client.chat.completions.with_raw_response.create(model="tiny-trim-auto", messages=messages, max_tokens=8,
                                                           stream=True)
    assert raw.headers[HEADER] == "trim_history"
    assert "".join(c.choices[0].delta.content or "" for c in raw.parse() if c.choices)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny-trim-auto", messages=messages, max_tokens=8,
                                       extra_body={"truncation": "disabled"})
    assert err.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny-trim-auto", messages=messages, extra_body={"truncation": "all"})
    assert err.value.param == "truncation"
    assert degradations(fe, "tiny-trim-auto", "trim_history") - before == 1


# --- long_prompt_lane ------------------------------------------------------------------------------


def test_a_short_prompt_finishes_before_a_long_one_queued_in_the_lane(
        env: tuple[FrontendProc, Path, Path], client: openai.OpenAI, tiny_llama_dir: Path) -> None:
    fe, _, request_log = env
    before = degradations(fe, "tiny-lane", "long_prompt_lane")
    long_prompt = text_of(300, 1)
    assert len(ModelCatalog((ModelSpec(name="t", path=str(tiny_llama_dir)),)).resolve("t").encode(long_prompt)) \
        > LONG_ABOVE
    done: dict[str, float] = {}

    def complete(name: str, prompt: str, max_tokens: int) -> tuple[str, Any]:
        raw = client.completions.with_raw_response.create(model="tiny-lane", prompt=prompt, max_tokens=max_tokens,
                                                          temperature=0, extra_body={"ignore_eos": True})
        done[name] = time.monotonic()
        return raw.headers.get(HEADER, ""), raw.parse()

    # The first long prompt takes the lane's one place and holds it while it streams.
    first = client.completions.with_raw_response.create(model="tiny-lane", prompt=long_prompt, max_tokens=400,
                                                        temperature=0, stream=True, extra_body={"ignore_eos": True})
    assert HEADER not in first.headers  # it did not wait
    stream = iter(first.parse())
    next(stream)
    with ThreadPoolExecutor(2) as pool:
        queued = pool.submit(complete, "long", text_of(300, 2), 8)
        time.sleep(0.3)  # the second long prompt is waiting in the lane by now
        header, short = complete("short", "hello there", 4)
        assert not queued.done(), "the queued long prompt waits while the first one holds the lane"
        assert header == "" and short.usage.completion_tokens == 4
        for _ in stream:  # the first long prompt ends: the queued one takes the lane
            pass
        long_header, long_done = queued.result(timeout=60)
    assert done["short"] < done["long"]
    assert long_header == "long_prompt_lane" and long_done.usage.completion_tokens == 8
    assert log_line(request_log, long_done.id)["degraded"] == ["long_prompt_lane"]
    assert degradations(fe, "tiny-lane", "long_prompt_lane") - before == 1


# --- live reload -----------------------------------------------------------------------------------


def test_a_changed_models_file_puts_the_new_policy_in_force(env: tuple[FrontendProc, Path, Path],
                                                            client: openai.OpenAI, tiny_llama_dir: Path) -> None:
    fe, models, _ = env
    messages = [{"role": "user", "content": "Count to twenty."}]

    def completion_tokens() -> int:
        r = client.chat.completions.create(model="tiny-cap", messages=messages, max_tokens=16, temperature=0,
                                           extra_body={"ignore_eos": True})
        return r.usage.completion_tokens

    models.write_text(_models_yaml(tiny_llama_dir, cap=6))
    wait_until(lambda: completion_tokens() == 6, 15, "the reloaded cap of 6 tokens", interval_s=0.2)
    models.write_text(_models_yaml(tiny_llama_dir, cap_policy="{cap_max_tokens: {max_tokens: 3}}"))
    wait_until(lambda: "degrade.cap_max_tokens needs kv_use_above or queue_above" in fe.proc.log_text(), 15,
               "the frontend to refuse the unusable models file")
    assert completion_tokens() == 6  # the policy in force stays
    models.write_text(_models_yaml(tiny_llama_dir, cap_policy="{cap_max_tokens: null}"))
    wait_until(lambda: completion_tokens() == 16, 15, "the policy to be gone", interval_s=0.2)
