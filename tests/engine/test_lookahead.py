"""The look-ahead decode step and the decode graphs' state rows, on the CPU.

`DecodeGraphs` runs its forward eagerly on a CPU (nothing captured), so these tests check
everything the GPU path does around the graphs: a guessed step is used only when the
runtime asks for exactly it, dropped otherwise (a stop, a budget, a new row), and the
outputs equal an engine without decode graphs, token for token.
"""

import pytest
import torch

from omniwalk import Engine, EngineArgs, GenerationRequest, SamplingParams
from omniwalk.engine.cuda_graphs import DecodeGraphs
from omniwalk.engine.prefill_graphs import PrefillGraphs
from omniwalk.loading import load_model

PROMPTS = ["The quick brown fox", "1 2 3 4", "Once upon a time there was", "a"]


def engine(model: str, graphs: bool, max_num_seqs: int = 8, **engine_args) -> Engine:
    args = EngineArgs(model, device="cpu", dtype="float32", kv_cache_tokens=4096, max_num_seqs=max_num_seqs,
                      **engine_args)
    loaded = load_model(args)
    if graphs:
        executor = loaded.served.executors["backbone"]
        pool = getattr(executor, "state_pool", None)   # the hybrid model's slot resource
        executor.decode_graphs = DecodeGraphs(
            executor.model, executor.cache, max_num_seqs, -(-loaded.max_model_len // args.page_size), pool)
        # as the loaders do
        executor.prefill_graphs = PrefillGraphs(executor.model, executor.decode_graphs,
                                                pool.shape.conv_kernel if pool is not None else None)
    return Engine(args, loaded=loaded)


def requests(max_tokens: int, **options) -> list[GenerationRequest]:
    return [GenerationRequest(prompt=p, max_tokens=max_tokens + i, sampling=SamplingParams(temperature=0.0),
                              **options) for i, p in enumerate(PROMPTS)]


def outputs(model: str, graphs: bool, batch: list[GenerationRequest]):
    with engine(model, graphs) as e:
        results = [(r.token_ids, r.finish_reason) for r in e.generate(batch)]
        return results, e.model.executors["backbone"]


@pytest.mark.slow
@pytest.mark.parametrize("model", ["tiny-qwen3", "tiny-qwen3_5"])
def test_lookahead_outputs_equal_plain_decode(model):
    batch = requests(24, ignore_eos=True)
    plain, _ = outputs(model, False, batch)
    ahead, executor = outputs(model, True, batch)
    assert ahead == plain
    assert [len(ids) for ids, _ in ahead] == [24, 25, 26, 27]   # budgets ending on different steps
    # a batch that lost a row (a budget reached) still takes the guess for the rows left;
    # the one drop: "a" is a one-token prompt, whose prefill joins the decode graph's rows
    assert executor.lookahead_used > 0 and executor.lookahead_dropped <= 1
    # two steps ahead where the rows hold no state slots (the hybrid model's recurrent rows)
    assert (executor.lookahead_early > 0) == (model == "tiny-qwen3")


def test_decode_graph_writes_only_the_rows_beside_the_committed_states():
    """A decode-graph step (a look-ahead step is one) writes each row's next state row
    and leaves the committed rows as they were: a row the runtime drops (its stream
    stopped; its slot may already be another stream's) is simply never committed."""
    with engine("tiny-qwen3_5", True) as e:
        executor = e.model.executors["backbone"]
        graphs, pool, cache = executor.decode_graphs, executor.state_pool, executor.cache
        handles = [100, 101]
        for h in handles:
            pool.allocate(h)
            cache.reserve(h, 1)
        rows = [pool.rows(h) for h in handles]
        tables = [cache.page_tables[h] for h in handles]
        before = pool.recurrent.clone()
        graphs.run(input_ids=[5, 6], positions=[0, 0], slots=[t[0] * cache.page_size for t in tables],
                   context_lens=[0, 0], page_tables=tables, row_slots=rows)
        committed, written = [r[0] for r in rows], [r[1] for r in rows]
        assert torch.equal(pool.recurrent[:, committed], before[:, committed])
        assert pool.recurrent[:, written].abs().sum(dim=(0, 2, 3, 4)).gt(0).all()
        pool.commit([101])                                       # only row 1 taken
        assert pool.rows(100) == rows[0] and pool.rows(101) == rows[1][::-1]


@pytest.mark.slow
def test_lookahead_with_state_slots_handed_on():
    """Two slots, four requests: streams stop while their next step is already computed,
    and waiting ones take over their state slots."""
    batch = requests(6, ignore_eos=True)
    results = {}
    for graphs in (False, True):
        with engine("tiny-qwen3_5", graphs, max_num_seqs=2) as e:
            results[graphs] = [r.token_ids for r in e.generate(batch)]
            executor = e.model.executors["backbone"]
    assert results[True] == results[False]
    assert executor.lookahead_used > 0


@pytest.mark.slow
@pytest.mark.parametrize("model", ["tiny-qwen3", "tiny-qwen3_5"])
def test_lookahead_drops_steps_past_a_stop(model):
    free, _ = outputs(model, False, requests(30, ignore_eos=True))
    stop_id = free[0][0][6]
    batch = requests(30, stop_token_ids=[stop_id])
    plain, _ = outputs(model, False, batch)
    ahead, executor = outputs(model, True, batch)
    assert ahead == plain
    assert ahead[0] == (free[0][0][: free[0][0].index(stop_id) + 1], "stop")
    assert executor.lookahead_used > 0


@pytest.mark.parametrize("n", [1, pytest.param(2, marks=pytest.mark.slow), 3,
                               pytest.param(64, marks=pytest.mark.slow)])
def test_budget_contract_with_lookahead(n):
    with engine("tiny-qwen3_5", True) as e:
        results = e.generate([GenerationRequest(prompt=p, max_tokens=n, ignore_eos=True) for p in PROMPTS])
        assert [len(r.token_ids) for r in results] == [n] * len(PROMPTS)
        assert all(r.finish_reason == "length" for r in results)
        streamed = [t for chunk in e.stream(PROMPTS[0], max_tokens=n, ignore_eos=True) for t in chunk.token_ids]
        assert streamed == results[0].token_ids


@pytest.mark.slow
@pytest.mark.parametrize("model", ["tiny-qwen3", "tiny-qwen3_5"])
def test_lookahead_samples_like_the_real_step(model):
    """Sampled rows look ahead too: seeded temperature/top-k/top-p sampling, penalties over
    histories that already hold the guessed step's input, and min_tokens counted one item
    ahead; the ids equal plain decoding's."""
    sampling = [SamplingParams(temperature=0.9, top_k=40, top_p=0.9, repetition_penalty=1.3, seed=1),
                SamplingParams(temperature=1.2, presence_penalty=0.8, frequency_penalty=0.4, seed=2),
                SamplingParams(temperature=0.7, min_p=0.05, seed=3),
                SamplingParams(temperature=0.0)]
    batch = [GenerationRequest(prompt=p, max_tokens=20 + i, min_tokens=12, sampling=s)
             for i, (p, s) in enumerate(zip(PROMPTS, sampling))]
    plain, _ = outputs(model, False, batch)
    ahead, executor = outputs(model, True, batch)
    assert ahead == plain
    assert executor.lookahead_used > 0


@pytest.mark.slow
@pytest.mark.parametrize("model", ["tiny-qwen3", "tiny-qwen3_5"])
def test_sampling_graphs_sample_like_the_sampler(model):
    """Decode-graph steps whose sampling a sampling graph takes (run eagerly on a CPU):
    greedy and sampled rows mixed, top-k, top-p, min-p, the repetition penalty; the ids
    equal an engine's without decode graphs."""
    sampling = [SamplingParams(temperature=0.9, top_k=40, top_p=0.9, repetition_penalty=1.3, seed=1),
                SamplingParams(temperature=1.2, seed=2),
                SamplingParams(temperature=0.7, min_p=0.05, seed=3),
                SamplingParams(temperature=0.0, repetition_penalty=1.2)]
    batch = [GenerationRequest(prompt=p, max_tokens=20 + i, sampling=s, ignore_eos=True)
             for i, (p, s) in enumerate(zip(PROMPTS, sampling))]
    plain, _ = outputs(model, False, batch)
    ahead, executor = outputs(model, True, batch)
    assert ahead == plain
    assert executor.sampling_graphs.steps_sampled >= 20
    if model == "tiny-qwen3":   # two steps ahead: the penalty sees the unseen step's ids on the device
        assert executor.lookahead_early >= 10


@pytest.mark.slow
def test_lookahead_with_a_logits_mask_speech():
    """Orpheus: the audio-code mask (frame position = codes so far mod 7) and its default
    sampling (temperature, top_p, repetition penalty) in the guessed step."""
    from omniwalk.capabilities.speech import SpeechRequest, synthesize

    def speak(graphs: bool):
        with engine("tiny-orpheus", graphs) as e:
            results = [synthesize(e, SpeechRequest("Hello there", voice="tara", max_output_tokens=n,
                                                   ignore_eos=True, seed=5)) for n in (8, 29)]
            return [(r.token_ids, r.pcm) for r in results], e.model.executors["backbone"]

    plain, _ = speak(False)
    ahead, executor = speak(True)
    assert ahead == plain
    assert executor.lookahead_used > 0
    assert executor.sampling_graphs.steps_sampled > 0   # the candidate table in a sampling graph
    assert executor.lookahead_early > 0   # frame positions and the penalty's mask one step further


@pytest.mark.slow
@pytest.mark.parametrize("model", ["tiny-qwen3", "tiny-qwen3_5"])
def test_prefill_chunks_beside_decode_rows_keep_the_lookahead(model):
    """A long prompt prefilled in 32-token chunks while three short requests decode: those
    steps are mixed (graph rows + eager chunk), and the decode rows still take their
    look-ahead; the ids equal plain decoding's."""
    batch = requests(30, ignore_eos=True)[:3] + [
        GenerationRequest(prompt="many words in a long prompt " * 30, max_tokens=8, ignore_eos=True,
                          sampling=SamplingParams(temperature=0.0))]
    results = {}
    for graphs in (False, True):
        with engine(model, graphs, max_num_batched_tokens=32) as e:
            results[graphs] = [r.token_ids for r in e.generate(batch)]
            executor = e.model.executors["backbone"]
    assert results[True] == results[False]
    # the ~6 mixed steps took their look-ahead; only rows finishing may drop one (hybrid)
    assert executor.lookahead_used >= 20 and executor.lookahead_dropped <= 3


@pytest.mark.slow
@pytest.mark.parametrize("model", ["tiny-qwen3", "tiny-qwen3_5"])
def test_prefill_graphs_pad_ragged_batches_exactly(model):
    """Prompts joining a running batch at different steps, alone or several
    at once, short (a padded prefill graph) and long (over the graphs' 128 tokens: eager),
    chunked (a piece with cached context); the ids equal plain decoding's."""
    prompts = ["a", "The quick brown fox jumps", "1 2 3 4 5 6 7 8 9 10 11 12", "many words " * 40,
               "Once upon a time", "x y", "The end of it all is near, said the man"]
    # logprobs: a corrupted state rarely moves a tiny random model's argmax, but it moves these
    batch = [GenerationRequest(prompt=p, max_tokens=4 + 3 * i, ignore_eos=True,
                               sampling=SamplingParams(temperature=0.0, logprobs=0)) for i, p in enumerate(prompts)]
    results = {}
    for graphs in (False, True):
        with engine(model, graphs, max_num_seqs=3, max_num_batched_tokens=64) as e:
            results[graphs] = [(r.token_ids, [lp.logprob for lp in r.logprobs]) for r in e.generate(batch)]
            executor = e.model.executors["backbone"]
    for (ids, logprobs), (plain_ids, plain_logprobs) in zip(results[True], results[False]):
        assert ids == plain_ids
        assert max(abs(a - b) for a, b in zip(logprobs, plain_logprobs)) < 1e-4
    assert executor.prefill_graphs.replays >= 3


@pytest.mark.slow
def test_decode_graph_page_tables_follow_growth_reorder_and_reuse():
    """The decode graphs rewrite a row's page table only when it changed (a new page, a
    new row order, another sequence); every replay still sees each row's whole table."""
    with engine("tiny-qwen3", True) as e:
        executor = e.model.executors["backbone"]
        graphs, cache = executor.decode_graphs, executor.cache
        size = cache.page_size

        def run(handles):
            tables = [cache.page_tables[h] for h in handles]
            positions = [len(t) * size - 1 for t in tables]
            graphs.run(input_ids=[1] * len(handles), positions=positions,
                       slots=[t[-1] * size + size - 1 for t in tables], context_lens=positions, page_tables=tables)
            for row, table in enumerate(tables):
                assert graphs.page_table[row, : len(table)].tolist() == table

        for handle, tokens in ((200, 3 * size), (201, size), (202, 2 * size)):
            cache.reserve(handle, tokens)
        run([200, 201, 202])
        run([200, 201, 202])
        cache.reserve(201, 2 * size)          # 201 gains a page
        run([200, 201, 202])
        run([202, 200])                       # another order, fewer rows
        cache.free(200)
        cache.reserve(203, 3 * size)          # a new sequence (likely on 200's pages), same length
        run([203, 201, 202])
        run([201, 203, 202])
