"""Resumed requests on a real cluster (real etcd, one prefill and two decode node processes on loopback): a
Generate carrying the first k completion tokens of a run (and the characters of text that run had
released with them) yields exactly the rest of the uninterrupted run, tokens and text, whether the
decode node prefills the context itself or has the prefill node do it; greedy and seeded sampling; a
stop string whose start was held back at the resume point; malformed resumes are INVALID_ARGUMENT.

The uninterrupted runs go to d1 and the resumed ones to d0, and every resumed request has its own prompt,
so d0's prefix cache never makes a resumed request local by accident."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from pdserve.engine.detokenizer import IncrementalDetokenizer
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sampling_params import SamplingParams
from testing.cluster import GenerateResult, LocalCluster

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("check_integrity_after_each_test")]

NODE_ARGS = ["--dtype", "float32", "--num-threads", "1", "--num-kv-blocks", "512", "--block-size", "16"]
DECODE_ARGS = ["--local-prefill-threshold", "32"]
PROMPT_LEN = 80  # above the threshold: remote unless forced local
REPREFILLS = "pdserve_decode_reprefills_total"
CHECKSUM_FAILURES = "pdserve_decode_kv_checksum_failures_total"
FALLBACKS = "pdserve_decode_local_prefill_fallbacks_total"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[LocalCluster]:
    with LocalCluster(tmp_path_factory.mktemp("resume"), model_dir, node_args=NODE_ARGS) as c:
        c.start(num_prefill=1, num_decode=2, decode_args=DECODE_ARGS)
        yield c
        c.wait_clean()


def prompt_of(seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 4000) for _ in range(PROMPT_LEN)]


def released_text(engine: LLMEngine, prompt: list[int], tokens: list[int], stop: list[str]) -> str:
    """The text a decode node has released once it produced `tokens` (one step at a time)."""
    detok = IncrementalDetokenizer(engine.tokenizer, prompt, stop)
    return "".join(detok.add([t]).text for t in tokens)


def resume(cluster: LocalCluster, reference: LLMEngine, full: GenerateResult, prompt: list[int],
           params: SamplingParams, k: int, *, local: bool) -> GenerateResult:
    """Resumes `full` after its first k tokens on d0 and checks it yields exactly the rest of `full`."""
    done = full.token_ids[:k]
    chars = len(released_text(reference, prompt, done, params.stop))
    troubles = [cluster.metric("d0", m) for m in (REPREFILLS, CHECKSUM_FAILURES, FALLBACKS)]
    res = cluster.generate("d0", prompt, params, prefill_node_id="" if local else "p0", force_local_prefill=local,
                           resume_token_ids=done, resume_text_chars=chars)
    assert not res.error, res.messages[-1]
    # Healthy transfers land as they are: checksums agree, nothing is re-prefilled or falls back.
    assert [cluster.metric("d0", m) for m in (REPREFILLS, CHECKSUM_FAILURES, FALLBACKS)] == troubles
    assert res.prefill_node_id == ("d0" if local else "p0")
    assert res.token_ids == full.token_ids[k:]
    assert full.text[:chars] + res.text == full.text
    assert res.finish_reason == full.finish_reason and res.messages[-1].stop_reason == full.messages[-1].stop_reason
    last = res.messages[-1]
    assert last.num_completion_tokens == len(full.token_ids) and last.num_prompt_tokens == len(prompt)
    return res


@pytest.mark.parametrize("local", [False, True], ids=["remote", "local"])
def test_greedy_resume_yields_the_rest_of_the_run(cluster: LocalCluster, reference: LLMEngine, local: bool) -> None:
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    for k in (1, 9, 15):
        prompt = prompt_of(100 + 10 * k + local)
        full = cluster.generate("d1", prompt, params, prefill_node_id="p0")
        want = reference.generate([prompt], params)[0]
        assert full.token_ids == want.token_ids and full.text == want.text
        sent = cluster.metric("p0", "pdserve_kv_transfer_bytes_total")
        assert sent > 0  # the uninterrupted run was prefilled on p0
        resume(cluster, reference, full, prompt, params, k, local=local)
        if k == params.max_tokens - 1 and not local:
            # The prefill node's token is the last of max_tokens (the resumed ones count): nothing shipped.
            assert cluster.metric("p0", "pdserve_kv_transfer_bytes_total") == sent
    cluster.wait_clean(timeout_s=10)


@pytest.mark.parametrize("local", [False, True], ids=["remote", "local"])
def test_seeded_resume_continues_the_sampler(cluster: LocalCluster, reference: LLMEngine, local: bool) -> None:
    """The seeded sampler (on the prefill node for the first token, here after it) continues at the
    resumed position, and penalties count the resumed tokens."""
    params = SamplingParams(temperature=0.9, seed=1234, max_tokens=16, ignore_eos=True, frequency_penalty=0.5,
                            repetition_penalty=1.1)
    for k in (1, 6):
        prompt = prompt_of(200 + 10 * k + local)
        full = cluster.generate("d1", prompt, params, prefill_node_id="p0")
        assert full.token_ids == reference.generate([prompt], params)[0].token_ids
        resume(cluster, reference, full, prompt, params, k, local=local)
    cluster.wait_clean(timeout_s=10)


@pytest.mark.parametrize("local", [False, True], ids=["remote", "local"])
def test_stop_string_straddling_the_resume_point(cluster: LocalCluster, reference: LLMEngine, local: bool) -> None:
    """The resume point falls inside a stop string: the first node held its start back, the resuming
    node holds it too and matches it, so the text ends just before it, as in the uninterrupted run."""
    prompt = prompt_of(30 + local)
    greedy = reference.generate([prompt], SamplingParams(max_tokens=24, ignore_eos=True))[0]
    ids = greedy.token_ids
    texts = [released_text(reference, prompt, ids[:i], []) for i in range(len(ids) + 1)]
    start = next(i for i in range(3, len(ids) - 4)
                 if len(texts[i + 1]) - len(texts[i]) >= 2 and len(texts[i + 3]) > len(texts[i + 2]))
    whole = texts[-1]
    stop = whole[len(texts[start]) + 1 : len(texts[start + 2]) + 1]  # from inside token `start` into start+2
    params = SamplingParams(max_tokens=24, ignore_eos=True, stop=[stop])
    full = cluster.generate("d1", prompt, params, prefill_node_id="p0")
    assert full.finish_reason == "stop" and full.text == whole[: len(texts[start]) + 1]
    k = start + 2  # the stop string has begun, its start is held back, and the next token completes it
    assert len(released_text(reference, prompt, ids[:k], params.stop)) < len(texts[k])
    assert resume(cluster, reference, full, prompt, params, k, local=local).text == ""
    cluster.wait_clean(timeout_s=10)


@pytest.mark.parametrize("local", [False, True], ids=["remote", "local"])
def test_malformed_resumes_are_invalid_argument(cluster: LocalCluster, local: bool) -> None:
    prompt = prompt_of(40 + local)
    eos = 2
    cases = [
        (SamplingParams(max_tokens=3), [7, 8, 9], 0),  # nothing left of max_tokens
        (SamplingParams(max_tokens=8), [10**7], 0),  # not in the vocabulary
        (SamplingParams(max_tokens=8, stop_token_ids=[99]), [7, 99], 0),  # would have ended it
        (SamplingParams(max_tokens=8), [7, 8], 10_000),  # more text than the tokens release
        (SamplingParams(max_tokens=8), [7, 8], -1),
        (SamplingParams(max_tokens=8), [], 3),
        (SamplingParams(max_tokens=8, stop_token_ids=[eos]), [eos], 0),
    ]
    for params, done, chars in cases:
        with pytest.raises(grpc.RpcError) as err:
            cluster.generate("d0", prompt, params, prefill_node_id="" if local else "p0", force_local_prefill=local,
                             resume_token_ids=done, resume_text_chars=chars)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (done, chars, err.value.details())
    cluster.wait_clean(timeout_s=10)
