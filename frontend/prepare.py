"""The pure CPU work of admission: a request body to a validated `GenerationRequest`, and a request to
token ids. Pure functions of their arguments, so they run inline on the event loop for a small body and in
a `frontend.workers` process for a large one, with the same results and the same APIErrors."""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.frontend.errors import APIError
from pdserve.frontend.job import CHAT
from pdserve.frontend.models import ServedModel
from pdserve.frontend.protocol import (
    GenerationRequest,
    RequestLimits,
    parse_chat_request,
    parse_completion_request,
    parse_json_body,
)
from pdserve.frontend.structured import check_logit_bias


@dataclass(frozen=True)
class Tokenized:
    prompts: list[list[int]]  # token ids per prompt
    echo_texts: list[str]  # per prompt: the text `echo` puts in front ("" without echo)


def parse_request(kind: str, body: bytes, limits: RequestLimits) -> GenerationRequest:
    """The validated request of a body. Raises APIError (400)."""
    obj = parse_json_body(body)
    return parse_chat_request(obj, limits) if kind == CHAT else parse_completion_request(obj, limits)


def tokenize(req: GenerationRequest, model: ServedModel) -> Tokenized:
    """Token ids and echo texts of every prompt (chat: the rendered template). Raises APIError (400), also
    for a logit_bias token id outside the model's vocabulary."""
    check_logit_bias(req.sampling.logit_bias, model.tokenizer.vocab_size, model.name)
    if req.kind == CHAT:
        assert req.messages is not None
        return Tokenized([model.encode_chat(req.messages, req.tools, req.template_kwargs)], [""])
    prompts: list[list[int]] = []
    echoes: list[str] = []
    assert req.prompts is not None
    single = len(req.prompts) == 1
    for i, p in enumerate(req.prompts):
        if isinstance(p, str):
            ids = model.encode(p)
            echoes.append(p if req.echo else "")
        else:
            model.check_token_ids(p, "prompt" if single else f"prompt[{i}]")
            ids = list(p)
            echoes.append(model.tokenizer.decode(ids) if req.echo else "")
        if not ids and not req.suffix:
            raise APIError(400, "The prompt is empty after tokenization.", param="prompt", code="empty_prompt")
        prompts.append(model.fill_in_middle(ids, req.suffix) if req.suffix else ids)
    return Tokenized(prompts, echoes)
