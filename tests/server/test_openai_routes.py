"""The OpenAI-compatible routes, driven by the official `openai` package over real HTTP."""

from __future__ import annotations

import openai
import pytest
from probes import fail_backbone_after, restore_backbone

IGNORE_EOS = {"ignore_eos": True, "return_token_ids": True}
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Tell me a story."}]


@pytest.fixture(scope="module")
def oai(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60) as client:
        yield client


def _chat(oai, stream: bool, **kwargs):
    """(text, token_ids, finish_reason, usage) of one chat completion, streamed or not."""
    if not stream:
        response = oai.chat.completions.create(model="tiny-qwen3", messages=MESSAGES, **kwargs)
        choice = response.choices[0]
        return choice.message.content, choice.token_ids, choice.finish_reason, response.usage
    chunks = list(oai.chat.completions.create(model="tiny-qwen3", messages=MESSAGES, stream=True,
                                              stream_options={"include_usage": True}, **kwargs))
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    text, ids, finish = "", [], None
    for chunk in chunks[:-1]:
        assert chunk.usage is None
        for choice in chunk.choices:
            text += choice.delta.content or ""
            ids += getattr(choice, "token_ids", None) or []
            finish = choice.finish_reason or finish
    return text, ids, finish, chunks[-1].usage


def _completion(oai, stream: bool, prompt="Once upon a time", **kwargs):
    if not stream:
        response = oai.completions.create(model="tiny-qwen3", prompt=prompt, **kwargs)
        choice = response.choices[0]
        return choice.text, choice.token_ids, choice.finish_reason, response.usage
    chunks = list(oai.completions.create(model="tiny-qwen3", prompt=prompt, stream=True,
                                         stream_options={"include_usage": True}, **kwargs))
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    text, ids, finish = "", [], None
    for chunk in chunks[:-1]:
        for choice in chunk.choices:
            text += choice.text
            ids += getattr(choice, "token_ids", None) or []
            finish = choice.finish_reason or finish
    return text, ids, finish, chunks[-1].usage


ROUTES = {"chat": _chat, "completions": _completion}


def test_models(oai):
    [model] = oai.models.list().data
    assert model.id == "tiny-qwen3"
    assert oai.models.retrieve("tiny-qwen3").id == "tiny-qwen3"
    with pytest.raises(openai.NotFoundError):
        oai.models.retrieve("gpt-9")


@pytest.mark.parametrize("route", sorted(ROUTES))
@pytest.mark.parametrize("stream", [False, True], ids=["full", "stream"])
@pytest.mark.parametrize("n", [1, 2, 3, 64])
def test_exact_budget_with_ignore_eos(oai, route, stream, n):
    text, ids, finish, usage = ROUTES[route](oai, stream, max_tokens=n, temperature=0, extra_body=IGNORE_EOS)
    assert usage.completion_tokens == n
    assert len(ids) == n
    assert finish == "length"
    assert usage.total_tokens == usage.prompt_tokens + n


def test_max_completion_tokens_wins(oai):
    response = oai.chat.completions.create(model="tiny-qwen3", messages=MESSAGES, max_tokens=9,
                                           max_completion_tokens=4, extra_body=IGNORE_EOS)
    assert response.usage.completion_tokens == 4


@pytest.mark.parametrize("route", sorted(ROUTES))
@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "seed": 1234}],
                         ids=["greedy", "seeded"])
def test_streamed_equals_full(oai, route, sampling):
    full = ROUTES[route](oai, False, max_tokens=40, extra_body=IGNORE_EOS, **sampling)
    streamed = ROUTES[route](oai, True, max_tokens=40, extra_body=IGNORE_EOS, **sampling)
    assert streamed[:3] == full[:3]
    assert streamed[3].completion_tokens == full[3].completion_tokens == 40
    assert streamed[3].prompt_tokens == full[3].prompt_tokens


@pytest.mark.parametrize("route", sorted(ROUTES))
@pytest.mark.parametrize("stream", [False, True], ids=["full", "stream"])
def test_stop_token_id_finishes_with_stop(oai, route, stream):
    _, [first], _, _ = ROUTES[route](oai, False, max_tokens=1, temperature=0, extra_body=IGNORE_EOS)
    text, ids, finish, usage = ROUTES[route](oai, stream, max_tokens=10, temperature=0,
                                             extra_body={"stop_token_ids": [first], "return_token_ids": True})
    assert finish == "stop"
    assert ids == [first] and usage.completion_tokens == 1
    assert text == ""   # the stop item counts and is returned as an id, never rendered


def test_min_tokens_delays_the_stop(oai):
    _, [first], _, _ = _completion(oai, False, max_tokens=1, temperature=0, extra_body=IGNORE_EOS)
    _, ids, _, usage = _completion(oai, False, max_tokens=6, temperature=0,
                                   extra_body={"stop_token_ids": [first], "min_tokens": 3, "return_token_ids": True})
    assert usage.completion_tokens >= 3 and first not in ids[:3]


@pytest.mark.parametrize("stream", [False, True], ids=["full", "stream"])
def test_stop_string(oai, stream):
    sampling = {"temperature": 1.0, "seed": 5}
    text, _, _, _ = _completion(oai, False, max_tokens=30, extra_body=IGNORE_EOS, **sampling)
    # a 2-character stop string whose first occurrence is inside the text
    start = next(p for p in range(3, len(text) - 2) if text.find(text[p:p + 2]) == p)
    stop = text[start:start + 2]
    cut, _, finish, _ = _completion(oai, stream, max_tokens=30, stop=[stop], extra_body=IGNORE_EOS, **sampling)
    assert finish == "stop"
    assert cut == text[: text.find(stop)]


def test_n_choices_with_seed(oai):
    response = oai.completions.create(model="tiny-qwen3", prompt="Hi", n=3, max_tokens=12, temperature=1.0,
                                      seed=99, extra_body=IGNORE_EOS)
    assert [c.index for c in response.choices] == [0, 1, 2]
    assert response.usage.completion_tokens == 36
    for i, choice in enumerate(response.choices):   # choice i is the request with seed + i
        alone = oai.completions.create(model="tiny-qwen3", prompt="Hi", max_tokens=12, temperature=1.0,
                                       seed=99 + i, extra_body=IGNORE_EOS)
        assert alone.choices[0].token_ids == choice.token_ids
    assert len({tuple(c.token_ids) for c in response.choices}) > 1


def test_n_choices_streamed_chat(oai):
    chunks = list(oai.chat.completions.create(model="tiny-qwen3", messages=MESSAGES, n=2, max_tokens=5,
                                              stream=True, extra_body=IGNORE_EOS))
    ids = {0: [], 1: []}
    finish = {}
    for chunk in chunks:
        for choice in chunk.choices:
            ids[choice.index] += getattr(choice, "token_ids", None) or []
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
    assert {k: len(v) for k, v in ids.items()} == {0: 5, 1: 5}
    assert finish == {0: "length", 1: "length"}


def test_batched_prompts(oai):
    response = oai.completions.create(model="tiny-qwen3", prompt=[[1, 2], [5, 6, 7]], n=2, max_tokens=3,
                                      extra_body=IGNORE_EOS)
    assert len(response.choices) == 4 and response.usage.completion_tokens == 12
    assert response.usage.prompt_tokens == 5   # once per prompt, not per choice
    assert [c.prompt_token_ids for c in response.choices] == [[1, 2], [1, 2], [5, 6, 7], [5, 6, 7]]
    texts = oai.completions.create(model="tiny-qwen3", prompt=["Hello", "World"], max_tokens=2,
                                   extra_body=IGNORE_EOS)
    assert len(texts.choices) == 2 and texts.usage.completion_tokens == 4


def test_chat_logprobs(oai):
    response = oai.chat.completions.create(model="tiny-qwen3", messages=MESSAGES, max_tokens=5, logprobs=True,
                                           top_logprobs=3, temperature=0, extra_body=IGNORE_EOS)
    content = response.choices[0].logprobs.content
    assert len(content) == 5
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.logprob <= 0 and entry.top_logprobs[0].logprob >= entry.logprob - 1e-5   # greedy: the top


def test_completion_logprobs(oai):
    response = oai.completions.create(model="tiny-qwen3", prompt="Hi", max_tokens=4, logprobs=2, temperature=0,
                                      extra_body=IGNORE_EOS)
    logprobs = response.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 4
    assert "".join(logprobs.tokens) == response.choices[0].text
    assert logprobs.text_offset == sorted(logprobs.text_offset)


def test_chat_prompt_uses_template(oai, server):
    response = oai.chat.completions.create(model="tiny-qwen3", messages=MESSAGES, max_tokens=1,
                                           extra_body=IGNORE_EOS)
    tokenizer = server.engine.tokenizer
    text = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert response.prompt_token_ids == tokenizer.encode(text, add_special_tokens=False)
    assert response.usage.prompt_tokens == len(response.prompt_token_ids)


def test_unknown_model_is_404(oai):
    with pytest.raises(openai.NotFoundError) as info:
        oai.chat.completions.create(model="gpt-9", messages=MESSAGES, max_tokens=2)
    assert "gpt-9" in info.value.message


def test_bad_value_is_400(oai):
    with pytest.raises(openai.BadRequestError) as info:
        oai.completions.create(model="tiny-qwen3", prompt="Hi", max_tokens=0)
    assert "max_tokens" in info.value.message


@pytest.fixture
def failing_step(server):
    """The backbone fails for any sequence that already produced 3 tokens (in the engine process)."""
    server.engine.inspect(fail_backbone_after, 3)
    yield
    server.engine.inspect(restore_backbone)
    server.wait_idle()


def test_error_after_stream_started_is_an_error_event(oai, failing_step):
    received = []
    with pytest.raises(openai.APIError) as info:
        for chunk in oai.chat.completions.create(model="tiny-qwen3", messages=MESSAGES, max_tokens=20,
                                                 stream=True, extra_body=IGNORE_EOS):
            received += getattr(chunk.choices[0], "token_ids", None) or [] if chunk.choices else []
    assert "injected failure" in info.value.message
    assert len(received) == 3


def test_error_without_stream_is_500(oai, failing_step):
    with pytest.raises(openai.InternalServerError) as info:
        oai.completions.create(model="tiny-qwen3", prompt="Hi", max_tokens=20, extra_body=IGNORE_EOS)
    assert "injected failure" in info.value.message


def test_default_chat_template_for_a_tokenizer_without_one(server):
    import copy

    from omniwalk.server.openai_api import render_chat
    from omniwalk.server.protocol import ChatCompletionRequest

    tokenizer = copy.deepcopy(server.engine.tokenizer)
    tokenizer.chat_template = None
    ids = render_chat(tokenizer, ChatCompletionRequest(messages=MESSAGES))
    expected = ("<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nTell me a story.<|im_end|>\n"
                "<|im_start|>assistant\n")
    assert tokenizer.decode(ids, skip_special_tokens=False) == expected
