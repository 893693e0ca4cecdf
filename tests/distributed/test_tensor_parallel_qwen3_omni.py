"""Qwen3-Omni at tensor parallel size 2 on the CPU over gloo (issue 27): the Thinker's
language model split (attention by heads, experts by their intermediate dimension, the
vocabulary), its encoders, the Talker and Code2Wav whole on every rank. Two ranks through
`Engine` give the text ids of one device (text, audio and image prompts) and a spoken answer's
ids and audio bytes, and transformers' greedy ids on a checkpoint it saved (loaded by name,
each rank keeping its slice); the sizes it refuses. One engine per mode for the module; the layers
themselves: tp_layer_rank.py (test_tensor_parallel.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from omni_speech import ARGS, GREEDY, chat, speak
from pids import alive
from same_generations import assert_same_generations

from omniwalk.api import Engine
from omniwalk.capabilities import Capability
from omniwalk.capabilities.media import AudioInput, ImageInput
from omniwalk.capabilities.text import GenerationRequest, collect_generation
from omniwalk.engine.sampler import SamplingParams
from omniwalk.loading import EngineArgs, read_model
from omniwalk.models.qwen3_omni.config import check_tensor_parallel_split
from omniwalk.tensor_parallel_ranks import CHECK_OUTPUTS_ENV

MODEL = "tiny-qwen3-omni"
CLIP = np.sin(np.arange(16000 * 2) * 0.05).astype(np.float32) * 0.3   # 2 s at 16 kHz
PICTURE = np.random.default_rng(1).integers(0, 256, (32, 48, 3), dtype=np.uint8)


def text_requests(engine: Engine) -> list[GenerationRequest]:
    """Greedy answers to text (with logprobs), an audio clip, an image; a one-token budget;
    a seeded sampled one."""
    markers = engine.frontend(Capability.TEXT).media_markers
    return [GenerationRequest(prompt=chat(engine, "Hello there"), max_tokens=9, ignore_eos=True,
                              sampling=SamplingParams(temperature=0.0, logprobs=3)),
            GenerationRequest(prompt=chat(engine, f"{markers['audio']}What is said?"), max_tokens=7,
                              ignore_eos=True, sampling=GREEDY, media=(AudioInput(CLIP, "clip"),)),
            GenerationRequest(prompt=chat(engine, f"{markers['image']}Describe it"), max_tokens=5, ignore_eos=True,
                              sampling=GREEDY, media=(ImageInput(PICTURE, "picture"),)),
            GenerationRequest(prompt="Hi", max_tokens=1, ignore_eos=True, sampling=GREEDY),
            GenerationRequest(prompt="Sampled, seeded", max_tokens=6, ignore_eos=True,
                              sampling=SamplingParams(temperature=1.0, top_p=0.9, seed=7))]


def answer(engine: Engine) -> list:
    """(ids, finish reason, usage, logprobs) of each text request, one at a time (the same
    batches on one device and on two ranks)."""
    return [(r.token_ids, r.finish_reason, r.usage, r.logprobs)
            for r in (collect_generation(engine.submit(request)) for request in text_requests(engine))]


@pytest.fixture(scope="module")
def one_device() -> tuple[list, list]:
    """What one process answers and says: the reference."""
    with Engine(EngineArgs(MODEL, **ARGS)) as one:
        return answer(one), speak(one)


@pytest.fixture(scope="module")
def two_ranks():
    """The engine process as rank 0 of two; every rank's outputs checked against rank 0's,
    step by step (a rank that samples another id fails the step)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(CHECK_OUTPUTS_ENV, "1")
        engine = Engine(EngineArgs(MODEL, engine_process=True, tensor_parallel_size=2, **ARGS))
    try:
        yield engine
    finally:
        engine.shutdown()
    assert not any(alive(pid) for pid in (engine.engine_pid, *engine.rank_pids))


def split_shapes(runtime) -> tuple:   # run in the engine process by Engine.inspect
    """What rank 0 holds of the Thinker's first layer (split), its LM head, its KV cache, and
    of the Talker's first layer (whole), with the Talker's config sizes."""
    thinker = runtime.model.executors["thinker"].model
    layer = thinker.model.layers[0]
    talker = runtime.model.executors["talker"].talker
    talker_layer = talker.model.layers[0]
    return ((layer.self_attn.num_heads, tuple(layer.mlp.experts.gate_up_proj.shape),
             tuple(thinker.lm_head.weight.shape), runtime.model.cache.shape.num_kv_heads),
            (talker_layer.self_attn.num_heads, talker_layer.mlp.experts.gate_up_proj.shape[1],
             talker_layer.mlp.shared_expert.gate_up_proj.weight.shape[0]),
            (talker.config.text.num_heads, 2 * talker.config.moe_intermediate_size,
             2 * talker.config.shared_expert_intermediate_size))


def test_the_thinker_is_split_and_the_talker_is_whole(two_ranks):
    (rank,) = two_ranks.rank_pids
    assert alive(rank)
    thinker, talker, talker_config = two_ranks.inspect(split_shapes)
    # 4 heads, 2 KV heads, experts of 32 rows (gate + up: 64), 522 ids: half of each on rank 0
    assert thinker == (2, (4, 32, 64), (261, 64), 1)
    assert talker == talker_config


def test_two_ranks_give_the_text_ids_of_one(one_device, two_ranks):
    expected, _ = one_device
    got = answer(two_ranks)
    assert_same_generations(got, expected)
    assert [len(ids) for ids, *_ in got] == [9, 7, 5, 1, 6]   # exact budgets
    assert len(got[0][3]) == 9 and None not in got[0][3]   # the request that asked has logprobs at every step


def test_two_ranks_speak_the_ids_and_audio_bytes_of_one(one_device, two_ranks):
    _, expected = one_device
    got = speak(two_ranks)
    assert got == expected
    assert [len(ids) for ids, *_ in got] == [6, 3, 2] and all(audio for _, audio, *_ in got)
    assert got[0][3].audio_frames == 10 and len(got[0][1]) == 2 * (10 * 96 - 32)


def test_sizes_that_do_not_split_are_refused():
    config = read_model(EngineArgs(MODEL)).config
    check_tensor_parallel_split(config, 2)
    with pytest.raises(ValueError, match=r"tensor parallel size 4 does not divide the Thinker's num_kv_heads \(2\), "
                                         r"vocab_size \(522\)"):
        check_tensor_parallel_split(config, 4)
    with pytest.raises(ValueError, match=r"tensor parallel size 3 does not divide the Thinker's num_heads \(4\), "
                                         r"num_kv_heads \(2\), moe_intermediate_size \(32\): each rank must hold"):
        Engine(EngineArgs(MODEL, engine_process=True, tensor_parallel_size=3))   # before any process starts


@pytest.fixture(scope="module")
def hf_thinker(tmp_path_factory):
    """A tiny random Qwen3OmniMoeThinkerForConditionalGeneration written with save_pretrained
    (one tensor per expert and projection; a dense layer among the sparse ones); norms and
    router perturbed and the experts' weights scaled up, so that every expert and norm
    matters and greedy ids vary."""
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen3OmniMoeThinkerConfig(
        audio_config=dict(num_mel_bins=16, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=32,
                          d_model=16, output_dim=32, n_window=50, n_window_infer=200, downsample_hidden_size=8,
                          max_source_positions=100, conv_chunksize=50),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, patch_size=4,
                           spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=32,
                           num_position_embeddings=16, deepstack_visual_indexes=[0]),
        text_config=dict(vocab_size=300, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, moe_intermediate_size=16,
                         num_experts=4, num_experts_per_tok=2, mlp_only_layers=[1], max_position_embeddings=512,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1],
                                          "mrope_interleaved": True}),
        audio_token_id=290, image_token_id=291, video_token_id=292, audio_start_token_id=293,
        vision_start_token_id=294, audio_end_token_id=295, vision_end_token_id=296)
    torch.manual_seed(0)
    model = transformers.Qwen3OmniMoeThinkerForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or "gate.weight" in name:
                param.add_(torch.randn_like(param) * 0.3)
            elif ".mlp.experts." in name:   # the experts' rows large enough to decide the ids
                param.mul_(10.0)
    folder = tmp_path_factory.mktemp("qwen3-omni-thinker-tp")
    model.save_pretrained(folder)
    return folder, model


def test_two_ranks_give_transformers_greedy_ids_on_its_checkpoint(hf_thinker, monkeypatch):
    folder, model = hf_thinker
    prompt = [5, 17, 42, 9, 100, 7, 250, 31]
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=12, do_sample=False)
    expected = out[0, len(prompt):].tolist()
    monkeypatch.setenv(CHECK_OUTPUTS_ENV, "1")
    with Engine(EngineArgs(str(folder), engine_process=True, tensor_parallel_size=2, device="cpu", dtype="float32",
                           max_model_len=512)) as engine:
        got = collect_generation(engine.submit(GenerationRequest(prompt_token_ids=prompt, max_tokens=12,
                                                                 sampling=GREEDY)))
    assert got.token_ids == expected
    assert len(expected) == 12 and len(set(expected)) > 3   # not one id repeated
