"""Qwen3-Omni's Thinker against transformers: a tiny random checkpoint written with
`save_pretrained`, loaded by omniwalk; greedy ids equal `generate`'s for text, audio + text,
image + text and audio + image + text prompts; logprobs within 1e-4 (fp32); budgets;
mixed batches; a bad item fails alone; prefix caching keyed by media content."""

from __future__ import annotations

import io
import json

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import (  # noqa: E402
    Qwen2VLImageProcessorPil, Qwen3OmniMoeThinkerConfig, Qwen3OmniMoeThinkerForConditionalGeneration,
    WhisperFeatureExtractor,
)

from omniwalk import Engine, EngineArgs  # noqa: E402
from omniwalk.capabilities.media import AudioInput, ImageInput  # noqa: E402
from omniwalk.capabilities.text import GenerationRequest, collect_generation  # noqa: E402
from omniwalk.engine.sampler import SamplingParams  # noqa: E402
from omniwalk.models.qwen3_omni.positions import prompt_positions  # noqa: E402

AUDIO, IMAGE, AUDIO_START, AUDIO_END, VISION_START, VISION_END = 290, 291, 293, 295, 294, 296
PATCH, MERGE, TEMPORAL = 4, 2, 2
MIN_PIXELS, MAX_PIXELS = 8 * 8, 32 * 32
MELS = 16


def hf_config() -> Qwen3OmniMoeThinkerConfig:
    return Qwen3OmniMoeThinkerConfig(
        audio_config=dict(num_mel_bins=MELS, encoder_layers=2, encoder_attention_heads=2, encoder_ffn_dim=32,
                          d_model=16, output_dim=32, n_window=50, n_window_infer=200, downsample_hidden_size=8,
                          max_source_positions=100, conv_chunksize=50),
        vision_config=dict(depth=3, hidden_size=16, intermediate_size=32, num_heads=2, in_channels=3,
                           patch_size=PATCH, spatial_merge_size=MERGE, temporal_patch_size=TEMPORAL,
                           out_hidden_size=32, num_position_embeddings=16, deepstack_visual_indexes=[0, 2]),
        text_config=dict(vocab_size=300, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, moe_intermediate_size=16,
                         num_experts=4, num_experts_per_tok=2, mlp_only_layers=[1], max_position_embeddings=512,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 1, 1],
                                          "mrope_interleaved": True}),
        audio_token_id=AUDIO, image_token_id=IMAGE, video_token_id=292, audio_start_token_id=AUDIO_START,
        vision_start_token_id=VISION_START, position_id_per_seconds=13,
        audio_end_token_id=AUDIO_END, vision_end_token_id=VISION_END)   # kept in config.json as the real one has them


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    torch.manual_seed(0)
    model = Qwen3OmniMoeThinkerForConditionalGeneration(hf_config()).eval()
    # random init leaves norms at 1 and the router near uniform: perturb them so every
    # expert and norm matters
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or "gate.weight" in name:
                param.add_(torch.randn_like(param) * 0.3)
    folder = tmp_path_factory.mktemp("qwen3-omni-thinker")
    model.save_pretrained(folder)
    (folder / "preprocessor_config.json").write_text(json.dumps(PREPROCESSING | {"feature_size": MELS}))
    return folder, model


@pytest.fixture(scope="module")
def engine(checkpoint):
    folder, _ = checkpoint
    with Engine(EngineArgs(str(folder), dtype="float32", device="cpu", max_model_len=512)) as engine:
        yield engine


PREPROCESSING = dict(patch_size=PATCH, merge_size=MERGE, temporal_patch_size=TEMPORAL, min_pixels=MIN_PIXELS,
                     max_pixels=MAX_PIXELS, image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])


def image_processor():
    return Qwen2VLImageProcessorPil(**PREPROCESSING)


def image(seed: int, height: int = 20, width: int = 28) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


def clip(seed: int, seconds: float = 2.3) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(int(16000 * seconds)) / 16000
    return (0.3 * np.sin(2 * np.pi * (200 + 50 * seed) * t) + 0.05 * rng.standard_normal(t.size)).astype(np.float32)


def hf_inputs(text_ids: list[int], images=(), clips=()):
    """HF's inputs: each single placeholder expanded as the HF processor expands it."""
    kwargs, grids, lengths = {}, [], []
    if images:
        out = image_processor()(list(images), return_tensors="pt")
        kwargs.update(pixel_values=out["pixel_values"], image_grid_thw=out["image_grid_thw"])
        grids = [int(g.prod()) // MERGE ** 2 for g in out["image_grid_thw"]]
    if clips:
        out = WhisperFeatureExtractor(feature_size=MELS)(list(clips), sampling_rate=16000, padding=True,
                                                          truncation=False, return_attention_mask=True,
                                                          return_tensors="pt")
        kwargs.update(input_features=out["input_features"], feature_attention_mask=out["attention_mask"])
        from transformers.models.qwen3_omni_moe.processing_qwen3_omni_moe import _get_feat_extract_output_lengths
        lengths = [int(_get_feat_extract_output_lengths(n, 50)) for n in out["attention_mask"].sum(-1)]
    ids, grids, lengths = [], iter(grids), iter(lengths)
    for token in text_ids:
        ids += [token] * (next(grids) if token == IMAGE else next(lengths) if token == AUDIO else 1)
    return torch.tensor([ids]), kwargs


def hf_generate(model, text_ids, images=(), clips=(), n=8):
    input_ids, kwargs = hf_inputs(text_ids, images, clips)
    out = model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=n,
                         do_sample=False, **kwargs)
    return out[0, input_ids.shape[1]:].tolist()


def ours(engine, text_ids, images=(), clips=(), n=8, **kw):
    media = [ImageInput(img, f"image {i}") for i, img in enumerate(images)]
    media += [AudioInput(c, f"audio {i}") for i, c in enumerate(clips)]
    return collect_generation(engine.submit(GenerationRequest(prompt_token_ids=text_ids, max_tokens=n,
                                                              media=tuple(media), **kw)))


TEXT = [5, 17, 42, 9, 100, 7]
WITH_AUDIO = [5, 17, AUDIO_START, AUDIO, AUDIO_END, 42, 9]
WITH_IMAGE = [5, VISION_START, IMAGE, VISION_END, 17, 42, 9]
WITH_BOTH = [5, AUDIO_START, AUDIO, AUDIO_END, 8, VISION_START, IMAGE, VISION_END, 17, VISION_START, IMAGE,
             VISION_END, 42]

CASES = {
    "text": (TEXT, (), ()),
    "audio": (WITH_AUDIO, (), (clip(1),)),
    "image": (WITH_IMAGE, (image(1),), ()),
    "audio+images": (WITH_BOTH, (image(2), image(3, 32, 16)), (clip(2, 3.7),)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_ids_match_transformers(engine, checkpoint, case):
    _, model = checkpoint
    ids, images, clips = CASES[case]
    expected = hf_generate(model, ids, images, clips, n=12)
    result = ours(engine, ids, images, clips, n=12)
    assert result.token_ids == expected
    assert result.finish_reason == "length"


def test_logprobs_match_transformers(engine, checkpoint):
    _, model = checkpoint
    ids, images, clips = CASES["audio+images"]
    input_ids, kwargs = hf_inputs(ids, images, clips)
    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), **kwargs).logits[0, -1]
    expected = torch.log_softmax(logits.float(), -1)
    result = ours(engine, ids, images, clips, n=1, sampling=SamplingParams(temperature=0.0, logprobs=3))
    token = result.token_ids[0]
    assert token == int(expected.argmax())
    assert abs(result.logprobs[0].logprob - float(expected[token])) < 1e-4


def test_positions_match_transformers(checkpoint):
    _, model = checkpoint
    ids, images, clips = CASES["audio+images"]
    input_ids, kwargs = hf_inputs(ids, images, clips)
    expected, delta = model.get_rope_index(input_ids, kwargs["image_grid_thw"], None, torch.ones_like(input_ids),
                                           False, kwargs["feature_attention_mask"].sum(-1))
    grids = [(int(t), int(h) // MERGE, int(w) // MERGE) for t, h, w in kwargs["image_grid_thw"]]
    got = prompt_positions(input_ids[0].tolist(), IMAGE, grids, 13)
    assert np.array_equal(got.rope, expected[:, 0].long().numpy())
    assert got.offset == int(delta)


@pytest.mark.parametrize("n", [1, 2, 3, 64])
@pytest.mark.parametrize("case", ["text", "audio", "image"])
@pytest.mark.parametrize("stream", [False, True])
def test_budget_is_exact(engine, case, n, stream):
    ids, images, clips = CASES[case]
    media = [ImageInput(img) for img in images] + [AudioInput(c) for c in clips]
    request = GenerationRequest(prompt_token_ids=ids, max_tokens=n, ignore_eos=True, media=tuple(media))
    chunks = list(engine.submit(request))
    assert sum(len(chunk.token_ids) for chunk in chunks) == n
    assert chunks[-1].finished and chunks[-1].finish_reason == "length"
    assert chunks[-1].usage.output_tokens == n


def test_mixed_batch_equals_each_alone(engine):
    cases = [CASES[name] for name in CASES] * 4
    alone = [ours(engine, ids, images, clips, n=10).token_ids for ids, images, clips in cases]
    streams = [engine.submit(GenerationRequest(
        prompt_token_ids=ids, max_tokens=10,
        media=tuple([ImageInput(i) for i in images] + [AudioInput(c) for c in clips]))) for ids, images, clips in cases]
    together = [collect_generation(s).token_ids for s in streams]
    assert together == alone


def test_corrupt_image_fails_alone(engine):
    good = [engine.submit(GenerationRequest(prompt_token_ids=WITH_IMAGE, max_tokens=4, media=(ImageInput(image(7)),)))
            for _ in range(8)]
    with pytest.raises(ValueError, match="messages\\[0\\].content\\[1\\]"):
        engine.submit(GenerationRequest(prompt_token_ids=WITH_IMAGE, max_tokens=4,
                                        media=(ImageInput(b"not an image", "messages[0].content[1]"),)))
    results = [collect_generation(s) for s in good]
    assert all(r.finish_reason == "length" and len(r.token_ids) == 4 for r in results)


def test_placeholder_count_must_match_media(engine):
    with pytest.raises(ValueError, match="2 image placeholder"):
        engine.submit(GenerationRequest(prompt_token_ids=WITH_IMAGE + [VISION_START, IMAGE, VISION_END], max_tokens=4,
                                        media=(ImageInput(image(1)),)))


def test_media_without_placeholders_go_first(engine):
    marked = [VISION_START, IMAGE, VISION_END, AUDIO_START, AUDIO, AUDIO_END] + TEXT
    assert ours(engine, TEXT, (image(1),), (clip(1),)).token_ids == ours(engine, marked, (image(1),), (clip(1),)).token_ids


def test_image_bytes_equal_pixels(engine):
    from PIL import Image

    pixels = image(4)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    assert (ours(engine, WITH_IMAGE, (buffer.getvalue(),)).token_ids == ours(engine, WITH_IMAGE, (pixels,)).token_ids)


def test_prefix_cache_is_keyed_by_media(engine):
    cache = engine.loaded.served.cache
    # three full pages before the image's page; 84 tokens, 5 full pages in all
    long_prompt = list(range(10, 60)) + WITH_IMAGE + list(range(60, 80))
    first = ours(engine, long_prompt, (image(11),), n=3).token_ids
    hits = cache.num_cached_tokens_hit
    same = ours(engine, long_prompt, (image(11),), n=3).token_ids
    assert same == first
    assert cache.num_cached_tokens_hit - hits == 80      # the image's page and the pages after it too
    hits = cache.num_cached_tokens_hit
    ours(engine, long_prompt, (image(12),), n=3)
    assert cache.num_cached_tokens_hit - hits == 48    # only the pages before the image


def test_a_full_checkpoint_folder_loads_its_thinker(checkpoint, engine, tmp_path):
    """A Qwen3OmniMoeForConditionalGeneration folder: the thinker under `thinker.` and its
    config under `thinker_config`; the Talker's and Code2Wav's tensors are skipped."""
    from safetensors.torch import load_file, save_file

    folder, _ = checkpoint
    tensors = {f"thinker.{name}": t for name, t in load_file(folder / "model.safetensors").items()}
    tensors["talker.model.norm.weight"] = torch.ones(4)
    tensors["code2wav.code_embedding.weight"] = torch.zeros(2, 4)
    save_file(tensors, tmp_path / "model.safetensors")
    thinker_config = json.loads((folder / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_omni_moe", "thinker_config": thinker_config,
                                                      "enable_audio_output": True}))
    (tmp_path / "preprocessor_config.json").write_text((folder / "preprocessor_config.json").read_text())
    ids, images, clips = CASES["audio+images"]
    with Engine(EngineArgs(str(tmp_path), dtype="float32", device="cpu", max_model_len=512)) as full:
        assert ours(full, ids, images, clips, n=6).token_ids == ours(engine, ids, images, clips, n=6).token_ids
