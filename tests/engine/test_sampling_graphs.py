"""`SamplingGraphs` and `sample_rows` (what a sampling graph holds) against `Sampler`, on
the CPU: every row through every stage of the batch's plan, with neutral values where a
row does not use a stage, must give the sampler's ids (which runs stages on subsets)."""

from types import SimpleNamespace

import pytest
import torch

from omniwalk.engine.sampler import Sampler, SamplingParams, row_keys
from omniwalk.engine.sampling_graphs import CandidateTable, SamplingGraphs

MIXED = [SamplingParams(temperature=0.0, repetition_penalty=1.3),
         SamplingParams(temperature=0.8, top_p=0.9, repetition_penalty=1.1),
         SamplingParams(temperature=1.1, top_k=20),
         SamplingParams(temperature=0.6, min_p=0.1),
         SamplingParams(temperature=0.0),
         SamplingParams(temperature=1.0),
         SamplingParams(temperature=0.7, top_k=5, top_p=0.5, min_p=0.02, repetition_penalty=0.8)]


def graphs(max_rows: int = 16) -> SamplingGraphs:
    # the decode graphs' part a sampling graph reads; on a CPU nothing is captured
    decode = SimpleNamespace(device=torch.device("cpu"), max_batch_size=max_rows,
                             bucket_for=lambda rows: 1 << (rows - 1).bit_length())
    return SamplingGraphs(decode)


@pytest.mark.parametrize("params", [MIXED, MIXED[1:2] * 5, [SamplingParams(temperature=0.0)] * 3,
                                    [SamplingParams(temperature=0.9, top_p=0.8)] * 4],
                         ids=["mixed", "top-p + penalty", "greedy", "top-p"])
def test_sampling_graphs_pick_the_sampler_ids(params):
    gen = torch.Generator().manual_seed(3)
    rows, vocab = len(params), 500
    histories = [torch.randint(0, vocab, (30,), generator=gen).tolist() for _ in range(rows)]
    seen = torch.zeros(rows + 1, vocab, dtype=torch.bool)   # row 0: the empty row, as SeenTokens keeps it
    for row, ids in enumerate(histories):
        seen[row + 1, ids] = True
    seen_rows = torch.arange(1, rows + 1)
    sampling = graphs()
    sampler = Sampler()
    for step in range(6):   # the same batch: its values are staged once
        logits = torch.randn(rows, vocab, generator=gen) * 3
        seeds, indices = [11 * r + 1 for r in range(rows)], [step] * rows
        expected = sampler(logits.clone(), params, seeds, indices, [[]] * rows, histories).token_ids
        settings = sampler.rows_for(params, logits.device)
        got = sampling.sample(logits.clone(), settings, row_keys(seeds, indices), seen=seen, seen_rows=seen_rows)
        assert got.tolist() == expected.tolist()
    assert sampling.steps_sampled == 6


def test_sampling_graphs_over_a_candidate_table():
    """A model's candidate table (Orpheus' codebooks): each row samples the columns of its
    table row, the disallowed ones never; the ids equal the sampler's over those columns."""
    gen = torch.Generator().manual_seed(4)
    vocab, width, rows = 900, 40, 5
    ids = torch.stack([torch.cat([torch.tensor([3]), torch.arange(100 + 50 * k, 100 + 50 * k + width - 1)])
                       for k in range(6)])
    allowed = torch.ones_like(ids, dtype=torch.bool)
    allowed[:3, 0] = False                                   # table rows 0-2 may not pick id 3
    table = CandidateTable(ids, allowed)
    params = [SamplingParams(temperature=0.6, top_p=0.8, repetition_penalty=1.3, seed=r) for r in range(rows)]
    seen = torch.zeros(rows + 1, vocab, dtype=torch.bool)
    seen[1:, 100:400:7] = True
    sampling, sampler = graphs(8), Sampler()
    for step in range(7):
        logits = torch.randn(rows, vocab, generator=gen) * 2
        logits[:, 3] = 10.0                                  # the stop id would win wherever allowed
        table_rows = [(step + r) % 6 for r in range(rows)]
        seeds, indices = list(range(rows)), [step] * rows
        columns, candidate_ids = table.columns_of(logits.clone(), torch.tensor(table_rows))
        expected = sampler(columns, params, seeds, indices, [[]] * rows, [[]] * rows, candidate_ids=candidate_ids,
                           vocab_size=vocab, seen=seen[1:]).token_ids
        got = sampling.sample(logits.clone(), sampler.rows_for(params, logits.device), row_keys(seeds, indices),
                              table, table_rows, seen, torch.arange(1, rows + 1))
        assert got.tolist() == expected.tolist()
        for row, token in zip(table_rows, got.tolist()):
            assert token in ids[row].tolist() and (token != 3 or row >= 3)
