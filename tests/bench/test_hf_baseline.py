"""`--baseline hf` on a tiny saved Qwen3: it generates exactly what it reports, in both modes.

The compiled mode uses torch.compile's `eager` backend here (dynamo traces the decode
step, fullgraph, without inductor's minute of C++ builds on CPU); the GPU run uses inductor.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import transformers

from omniwalk.bench.hf_baseline import HFBaseline, HFBaselineConfig, make_batches
from omniwalk.bench.workload import BenchRequest, LengthRange, normal_vocabulary, synthetic_requests
from omniwalk.cli import main
from omniwalk.tokenizer import load_tokenizer
from omniwalk.models.registry import TINY_TOKENIZER


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    """A random tiny Qwen3 in HF format, with the tiny tokenizer (512 ids, eos 0)."""
    folder = tmp_path_factory.mktemp("tiny-hf-qwen3")
    config = transformers.Qwen3Config(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=512, bos_token_id=0, eos_token_id=0,
        pad_token_id=0, tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    transformers.Qwen3ForCausalLM(config).save_pretrained(folder)
    for path in TINY_TOKENIZER.iterdir():
        shutil.copy(path, folder / path.name)
    return folder


def workload(folder, num, input_len, output_len):
    vocabulary = normal_vocabulary(load_tokenizer(folder))
    return synthetic_requests(num, LengthRange.parse(input_len), LengthRange.parse(output_len), vocabulary, seed=0)


def test_batches_have_one_shape():
    requests = [BenchRequest(i, [5], 1) for i in range(5)]
    batches = make_batches(requests, 2)
    assert [[r.index for r in b] for b in batches] == [[0, 1], [2, 3], [4, 0]]
    assert len(make_batches(requests, 2, max_batches=2)) == 2


@pytest.mark.slow
def test_both_modes_generate_what_they_report(hf_folder):
    requests = workload(hf_folder, 3, "4:8", "2:4")
    baseline = HFBaseline(HFBaselineConfig(str(hf_folder), device="cpu", compile_backend="eager"))
    try:
        result = baseline.run(requests, batch_size=2)
    finally:
        baseline.close()
    assert result["num_batches"] == 2 and result["batch_size"] == 2
    for mode in ("eager", "static_compiled"):
        figures = result["modes"][mode]
        # every row pads to the longest prompt and generates the longest output: 2 batches x 2 rows x 4
        assert figures["tokens_generated"] == figures["tokens_expected"] == 2 * 2 * max(r.output_len for r in requests)
        assert figures["requested_output_tokens"] == sum(r.output_len for r in requests + requests[:1])
        assert figures["prompt_width"] == max(r.prompt_len for r in requests)
        assert figures["output_tokens_per_s"] > 0
    compiled = result["modes"]["static_compiled"]
    assert compiled["compiled_graphs"] >= 1 and compiled["graphs_compiled_while_timed"] == 0


@pytest.mark.slow
def test_dummy_weights_from_config_only(tmp_path, hf_folder):
    folder = tmp_path / "config-only"
    folder.mkdir()
    for name in ["config.json", *(p.name for p in TINY_TOKENIZER.iterdir())]:
        shutil.copy(hf_folder / name, folder / name)
    with pytest.raises(OSError):   # no weights to load: only dummy works
        HFBaseline(HFBaselineConfig(str(folder), device="cpu"))
    baseline = HFBaseline(HFBaselineConfig(str(folder), load_format="dummy", device="cpu", modes=("eager",)))
    try:
        result = baseline.run(workload(folder, 2, "4", "3"), batch_size=2)
    finally:
        baseline.close()
    assert result["modes"]["eager"]["tokens_generated"] == 6


@pytest.mark.slow
def test_cli_runs_engine_and_baseline_on_one_folder(hf_folder, tmp_path):
    path = tmp_path / "bench.json"
    code = main(["bench", "--model", str(hf_folder), "--device", "cpu", "--concurrency", "2", "--input-len", "8",
                 "--output-len", "5", "--num-requests", "2", "--ignore-eos", "--baseline", "hf",
                 "--hf-modes", "eager", "--json", str(path), "--no-progress"])
    assert code == 0
    run = json.loads(path.read_text())["runs"][0]
    assert run["summary"]["output_tokens"] == 2 * 5
    assert run["hf_baseline"]["modes"]["eager"]["tokens_generated"] == 2 * 5


@pytest.mark.slow
def test_a_config_auto_causal_lm_does_not_map_loads_its_architecture(tmp_path):
    """Qwen3-Omni's thinker (mapped by transformers under image-text-to-text only): the class its
    config's `architectures` names, random weights from the config alone, text-only generate."""
    config = transformers.Qwen3OmniMoeThinkerConfig(
        architectures=["Qwen3OmniMoeThinkerForConditionalGeneration"],
        audio_token_id=500, image_token_id=501, video_token_id=502, audio_start_token_id=503,
        text_config=dict(vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         num_experts=4, num_experts_per_tok=2, max_position_embeddings=512,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3],
                                          "mrope_interleaved": True}),
        audio_config=dict(num_mel_bins=16, d_model=32, encoder_layers=1, encoder_attention_heads=2,
                          encoder_ffn_dim=64, output_dim=64, downsample_hidden_size=8, max_source_positions=64,
                          n_window=4, n_window_infer=8, conv_chunksize=8),
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                           patch_size=4, num_position_embeddings=16, deepstack_visual_indexes=[0]),
    )
    # as the published config.json has them (the thinker's position code reads them)
    config.audio_end_token_id, config.vision_start_token_id, config.vision_end_token_id = 504, 505, 506
    config.save_pretrained(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["config.json"]
    baseline = HFBaseline(HFBaselineConfig(str(tmp_path), load_format="dummy", device="cpu", modes=("eager",)))
    try:
        assert type(baseline.model) is transformers.Qwen3OmniMoeThinkerForConditionalGeneration
        requests = [BenchRequest(0, [5, 6, 7, 8], 3), BenchRequest(1, [9, 10, 11, 12, 13, 14], 2)]
        result = baseline.run(requests, batch_size=2)
    finally:
        baseline.close()
    # one batch of 2 rows, each generating the longest output (3)
    assert result["modes"]["eager"]["tokens_generated"] == result["modes"]["eager"]["tokens_expected"] == 6
