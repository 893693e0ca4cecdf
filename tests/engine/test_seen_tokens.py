"""The repetition penalty's device-side seen-id mask (`SeenTokens`) against the host
histories it replaces."""

import random

import numpy as np
import torch

from omniwalk.engine.causal_lm_executor import TokenHistory
from omniwalk.engine.sampler import Sampler, SamplingParams
from omniwalk.engine.seen_tokens import SeenTokens

VOCAB = 50


def from_history(history: TokenHistory | None) -> torch.Tensor:
    mask = torch.zeros(VOCAB, dtype=torch.bool)
    if history is not None:
        ids = np.concatenate([history.prompt, history.outputs])
        mask[torch.as_tensor(ids[(ids >= 0) & (ids < VOCAB)])] = True
    return mask


def test_rows_equal_the_histories_through_appends_frees_reuse_and_growth():
    rng = random.Random(0)
    seen = SeenTokens(VOCAB, "cpu", capacity=2)     # grows twice below
    histories: dict[int, TokenHistory] = {}
    next_handle = 0
    for step in range(60):
        for handle, history in histories.items():        # each appends a token
            token = rng.randrange(0, VOCAB + 2)
            history.append(token)
            seen.append(handle, token)
        if histories and rng.random() < 0.3:             # one ends, its last token still queued
            handle = rng.choice(list(histories))
            del histories[handle]
            seen.free(handle)
        if len(histories) < 5 and rng.random() < 0.5:   # a new sequence, maybe in the freed row
            histories[next_handle] = TokenHistory([rng.randrange(-1, VOCAB + 3) for _ in range(rng.randrange(0, 6))])
            next_handle += 1
        handles = [h for h in histories if rng.random() < 0.8] + [-7]     # -7: a row without penalties
        rows = [histories[h] for h in handles[:-1]] + [None]
        expected = torch.stack([from_history(h) for h in rows])
        assert torch.equal(seen.gather(handles, rows), expected), step
    assert seen.mask.shape[0] > 3 and not seen.mask[0].any()


def test_a_batch_passing_the_same_handles_list_sees_its_appends():
    """A decode batch passes the same handles list object every step (the executor's
    `_BatchRows`): its rows are looked up once, the appended ids still land."""
    seen = SeenTokens(VOCAB, "cpu", capacity=2)
    histories = {3: TokenHistory([1, 2]), 4: TokenHistory([7]), 5: TokenHistory([])}
    handles = [3, 4, 5]
    for step in range(4):
        rows = [histories[h] for h in handles]
        assert torch.equal(seen.gather(handles, rows), torch.stack([from_history(h) for h in rows])), step
        for handle in handles:
            histories[handle].append(10 + 3 * step + handle)
            seen.append(handle, 10 + 3 * step + handle)
    seen.free(4)                               # the batch changes: a new list, a new sequence in row 4's place
    histories[6] = TokenHistory([30])
    handles = [6, 3, 5]
    rows = [histories[h] for h in handles]
    assert torch.equal(seen.gather(handles, rows), torch.stack([from_history(h) for h in rows]))


def test_sampler_with_the_mask_samples_what_it_samples_from_the_histories():
    torch.manual_seed(7)
    logits = torch.randn(4, VOCAB)
    params = [SamplingParams(temperature=0.0, repetition_penalty=1.3),
              SamplingParams(temperature=0.8, repetition_penalty=1.2, presence_penalty=0.5, seed=2),
              SamplingParams(temperature=0.0),
              SamplingParams(temperature=1.0, repetition_penalty=0.7, top_p=0.9, seed=3)]
    histories = [TokenHistory([1, 2, 3]), TokenHistory([5, 5, 6]), None, TokenHistory([49, 0])]
    for history, outputs in zip(histories, ([4, 4], [6, 7, 7], [], [12])):
        for token in outputs:
            if history is not None:
                history.append(token)
    seen = SeenTokens(VOCAB, "cpu").gather([0, 1, 2, 3], histories)
    empty = np.empty(0, dtype=np.int64)
    prompts = [h.prompt if h is not None else empty for h in histories]
    outputs = [h.outputs if h is not None else empty for h in histories]
    sampler = Sampler()
    args = (logits, params, [0, 1, 2, 3], [2, 3, 0, 1], prompts, outputs)
    assert torch.equal(sampler.process_logits(logits, params, prompts, outputs, seen=seen),
                       sampler.process_logits(logits, params, prompts, outputs))
    assert torch.equal(sampler(*args, seen=seen).token_ids, sampler(*args).token_ids)
    # over candidate columns (Orpheus' path): the mask's columns are gathered the same way
    candidates = torch.tensor([[0, 4, 7, 9, 12]] * 4)
    narrow = logits.gather(1, candidates)
    with_mask = sampler(narrow, params, [0, 1, 2, 3], [2, 3, 0, 1], prompts, outputs, candidate_ids=candidates,
                        vocab_size=VOCAB, seen=seen)
    without = sampler(narrow, params, [0, 1, 2, 3], [2, 3, 0, 1], prompts, outputs, candidate_ids=candidates,
                      vocab_size=VOCAB)
    assert torch.equal(with_mask.token_ids, without.token_ids)
