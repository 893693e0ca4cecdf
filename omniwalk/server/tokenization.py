"""POST /tokenize and POST /detokenize, as `vllm serve` answers them.

    POST /tokenize    {"prompt": "..."}      or {"messages": [...]} (rendered by the chat
                      template, as /v1/chat/completions would render them)
                      -> {"tokens": [...], "count": n, "max_model_len": m, "token_strs": null | [...]}
    POST /detokenize  {"tokens": [...]} -> {"prompt": "..."}

`model`, when given, must be a served name (404 otherwise). Chat messages take text parts
only here: an image or audio part becomes the model's placeholder tokens in the
frontend, which this route does not run (400). A model without tokenizer files answers 400.
"""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from omniwalk.server.generation import ServerContext
from omniwalk.server.openai_api import chat_template_text
from omniwalk.server.protocol import (
    ApiError, DetokenizeRequest, TextPart, TokenizeChatRequest, TokenizeCompletionRequest,
)
from omniwalk.tokenizer import NoTokenizer


def tokenization_router(ctx: ServerContext) -> APIRouter:
    router = APIRouter()
    tokenizer = ctx.engine.tokenizer

    @router.post("/tokenize")
    async def tokenize(body: dict):
        request = _tokenize_body(body)
        ctx.check_model(request.model)
        _check_tokenizer(tokenizer)
        text = request.prompt if isinstance(request, TokenizeCompletionRequest) else _chat_text(tokenizer, request)
        try:
            tokens = tokenizer.encode(text, add_special_tokens=request.add_special_tokens)
        except Exception as exc:   # text no tokenizer can encode is the client's
            raise ApiError(400, f"the text cannot be tokenized: {exc}", "prompt") from None
        answer = {"tokens": tokens, "count": len(tokens), "max_model_len": ctx.engine.max_model_len,
                  "token_strs": None}
        if request.return_token_strs:
            answer["token_strs"] = tokenizer.convert_ids_to_tokens(tokens)
        return answer

    @router.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        ctx.check_model(body.model)
        _check_tokenizer(tokenizer)
        vocabulary = len(tokenizer)
        bad = [t for t in body.tokens if not 0 <= t < vocabulary]
        if bad:
            raise ApiError(400, f"tokens has id(s) outside the vocabulary [0, {vocabulary}): {bad[:5]}", "tokens")
        return {"prompt": tokenizer.decode(body.tokens)}

    return router


def _tokenize_body(body: dict) -> TokenizeCompletionRequest | TokenizeChatRequest:
    """vLLM's two bodies, told apart by `messages` (a union would report both bodies' errors)."""
    model = TokenizeChatRequest if isinstance(body, dict) and "messages" in body else TokenizeCompletionRequest
    try:
        return model.model_validate(body)
    except ValidationError as exc:   # answered like any other malformed body
        raise RequestValidationError(exc.errors()) from None


def _check_tokenizer(tokenizer) -> None:
    if isinstance(tokenizer, NoTokenizer):
        raise ApiError(400, "this model has no tokenizer files: there is no text to tokenize")


def _chat_text(tokenizer, body: TokenizeChatRequest) -> str:
    for i, message in enumerate(body.messages):
        parts = message.content if isinstance(message.content, list) else []
        for j, part in enumerate(parts):
            if not isinstance(part, TextPart):
                raise ApiError(400, f"messages[{i}].content[{j}]: /tokenize takes text parts only",
                               f"messages[{i}].content[{j}]")
    return chat_template_text(tokenizer, body, [m.text() for m in body.messages])
