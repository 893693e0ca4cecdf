"""GPU runs of the families beyond Qwen3/Llama (run on the device machine with `-m gpu`).

Each compares a tiny built-in model on CUDA with the same model on the CPU, both fp32,
so any difference is the GPU path (Triton attention, CUDA graphs, look-ahead off or on),
not precision. Written ahead of their first GPU run: see the issues for their status.
"""

import numpy as np
import pytest
import torch

from omniwalk import Engine, EngineArgs, GenerationRequest, SamplingParams
from omniwalk.engine.ragged import RaggedLengths
from omniwalk.kernels.gated_delta_rule import chunk_gated_delta_rule, gdn_gates, recurrent_gated_delta_rule
from omniwalk.kernels.state_rows import StateRows
from omniwalk.layers import gated_delta_rule as gdr

pytestmark = pytest.mark.gpu


def run_on(device: str, model: str, fn, dtype: str = "float32", **engine_args):
    engine_args = {"max_num_seqs": 8, **engine_args}
    args = EngineArgs(model, device=device, dtype=dtype, kv_cache_tokens=32768, **engine_args)
    with Engine(args) as engine:
        return fn(engine)


def delta_rule_inputs(batch, seq_len, dtype, key_heads=4, value_heads=8, dim=64):
    """q, k, v and the raw gate inputs a, b, A_log, dt_bias (see `gdn_gates`)."""
    gen = torch.Generator("cuda").manual_seed(0)
    def rand(*shape):
        return torch.randn(*shape, generator=gen, device="cuda")
    q, k = rand(batch, seq_len, key_heads, dim).to(dtype), rand(batch, seq_len, key_heads, dim).to(dtype)
    v = rand(batch, seq_len, value_heads, dim).to(dtype)
    a, b = rand(batch, seq_len, value_heads).to(dtype), rand(batch, seq_len, value_heads).to(dtype)
    return q, k, v, a, b, rand(value_heads).to(dtype), rand(value_heads).to(dtype)


def pool_rows(states: torch.Tensor) -> StateRows:
    """A pool holding `states` [n, ...] at rows 1, 3, 5, ...; the new states go to rows 0, 2, 4, ..."""
    pool = torch.zeros(2 * len(states), *states.shape[1:], device="cuda")
    read = torch.arange(len(states), device="cuda") * 2 + 1
    pool[read] = states
    return StateRows(pool, read, read - 1)


def test_delta_rule_kernels_match_fla_and_the_torch_reference():
    """The decode step (omniwalk's kernel over pool rows, gates computed inside) against
    fla-core's fused recurrent kernel and the torch reference; ragged batches (decode rows
    are sequences of length 1): short pieces alone take omniwalk's kernel, a piece over
    RECURRENT_PREFILL_MAX_LEN fla's chunked one (tf32 multiplies: looser tolerance)."""
    assert gdr.fla_kernels() is not None, "fla-core must be installed for the GPU path"
    fla_recurrent, _ = gdr.fla_kernels()
    q, k, v, a, b, A_log, dt_bias = delta_rule_inputs(3, 1, torch.float32)
    state = torch.randn(3, 8, 64, 64, device="cuda") * 0.1
    rows = pool_rows(state)
    out = gdr.gated_delta_rule_decode(q[:, 0], k[:, 0], v[:, 0], a[:, 0], b[:, 0], A_log, dt_bias, rows)
    fla_out, fla_state = fla_recurrent(q, k, v, g=a, beta=b, initial_state=state, output_final_state=True,
                                       use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=A_log,
                                       dt_bias=dt_bias, use_beta_sigmoid_in_kernel=True)
    g, beta = gdn_gates(a, b, A_log, dt_bias)
    ref_out, ref_state = recurrent_gated_delta_rule(q, k, v, g, beta, state)
    for expected_out, expected_state in ((fla_out, fla_state), (ref_out, ref_state)):
        assert (out - expected_out[:, 0]).abs().max() < 1e-4
        assert (rows.pool[rows.write] - expected_state).abs().max() < 1e-4
    assert torch.equal(rows.pool[rows.read], state)            # the read rows untouched

    for lengths in ([5, 1, 30, 64], [5, 1, gdr.RECURRENT_PREFILL_MAX_LEN + 2, 64]):
        q, k, v, a, b = (x[0] for x in delta_rule_inputs(1, sum(lengths), torch.float32)[:5])
        states = torch.randn(len(lengths), 8, 64, 64, device="cuda") * 0.1
        rows = pool_rows(states)
        out = gdr.gated_delta_rule_varlen(q, k, v, a, b, A_log, dt_bias, rows, RaggedLengths(lengths, q.device))
        g, beta = gdn_gates(a, b, A_log, dt_bias)
        start = 0
        for i, length in enumerate(lengths):
            span = slice(start, start + length)
            ref_out, ref_state = chunk_gated_delta_rule(q[None, span], k[None, span], v[None, span],
                                                        g[None, span], beta[None, span], states[i, None])
            assert (out[span] - ref_out[0]).abs().max() < 2e-3
            assert (rows.pool[rows.write[i]] - ref_state[0]).abs().max() < 5e-3
            start += length


def test_qwen3_5_greedy_ids_cuda_equal_cpu():
    """fp32 on both sides: the CUDA side runs the recurrent kernel over pool rows, the
    decode CUDA graphs with the state rows, the look-ahead step, and the prefill graphs (two slots for four requests:
    the later ones join a running batch); greedy ids must equal the CPU reference."""
    requests = [GenerationRequest(prompt=p, max_tokens=48 - 8 * i, ignore_eos=True,
                                  sampling=SamplingParams(temperature=0.0))
                for i, p in enumerate(("The quick brown fox " * 20, "1 2 3", "Once upon a time", "a b c"))]

    def generate(engine):
        ids = [r.token_ids for r in engine.generate(requests)]
        executor = engine.model.executors["backbone"]
        prefill = executor.prefill_graphs.replays if executor.prefill_graphs is not None else 0
        return ids, executor.decode_graphs is not None, executor.lookahead_used, prefill

    cpu_ids, _, _, _ = run_on("cpu", "tiny-qwen3_5", generate, max_num_seqs=2)
    cuda_ids, graphs, lookahead_used, prefill_replays = run_on("cuda", "tiny-qwen3_5", generate, max_num_seqs=2)
    assert graphs and lookahead_used > 0 and prefill_replays > 0
    assert cuda_ids == cpu_ids


def test_qwen3_5_bf16_graphs_equal_eager_and_track_fp32():
    """bf16 on CUDA: graphs (+ look-ahead) == eager exactly; against fp32 the ids may part
    after a near tie, so only the first tokens are compared (the documented bf16 tolerance)."""
    requests = [GenerationRequest(prompt=p, max_tokens=32, ignore_eos=True, sampling=SamplingParams(temperature=0.0))
                for p in ("The quick brown fox " * 20, "1 2 3", "Once upon a time", "a b c d e f g")]

    def generate(engine):
        return [r.token_ids for r in engine.generate(requests)]

    graphs = run_on("cuda", "tiny-qwen3_5", generate, dtype="bfloat16")
    eager = run_on("cuda", "tiny-qwen3_5", generate, dtype="bfloat16", enforce_eager=True)
    fp32 = run_on("cuda", "tiny-qwen3_5", generate)
    assert graphs == eager
    assert sum(a[:4] == b[:4] for a, b in zip(graphs, fp32)) >= 3


def test_qwen3_5_budget_contract_on_cuda():
    for n in (1, 2, 3, 64):
        request = GenerationRequest(prompt="Once upon a time", max_tokens=n, ignore_eos=True)
        out = run_on("cuda", "tiny-qwen3_5", lambda e: e.generate([request])[0], dtype="bfloat16")
        assert len(out.token_ids) == n and out.finish_reason == "length"


def test_orpheus_codes_equal_and_audio_close_cuda_vs_cpu():
    from omniwalk.capabilities.speech import SpeechRequest, synthesize

    def speak(engine):
        if engine.loaded.device.type == "cuda":
            assert len(engine.model.executors["snac_decoder"].graphs) == 3   # first, centre, last windows
        return [synthesize(engine, SpeechRequest("Hello there, how are you?", voice="tara", max_output_tokens=n,
                                                 ignore_eos=True, seed=7)) for n in (7, 29, 70)]

    # TF32 convolutions (cuDNN's default, kept when serving) move samples by up to ~100 LSB;
    # off here, so the comparison sees only the GPU code path.
    torch.backends.cudnn.allow_tf32 = False
    try:
        cpu, cuda = run_on("cpu", "tiny-orpheus", speak), run_on("cuda", "tiny-orpheus", speak)
    finally:
        torch.backends.cudnn.allow_tf32 = True
    for a, b in zip(cpu, cuda):
        assert a.token_ids == b.token_ids and a.usage == b.usage
        pcm_a, pcm_b = np.frombuffer(a.pcm, "<i2").astype(int), np.frombuffer(b.pcm, "<i2").astype(int)
        # fp32 convolutions on two devices, and SNAC graphs padding the batch on CUDA: a few LSB
        assert len(pcm_a) == len(pcm_b) and np.abs(pcm_a - pcm_b).max() <= 3


def test_whisper_greedy_ids_cuda_equal_cpu():
    from omniwalk.bench.asr import synthetic_clip
    from omniwalk.capabilities.transcription import TranscriptionRequest, transcribe

    clips = [synthetic_clip(seconds, [0, i]) for i, seconds in enumerate((3.0, 11.0, 35.0))]

    def listen(engine):
        return [transcribe(engine, TranscriptionRequest(clip, language="en", max_output_tokens=40)).token_ids
                for clip in clips]

    def listen_with_graphs(engine):
        decoder = engine.model.executors["decoder"]
        assert decoder.decode_graphs is not None
        ids = listen(engine)
        # the shared decoder executor's look-ahead step and sampling graphs took decode steps
        assert decoder.lookahead_used > 0 and decoder.sampling_graphs.steps_sampled > 0
        assert decoder.sampling_graphs.graphs and all(decoder.sampling_graphs.graphs.values())
        # and each window's forced prompt replayed a prefill graph (its cross-attention's slots gathered in it)
        assert decoder.prefill_graphs is not None and decoder.prefill_graphs.replays > 0
        return ids

    assert run_on("cuda", "tiny-whisper", listen_with_graphs) == run_on("cpu", "tiny-whisper", listen)
    assert run_on("cuda", "tiny-whisper", listen, enforce_eager=True) == run_on("cpu", "tiny-whisper", listen)


def test_qwen3_omni_greedy_ids_cuda_equal_cpu():
    """Text, image and audio prompts on tiny-qwen3-omni: CUDA (decode graphs, look-ahead, the
    Triton fused-MoE kernel) against the CPU, fp32; then the grouped_mm experts in bf16 keep
    the budget and give ids (no equality asked across backends in bf16)."""
    from omniwalk.capabilities.media import AudioInput, ImageInput
    from omniwalk.capabilities.text import collect_generation
    from omniwalk.layers.moe import SparseMoeBlock

    rng = np.random.default_rng(0)
    image = rng.integers(0, 256, (48, 64, 3), dtype=np.uint8)
    clip = (0.2 * np.sin(np.arange(40000) / 16000 * 2 * np.pi * 330)).astype(np.float32)
    prompts = [("Hello there", ()), ("Look", (ImageInput(image),)), ("Hear", (AudioInput(clip),)),
               ("Both", (ImageInput(image), AudioInput(clip)))]

    def answer(engine):
        streams = [engine.submit(GenerationRequest(prompt=p, media=m, max_tokens=24, ignore_eos=True))
                   for p, m in prompts]
        return [collect_generation(s).token_ids for s in streams]

    def answer_with_graphs(engine):
        executor = engine.model.executors["thinker"]
        assert executor.decode_graphs is not None
        ids = answer(engine)
        assert executor.lookahead_used > 0
        return ids

    assert run_on("cpu", "tiny-qwen3-omni", answer) == run_on("cuda", "tiny-qwen3-omni", answer_with_graphs)
    SparseMoeBlock.backend = "grouped_mm"
    try:
        ids = run_on("cuda", "tiny-qwen3-omni", answer, dtype="bfloat16")
    finally:
        SparseMoeBlock.backend = None
    assert [len(i) for i in ids] == [24] * len(prompts)


def test_qwen3_omni_speaks_on_cuda_as_on_cpu():
    """tiny-qwen3-omni's spoken answers (Talker with its MoE and code predictor, Code2Wav in
    chunks) on CUDA against the CPU, fp32, greedy: the same text and frames, samples close;
    then bf16 keeps both budgets."""
    from omniwalk.capabilities.text import SpeechOutput, collect_generation

    greedy = SamplingParams(temperature=0.0)

    def speak(engine):
        prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": "Say hi"}], tokenize=False,
                                                      add_generation_prompt=True)
        streams = [engine.submit(GenerationRequest(prompt=prompt, max_tokens=8 + i, ignore_eos=True, sampling=greedy,
                                                   speech=SpeechOutput(voice, 12 + 5 * i, greedy)))
                   for i, voice in enumerate(("ethan", "chelsie"))]
        results = [collect_generation(s) for s in streams]
        return [r.token_ids for r in results], [np.frombuffer(r.audio, "<i2").astype(np.float32) for r in results]

    # Code2Wav's convolutions: cuDNN's TF32 default moves samples by ~100 LSB (as in the
    # Orpheus test above); off here, so the comparison sees only the GPU code path
    torch.backends.cudnn.allow_tf32 = False
    try:
        cpu_ids, cpu_audio = run_on("cpu", "tiny-qwen3-omni", speak)
        cuda_ids, cuda_audio = run_on("cuda", "tiny-qwen3-omni", speak)
    finally:
        torch.backends.cudnn.allow_tf32 = True
    assert cuda_ids == cpu_ids
    assert [a.shape for a in cuda_audio] == [a.shape for a in cpu_audio]
    assert all(np.abs(a - b).max() <= 64 for a, b in zip(cuda_audio, cpu_audio))   # 64 / 32767: 0.2 %
    ids, audio = run_on("cuda", "tiny-qwen3-omni", speak, dtype="bfloat16")
    assert [len(i) for i in ids] == [8, 9] and [a.size for a in audio] == [a.size for a in cpu_audio]
