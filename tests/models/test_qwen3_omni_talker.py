"""Qwen3-Omni's Talker and code predictor against transformers: a tiny random full
`Qwen3OmniMoeForConditionalGeneration` written with `save_pretrained`, its `talker.*` tensors
loaded by name. fp32 on CPU: logits within 1e-4, greedy frames (all G codes) equal to
`talker.generate(..., do_sample=False)`'s, and the prefill built from the Thinker's states
equal to what HF's `generate(return_audio=True)` hands its Talker."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import Qwen3OmniMoeConfig, Qwen3OmniMoeForConditionalGeneration, WhisperFeatureExtractor  # noqa: E402

from omniwalk.engine.attention import PagedAttention, build_metadata  # noqa: E402
from omniwalk.engine.kv_cache import KVCacheShape, PagedKVCache  # noqa: E402
from omniwalk.engine.sampler import penalize_repetition  # noqa: E402
from omniwalk.layers.moe import SharedExpertMoeBlock  # noqa: E402
from omniwalk.models.loader import load_checkpoint_weights  # noqa: E402
from omniwalk.models.qwen3_omni.code_predictor import TopKTopPSampler, pick_greedy  # noqa: E402
from omniwalk.models.qwen3_omni.positions import prompt_positions  # noqa: E402
from omniwalk.models.qwen3_omni.talker import Talker  # noqa: E402
from omniwalk.models.qwen3_omni.talker_config import TalkerConfig, tiny_talker_config  # noqa: E402
from omniwalk.models.qwen3_omni.talker_prompt import (  # noqa: E402
    prompt_rows, talker_positions, talker_prompt, text_rows, trailing_id, user_turn_positions,
)

TOL = 1e-4
AUDIO, IMAGE, VIDEO, AUDIO_START, AUDIO_END, VISION_START, VISION_END = 290, 291, 292, 293, 295, 294, 296
IM_START, IM_END, USER, ASSISTANT, SYSTEM, NEWLINE = 280, 281, 282, 283, 284, 10
TTS_PAD, TTS_BOS, TTS_EOS = 285, 286, 287
CODEBOOK, GROUPS, HIDDEN = 64, 4, 32
CODEC = dict(codec_pad_id=CODEBOOK + 100, codec_bos_id=CODEBOOK + 101, codec_eos_token_id=CODEBOOK + 102,
             codec_nothink_id=CODEBOOK + 107, codec_think_bos_id=CODEBOOK + 108, codec_think_eos_id=CODEBOOK + 109)
SPEAKERS = {"chelsie": CODEBOOK + 253, "ethan": CODEBOOK + 254}
MEDIA = dict(audio_token_id=AUDIO, image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=VISION_START,
             audio_start_token_id=AUDIO_START, position_id_per_seconds=13)


def hf_config() -> Qwen3OmniMoeConfig:
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1], "interleaved": True}
    thinker = dict(
        audio_config=dict(num_mel_bins=16, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=32, d_model=16,
                          output_dim=HIDDEN, n_window=50, n_window_infer=200, downsample_hidden_size=8,
                          max_source_positions=100, conv_chunksize=50),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, patch_size=4,
                           spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=HIDDEN,
                           num_position_embeddings=16, deepstack_visual_indexes=[0]),
        text_config=dict(vocab_size=300, hidden_size=HIDDEN, intermediate_size=48, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, moe_intermediate_size=16,
                         num_experts=4, num_experts_per_tok=2, max_position_embeddings=512, rope_parameters=rope),
        audio_end_token_id=AUDIO_END, vision_end_token_id=VISION_END, **MEDIA)
    talker = dict(
        text_config=dict(vocab_size=CODEBOOK + 1024, hidden_size=HIDDEN, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, moe_intermediate_size=16,
                         shared_expert_intermediate_size=24, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
                         max_position_embeddings=512, rope_parameters=rope),
        code_predictor_config=dict(vocab_size=CODEBOOK, hidden_size=HIDDEN, intermediate_size=40, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_code_groups=GROUPS,
                                   max_position_embeddings=64,
                                   rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
        num_code_groups=GROUPS, thinker_hidden_size=HIDDEN, accept_hidden_layer=2, speaker_id=SPEAKERS,
        spatial_merge_size=2, **CODEC, **MEDIA)
    code2wav = dict(codebook_size=CODEBOOK, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                    num_key_value_heads=2, intermediate_size=32, num_quantizers=GROUPS, upsample_rates=[2, 2],
                    upsampling_ratios=[2], decoder_dim=16, sliding_window=8)
    return Qwen3OmniMoeConfig(
        thinker_config=thinker, talker_config=talker, code2wav_config=code2wav, im_start_token_id=IM_START,
        im_end_token_id=IM_END, tts_pad_token_id=TTS_PAD, tts_bos_token_id=TTS_BOS, tts_eos_token_id=TTS_EOS,
        system_token_id=SYSTEM, user_token_id=USER, assistant_token_id=ASSISTANT)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tensors of a few dozen rows: OpenMP's thread handoffs cost more than they save, and on a
    busy machine (a shared CI box) many times more."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, one_thread):
    torch.manual_seed(0)
    model = Qwen3OmniMoeForConditionalGeneration(hf_config()).eval()
    # HF's init leaves norms at 1, biases at 0 and logits nearly flat: give every parameter
    # a clear value so each one (and its name) matters and greedy picks are far from ties
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_((1.0 if "norm" in name else 0.0) + 0.1 * torch.randn(param.shape, generator=generator))
    folder = tmp_path_factory.mktemp("qwen3-omni")
    model.save_pretrained(folder)
    return folder, model


@pytest.fixture(scope="module")
def talker(checkpoint) -> Talker:
    folder, _ = checkpoint
    config = TalkerConfig.from_hf(json.loads((folder / "config.json").read_text()))
    talker = Talker(config).eval()
    # a full checkpoint: the Talker's tensors are `talker.*`, the Thinker's and Code2Wav's are not its
    load_checkpoint_weights(talker, folder, lambda name: name[len("talker."):] if name.startswith("talker.") else None)
    return talker


# ----------------------------------------------------------------------------- helpers


class TalkerSequence:
    """One sequence's paged KV cache and the calls of a generation loop over it."""

    def __init__(self, talker: Talker, max_tokens: int):
        text = talker.config.text
        shape = KVCacheShape(text.num_layers, text.num_kv_heads, text.head_dim, 16, -(-max_tokens // 16))
        self.cache = PagedKVCache(shape, torch.float32, "cpu")
        self.cache.reserve(0, max_tokens)
        self.talker, self.length = talker, 0

    def run(self, embeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        meta = build_metadata(self.cache, [0], [self.length], [embeds.shape[0]], "cpu")
        self.length += embeds.shape[0]
        return self.talker(embeds, positions, PagedAttention(self.cache, meta))


@torch.no_grad()
def reference_generate(talker: Talker, prefill: torch.Tensor, positions: torch.Tensor, trailing: torch.Tensor,
                       tts_pad: torch.Tensor, max_new_tokens: int, eos: int | None = None, suppress=(),
                       repetition_penalty: float = 1.0) -> tuple[list[int], list[list[int]]]:
    """The Talker's greedy loop as HF's `talker.generate`: (first codes, frames). A frame is the
    G codes of a token that was fed back; the last token (EOS, or the one at the cap) has none.

    prefill: [T, hidden]; positions: [T] or [3, T]; trailing: [S, hidden]; tts_pad: [hidden]."""
    sequence = TalkerSequence(talker, prefill.shape[0] + max_new_tokens)
    hidden = sequence.run(prefill, positions)[-1:]
    next_position = int(positions.max()) + 1
    tokens, frames = [], []
    for step in range(max_new_tokens):
        logits = talker.compute_logits(hidden)
        if tokens and repetition_penalty != 1.0:
            seen = torch.zeros_like(logits, dtype=torch.bool)
            seen[0, tokens] = True
            logits = penalize_repetition(logits, seen, torch.tensor(repetition_penalty))
        logits[:, list(suppress)] = -torch.inf
        code = logits.argmax(-1)
        tokens.append(int(code))
        if int(code) == eos or step == max_new_tokens - 1:
            break
        frame = talker.predict_frame(hidden, code)
        frames.append(frame.codes[0].tolist())
        text = trailing[step] if step < trailing.shape[0] else tts_pad
        hidden = sequence.run(frame.summed_embeds + text, torch.tensor([next_position + step]))
    return tokens, frames


def hf_frames(result) -> list[list[int]]:
    """The frames of HF's `talker.generate` output, as `Qwen3OmniMoeForConditionalGeneration.generate` reads them."""
    return [hid[-1][0].tolist() for hid in result.hidden_states if hid[-1] is not None]


def random_rows(n: int, seed: int, width: int = HIDDEN) -> torch.Tensor:
    return torch.randn(n, width, generator=torch.Generator().manual_seed(seed))


def clip(seconds: float = 1.2) -> np.ndarray:
    t = np.arange(int(16000 * seconds)) / 16000
    return (0.3 * np.sin(2 * np.pi * 330 * t)).astype(np.float32)


# ----------------------------------------------------------------------------- config


def test_config_from_a_real_checkpoint_config():
    """The shapes and ids of Qwen3-Omni-30B-A3B-Instruct's config.json (transformers 5 layout)."""
    hf = {
        "im_start_token_id": 151644, "assistant_token_id": 77091, "tts_pad_token_id": 151671,
        "talker_config": {
            "accept_hidden_layer": 24, "audio_token_id": 151675, "image_token_id": 151655, "video_token_id": 151656,
            "vision_start_token_id": 151652, "audio_start_token_id": 151669, "position_id_per_seconds": 13,
            "spatial_merge_size": 2, "codec_bos_id": 2149, "codec_eos_token_id": 2150, "codec_pad_id": 2148,
            "codec_nothink_id": 2155, "codec_think_bos_id": 2156, "codec_think_eos_id": 2157, "num_code_groups": 16,
            "thinker_hidden_size": 2048, "speaker_id": {"aiden": 2303, "chelsie": 2301, "ethan": 2302},
            "text_config": {
                "head_dim": 128, "hidden_act": "silu", "hidden_size": 1024, "intermediate_size": 2048,
                "max_position_embeddings": 65536, "mlp_only_layers": [], "moe_intermediate_size": 384,
                "norm_topk_prob": True, "num_attention_heads": 16, "num_experts_per_tok": 6, "num_hidden_layers": 20,
                "num_key_value_heads": 2, "num_local_experts": 128, "rms_norm_eps": 1e-06,
                "rope_parameters": {"interleaved": True, "mrope_section": [24, 20, 20], "rope_theta": 1000000,
                                    "rope_type": "default", "type": "default"},
                "shared_expert_intermediate_size": 768, "sliding_window": None, "use_sliding_window": False,
                "vocab_size": 3072},
            "code_predictor_config": {
                "head_dim": 128, "hidden_act": "silu", "hidden_size": 1024, "intermediate_size": 3072,
                "max_position_embeddings": 32768, "num_attention_heads": 16, "num_code_groups": 16,
                "num_hidden_layers": 5, "num_key_value_heads": 8, "rms_norm_eps": 1e-06,
                "rope_parameters": {"rope_theta": 1000000, "rope_type": "default"}, "vocab_size": 2048},
        },
    }
    config = TalkerConfig.from_hf(hf)
    text = config.text
    assert (text.num_layers, text.hidden_size, text.head_dim, text.num_kv_heads) == (20, 1024, 128, 2)
    assert (config.num_experts, config.num_experts_per_tok, config.shared_expert_intermediate_size) == (128, 6, 768)
    assert config.mrope_section == (24, 20, 20) and config.text.rope_theta == 1e6
    assert config.code_predictor.decoder.num_layers == 5 and config.code_predictor.decoder.vocab_size == 2048
    assert config.num_code_groups == 16 and config.accept_hidden_layer == 24 and config.thinker_hidden_size == 2048
    assert config.codec.eos == 2150 and config.speaker_id("Ethan") == 2302
    assert config.prompt.assistant == 77091 and config.prompt.user == 872     # top level, or Qwen3-Omni's default
    # only the codebook (2048 codes) and codec EOS can be the first code of a frame
    allowed = set(range(3072)) - set(config.suppressed_codec_ids)
    assert allowed == set(range(2048)) | {2150}
    with pytest.raises(KeyError, match="aiden"):
        config.speaker_id("nobody")


def test_tiny_config_builds():
    talker = Talker(tiny_talker_config())
    assert talker.code_predictor.config.num_code_groups == 4
    assert set(range(talker.config.text.vocab_size)) - set(talker.config.suppressed_codec_ids) == set(range(64)) | {166}


# ----------------------------------------------------------------------------- forward parity


@torch.no_grad()
def test_shared_expert_block_matches_transformers(checkpoint):
    _, model = checkpoint
    hf_block = model.talker.model.layers[0].mlp
    config = model.config.talker_config.text_config
    ours = SharedExpertMoeBlock(HIDDEN, 16, 4, 2, True, config.shared_expert_intermediate_size)
    state = {name: t for name, t in hf_block.state_dict().items() if "shared_expert." not in name}
    shared = hf_block.shared_expert
    state["shared_expert.gate_up_proj.weight"] = torch.cat((shared.gate_proj.weight, shared.up_proj.weight))
    state["shared_expert.down_proj.weight"] = shared.down_proj.weight
    ours.load_state_dict(state)
    x = random_rows(7, 3)
    torch.testing.assert_close(ours(x), hf_block(x[None])[0], atol=1e-5, rtol=0)


@torch.no_grad()
def test_talker_logits_match_transformers(checkpoint, talker):
    _, model = checkpoint
    embeds = random_rows(11, 4)
    expected = model.talker(inputs_embeds=embeds[None], use_cache=False).logits[0]
    got = talker.compute_logits(TalkerSequence(talker, 11).run(embeds, torch.arange(11)))
    torch.testing.assert_close(got, expected, atol=TOL, rtol=0)


@torch.no_grad()
def test_talker_logits_with_image_positions_match_transformers(checkpoint, talker):
    """A prompt with an image: (t, h, w) positions, from the Talker's rope ids as HF computes them."""
    _, model = checkpoint
    rope_ids = [IM_START, USER, NEWLINE, VISION_START] + [IMAGE] * 6 + [VISION_END, 7, IM_END] + [TTS_PAD] * 9
    grid_thw = torch.tensor([[1, 4, 6]])                        # 1 x 2 x 3 merged patches
    expected_positions, _ = model.talker.get_rope_index(torch.tensor([rope_ids]), grid_thw, None,
                                                        torch.ones(1, len(rope_ids), dtype=torch.long))
    positions = prompt_positions(rope_ids, IMAGE, [(1, 2, 3)], 13)
    assert np.array_equal(positions.rope, expected_positions[:, 0].long().numpy())
    embeds = random_rows(len(rope_ids), 5)
    expected = model.talker(inputs_embeds=embeds[None], position_ids=expected_positions.long(),
                            use_cache=False).logits[0]
    got = talker.compute_logits(TalkerSequence(talker, len(rope_ids)).run(embeds, torch.from_numpy(positions.rope)))
    torch.testing.assert_close(got, expected, atol=TOL, rtol=0)


@torch.no_grad()
def test_a_ragged_batch_equals_each_sequence_alone(talker):
    """Two prefills in one flat pass (5 and 3 rows) through the paged cache, as the engine batches them."""
    text = talker.config.text
    cache = PagedKVCache(KVCacheShape(text.num_layers, text.num_kv_heads, text.head_dim, 16, 2), torch.float32, "cpu")
    cache.reserve(0, 5)
    cache.reserve(1, 3)
    embeds = random_rows(8, 13)
    positions = torch.cat((torch.arange(5), torch.arange(3)))
    together = talker(embeds, positions, PagedAttention(cache, build_metadata(cache, [0, 1], [0, 0], [5, 3], "cpu")))
    first = TalkerSequence(talker, 5).run(embeds[:5], torch.arange(5))
    second = TalkerSequence(talker, 3).run(embeds[5:], torch.arange(3))
    torch.testing.assert_close(together, torch.cat((first, second)), atol=1e-6, rtol=0)


@torch.no_grad()
def test_code_predictor_logits_match_transformers(checkpoint, talker):
    """Every step's logits (head g on the hidden state at position g) against HF's code
    predictor run over the whole frame sequence at once."""
    _, model = checkpoint
    hf_predictor = model.talker.code_predictor
    last_hidden, first_code = random_rows(3, 6), torch.tensor([5, 17, 40])
    frame = talker.predict_frame(last_hidden, first_code, pick=recording_picker(logged := []))
    sequence = [last_hidden, talker.embed_codes(first_code)]
    sequence += [talker.code_predictor.embed_codes(frame.codes[:, g], g) for g in range(1, GROUPS - 1)]
    hidden = hf_predictor.model(inputs_embeds=torch.stack(sequence, 1), use_cache=False).last_hidden_state
    for group, logits in enumerate(logged, start=1):
        torch.testing.assert_close(logits, hf_predictor.lm_head[group - 1](hidden[:, group]), atol=TOL, rtol=0)


def recording_picker(logged: list):
    def pick(logits, group):
        logged.append(logits)
        return pick_greedy(logits, group)
    return pick


@torch.no_grad()
def test_frame_matches_transformers_code_predictor_generate(checkpoint, talker):
    """The residual loop as HF's Talker drives it: `code_predictor.generate` from [talker
    hidden, embedding of the first code], and the summed embedding of all G codes."""
    _, model = checkpoint
    last_hidden, first_code = random_rows(3, 7), torch.tensor([3, 60, 21])
    first_embed = model.talker.get_input_embeddings()(first_code)[:, None]
    model.talker.code_predictor.generation_config.do_sample = False
    result = model.talker.code_predictor.generate(
        inputs_embeds=torch.cat((last_hidden[:, None], first_embed), 1), max_new_tokens=GROUPS - 1, do_sample=False,
        output_hidden_states=True, return_dict_in_generate=True)
    mids = [hid[0] for hid in result.hidden_states[1:]]
    last = model.talker.code_predictor.get_input_embeddings()[-1](result.sequences[..., -1:])
    expected_sum = torch.cat([first_embed] + mids + [last], 1).sum(1)
    frame = talker.predict_frame(last_hidden, first_code)
    assert frame.codes[:, 1:].tolist() == result.sequences.tolist()
    assert frame.codes[:, 0].tolist() == first_code.tolist()
    torch.testing.assert_close(frame.summed_embeds, expected_sum, atol=1e-5, rtol=0)


@torch.no_grad()
def test_frames_of_a_batch_equal_each_alone(talker):
    last_hidden, first_code = random_rows(4, 8), torch.tensor([1, 2, 3, 4])
    together = talker.predict_frame(last_hidden, first_code)
    for row in range(4):
        alone = talker.predict_frame(last_hidden[row : row + 1], first_code[row : row + 1])
        assert alone.codes.tolist() == together.codes[row : row + 1].tolist()
        torch.testing.assert_close(alone.summed_embeds, together.summed_embeds[row : row + 1], atol=1e-6, rtol=0)


@torch.no_grad()
def test_sampled_frames_follow_the_generator(talker):
    last_hidden, first_code = random_rows(2, 9), torch.tensor([7, 8])
    def draw(seed: int):
        sampler = TopKTopPSampler(top_k=5, top_p=0.9, generator=torch.Generator().manual_seed(seed))
        return talker.predict_frame(last_hidden, first_code, pick=sampler)

    assert draw(1).codes.tolist() == draw(1).codes.tolist()
    assert len({tuple(draw(seed).codes.flatten().tolist()) for seed in range(6)}) > 1
    greedy = talker.predict_frame(last_hidden, first_code).codes
    top1 = talker.predict_frame(last_hidden, first_code, pick=TopKTopPSampler(top_k=1)).codes
    assert top1.tolist() == greedy.tolist()


def assert_residual_graphs_match_sampler(talker, graphs, last_hidden, first_code, seeds, steps):
    from omniwalk.engine.sampler import Sampler, SamplingParams
    from omniwalk.models.qwen3_omni.residual_graphs import residual_settings

    sampler, groups, n = Sampler(), talker.config.num_code_groups, len(seeds)
    frames = []
    for talker_params in ([SamplingParams(temperature=0.9), SamplingParams(temperature=0.0), SamplingParams()],
                          [SamplingParams(temperature=0.0)] * 3):
        settings = residual_settings(talker_params)

        def pick(logits, group, settings=settings):
            return sampler(logits, settings, seeds, [s * groups + group for s in steps], [[]] * n, [[]] * n).token_ids

        expected = talker.predict_frame(last_hidden, first_code, pick)
        got = graphs.run(last_hidden, first_code, talker_params, seeds, steps)
        assert got.codes.tolist() == expected.codes.tolist()
        torch.testing.assert_close(got.summed_embeds, expected.summed_embeds, atol=0, rtol=0)
        frames.append(got.codes)
    sampled, greedy = frames
    assert sampled[1].tolist() == greedy[1].tolist() and sampled[0].tolist() != greedy[0].tolist()


@torch.no_grad()
def test_residual_graphs_pick_the_codes_the_engine_sampler_picks(talker):
    # the code predictor's loop as `ResidualGraphs` runs it (static buffers, `sample_rows`;
    # eager here, captured on CUDA) against the loop with the engine's `Sampler` picking each
    # group: a batch of 3 in the bucket of 4, greedy and sampled rows mixed, then all greedy
    from omniwalk.engine.sampler import SamplingParams
    from omniwalk.models.qwen3_omni.residual_graphs import ResidualGraphs

    graphs = ResidualGraphs(talker, 8, torch.device("cpu"), torch.float32)
    last_hidden, first_code = random_rows(3, 10), torch.tensor([3, 1, 4])
    seeds, steps, groups = [11, 12, 13], [0, 5, 9], talker.config.num_code_groups
    assert_residual_graphs_match_sampler(talker, graphs, last_hidden, first_code, seeds, steps)
    # another seed draws other sampled codes; the greedy row keeps its own
    redrawn = graphs.run(last_hidden, first_code, [SamplingParams(temperature=0.9)] * 2 + [SamplingParams(temperature=0.0)],
                         [99, 98, 13], steps)
    alone = graphs.run(last_hidden[2:], first_code[2:], [SamplingParams(temperature=0.0)], [13], steps[2:])
    assert redrawn.codes[2].tolist() == alone.codes[0].tolist()


@pytest.mark.gpu
@torch.no_grad()
def test_residual_graphs_on_cuda_replay_the_eager_loop(talker):
    # captured (per plan and bucket) on CUDA: the same codes as the eager loop on CUDA
    import copy

    from omniwalk.models.qwen3_omni.residual_graphs import ResidualGraphs

    cuda_talker = copy.deepcopy(talker).cuda()
    graphs = ResidualGraphs(cuda_talker, 8, torch.device("cuda"), torch.float32)
    assert len(graphs.graphs) == 2 * len(graphs.sizes)
    assert_residual_graphs_match_sampler(cuda_talker, graphs, random_rows(3, 10).cuda(),
                                         torch.tensor([3, 1, 4], device="cuda"), [11, 12, 13], [0, 5, 9])


# ----------------------------------------------------------------------------- generation parity


@torch.no_grad()
def test_greedy_frames_match_transformers_generate(checkpoint, talker):
    """Random prefill rows and text rows: HF's `talker.generate(do_sample=False)` frames,
    text rows running out (tts_pad past them) included."""
    _, model = checkpoint
    prefill, trailing, tts_pad = random_rows(9, 10), random_rows(3, 11), random_rows(1, 12)[0]
    model.talker.code_predictor.generation_config.do_sample = False
    result = model.talker.generate(
        inputs_embeds=prefill[None], trailing_text_hidden=trailing[None], tts_pad_embed=tts_pad[None, None],
        attention_mask=torch.ones(1, 9, dtype=torch.long), max_new_tokens=7, do_sample=False,
        output_hidden_states=True, return_dict_in_generate=True)
    tokens, frames = reference_generate(talker, prefill, torch.arange(9), trailing, tts_pad, max_new_tokens=7)
    assert tokens == result.sequences[0].tolist()
    assert frames == hf_frames(result) and len(frames) == 6


class Captured(Exception):
    pass


def captured_talker_call(model, input_ids: torch.Tensor, media: dict, thinker_eos: int) -> dict:
    """The keyword arguments HF's `generate(return_audio=True, talker_do_sample=False)` calls
    `talker.generate` with (the call is stopped there)."""
    captured = {}

    def capture(**kwargs):
        captured.update(kwargs)
        raise Captured

    model.talker.generate, original = capture, model.talker.generate
    try:
        with pytest.raises(Captured):
            model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), return_audio=True,
                           speaker="Ethan", thinker_max_new_tokens=8, thinker_eos_token_id=thinker_eos,
                           talker_do_sample=False, **media)
    finally:
        model.talker.generate = original
    return captured


@pytest.fixture(scope="module")
def hf_talker_inputs(checkpoint):
    """What HF's full `generate(return_audio=True)` hands its Talker for a system + user (text
    and audio) prompt, and the Thinker's outputs it built them from."""
    _, model = checkpoint
    features = WhisperFeatureExtractor(feature_size=16)([clip()], sampling_rate=16000, return_attention_mask=True,
                                                        return_tensors="pt")
    from transformers.models.qwen3_omni_moe.processing_qwen3_omni_moe import _get_feat_extract_output_lengths
    audio_len = int(_get_feat_extract_output_lengths(features["attention_mask"].sum(-1), 50))
    ids = ([IM_START, SYSTEM, NEWLINE, 5, 6, IM_END, NEWLINE, IM_START, USER, NEWLINE, 7, AUDIO_START]
           + [AUDIO] * audio_len + [AUDIO_END, 8, 9, IM_END, NEWLINE, IM_START, ASSISTANT, NEWLINE])
    input_ids = torch.tensor([ids])
    media = dict(input_features=features["input_features"], feature_attention_mask=features["attention_mask"])
    with torch.no_grad():
        captured = captured_talker_call(model, input_ids, media, IM_END)
        sequence = model.thinker.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                                          max_new_tokens=8, eos_token_id=IM_END, do_sample=False, **media)[0].tolist()
        # the Thinker's hidden states over its prompt (its prefill), as HF's generate read them
        thinker_pass = model.thinker(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                                     output_hidden_states=True, **media)
    return dict(captured=captured, sequence=sequence, prompt_len=len(ids), input_ids=input_ids, media=media,
                accept_hidden=thinker_pass.hidden_states[model.config.talker_config.accept_hidden_layer][0])


def trailing_rows(talker, embed_tokens, prompt) -> torch.Tensor:
    """The text rows of a prompt's decode steps until its tts_eos."""
    ids = [trailing_id(prompt.trailing_ids, step, talker.config.prompt) for step in range(len(prompt.trailing_ids) + 1)]
    return text_rows(talker, embed_tokens, ids)


@torch.no_grad()
def test_prefill_built_from_the_thinker_matches_transformers(checkpoint, talker, hf_talker_inputs):
    """The reply here was cut by its budget: transformers' Talker never reads its last token
    (its Thinker never embedded it), where omniwalk's speaks it; with that token left out the
    decode steps' text rows are transformers'."""
    _, model = checkpoint
    captured, sequence = hf_talker_inputs["captured"], hf_talker_inputs["sequence"]
    prompt_len = hf_talker_inputs["prompt_len"]
    embed_tokens = model.thinker.get_input_embeddings()
    reply = sequence[prompt_len:]
    prompt = talker_prompt(sequence[:prompt_len], reply[:-1], talker.config.speaker_id("ethan"), talker.config)
    media = [row for row, token in enumerate(sequence[:prompt_len]) if token == AUDIO]
    assert user_turn_positions(sequence[:prompt_len], talker.config.prompt) == list(range(7, prompt_len - 3))
    assert list(prompt.media_positions) == media
    assert list(prompt.rope_ids) == captured["talker_input_ids"][0].tolist()
    rows = prompt_rows(talker, embed_tokens, prompt, hf_talker_inputs["accept_hidden"][media])
    torch.testing.assert_close(rows, captured["inputs_embeds"][0], atol=1e-5, rtol=0)
    torch.testing.assert_close(trailing_rows(talker, embed_tokens, prompt), captured["trailing_text_hidden"][0],
                               atol=1e-5, rtol=0)
    pad = text_rows(talker, embed_tokens, [trailing_id(prompt.trailing_ids, 10 ** 6, talker.config.prompt)])[0]
    torch.testing.assert_close(pad, captured["tts_pad_embed"][0, 0], atol=1e-5, rtol=0)
    assert talker_positions(talker.config, prompt).rope is None     # no image: row i at position i


@torch.no_grad()
def test_trailing_text_of_a_reply_that_stopped_matches_transformers(checkpoint, talker, hf_talker_inputs):
    """The Thinker stops at its third reply token: r1 then tts_eos (the stop token, which the
    client's answer does not carry either, never reaches the Talker)."""
    _, model = checkpoint
    sequence, prompt_len = hf_talker_inputs["sequence"], hf_talker_inputs["prompt_len"]
    reply = sequence[prompt_len:]
    stop = reply[2]
    assert stop not in reply[:2], "the random Thinker's reply repeats early: pick another stop token"
    captured = captured_talker_call(model, hf_talker_inputs["input_ids"], hf_talker_inputs["media"], stop)
    embed_tokens = model.thinker.get_input_embeddings()
    prompt = talker_prompt(sequence[:prompt_len], reply[:2], talker.config.speaker_id("ethan"), talker.config)
    expected = trailing_rows(talker, embed_tokens, prompt)
    assert expected.shape[0] == 2
    torch.testing.assert_close(expected, captured["trailing_text_hidden"][0], atol=1e-5, rtol=0)


@pytest.mark.filterwarnings("ignore:Passing `repetition_penalty` with `inputs_embeds`")   # as HF's own call
@torch.no_grad()
def test_greedy_speech_matches_transformers_from_thinker_inputs(checkpoint, talker, hf_talker_inputs):
    """HF's Talker call as `generate(return_audio=True, talker_do_sample=False)` makes it (repetition
    penalty 1.05, the codec's special ids suppressed but EOS), against the reference loop."""
    _, model = checkpoint
    captured = dict(hf_talker_inputs["captured"], max_new_tokens=12)
    model.talker.code_predictor.generation_config.do_sample = False
    result = model.talker.generate(**captured)
    tokens, frames = reference_generate(
        talker, captured["inputs_embeds"][0], torch.arange(captured["inputs_embeds"].shape[1]),
        captured["trailing_text_hidden"][0], captured["tts_pad_embed"][0, 0], max_new_tokens=12,
        eos=talker.config.codec.eos, suppress=talker.config.suppressed_codec_ids, repetition_penalty=1.05)
    assert tokens == result.sequences[0].tolist()
    assert frames == hf_frames(result)
    assert tokens[-1] == talker.config.codec.eos and len(frames) == len(tokens) - 1 >= 3   # a few frames, then EOS
    assert all(code < CODEBOOK for frame in frames for code in frame)
