"""Our CausalLM against transformers' Qwen3 / Llama on tiny random checkpoints.

Each case builds a random HF model, saves it with `save_pretrained`, loads it through
`config_from_hf` + `load_checkpoint_weights`, and compares logits. fp32 on CPU; the HF
side runs eager attention, ours the paged CPU path (SDPA), so agreement is ~1e-6.
"""

from __future__ import annotations

from pathlib import Path

import dataclasses

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from omniwalk.engine.attention import PagedAttention, attention_for_tests, build_metadata
from omniwalk.engine.kv_cache import KVCacheShape, PagedKVCache
from omniwalk.layers.rotary import RotaryEmbedding, apply_rotary
from omniwalk.models.decoder_lm.modeling import CausalLM
from omniwalk.models.decoder_lm import config as decoder_config
from omniwalk.models.loader import init_random_weights, load_checkpoint_weights, read_hf_config

TOL = 1e-4
VOCAB = 512
SEQ_LEN = 40
TOKENIZER_DIR = Path(__file__).parents[2] / "omniwalk" / "models" / "assets" / "tiny-tokenizer"

# head_dim 16 at theta 1e4 has wavelengths 6.3 .. 19869; an original context of 64 puts
# them in all three llama3 bands (kept, interpolated, divided by factor) at short lengths.
LLAMA3_ROPE = {
    "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
    "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
}

CASES = {
    "qwen3-tied": ("qwen3", {"tie_word_embeddings": True}),
    "qwen3-untied-bias": ("qwen3", {"tie_word_embeddings": False, "attention_bias": True}),
    "llama-untied": ("llama", {"tie_word_embeddings": False}),
    "llama-llama3rope-untied": ("llama", {"tie_word_embeddings": False, "rope_parameters": LLAMA3_ROPE}),
    "llama-llama3rope-tied-bias": (
        "llama", {"tie_word_embeddings": True, "attention_bias": True, "rope_parameters": LLAMA3_ROPE}),
}

FAMILIES = {
    "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, decoder_config.qwen3_config_from_hf),
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, decoder_config.llama_config_from_hf),
}


def make_hf_model(family: str, overrides: dict):
    config_cls, model_cls, _ = FAMILIES[family]
    kwargs = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
        rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=[0, 2], attn_implementation="eager",
    )
    kwargs.update(overrides)
    torch.manual_seed(0)
    model = model_cls(config_cls(**kwargs)).eval()
    # HF initializes norms to ones and biases to zeros; perturb everything so those
    # parameters (and their names) are actually checked.
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            base = 1.0 if "norm" in name else 0.0
            param.copy_(base + 0.1 * torch.randn(param.shape, generator=generator))
    return model


def load_ours(family: str, folder: Path) -> CausalLM:
    config = FAMILIES[family][2](read_hf_config(folder))
    model = CausalLM(config).eval()
    load_checkpoint_weights(model, folder)
    return model


def token_ids(n: int = SEQ_LEN, seed: int = 2) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


def full_forward(model: CausalLM, ids: torch.Tensor) -> torch.Tensor:
    config = model.config
    attention = attention_for_tests(config.num_layers, config.num_kv_heads, config.head_dim, len(ids))
    hidden = model(ids, torch.arange(len(ids)), attention)
    return model.compute_logits(hidden)


@pytest.fixture(scope="module", params=list(CASES))
def checkpoint(request, tmp_path_factory):
    """(family, HF model, folder with its saved checkpoint), one per case."""
    family, overrides = CASES[request.param]
    hf_model = make_hf_model(family, overrides)
    folder = tmp_path_factory.mktemp(request.param)
    # a small shard size makes save_pretrained split the checkpoint: loads from shards
    hf_model.save_pretrained(folder, max_shard_size="200KB")
    return family, hf_model, folder


@torch.no_grad()
def test_full_sequence_logits_match_hf(checkpoint):
    family, hf_model, folder = checkpoint
    assert len(list(folder.glob("*.safetensors"))) > 1
    ours = load_ours(family, folder)
    ids = token_ids()
    expected = hf_model(ids[None]).logits[0]
    got = full_forward(ours, ids)
    assert got.dtype == torch.float32 and got.shape == (SEQ_LEN, VOCAB)
    assert (got - expected).abs().max().item() < TOL
    if ours.config.tie_word_embeddings:
        assert ours.lm_head.weight is ours.model.embed_tokens.weight


@torch.no_grad()
def test_prefill_then_decode_matches_full_forward(checkpoint):
    family, hf_model, folder = checkpoint
    model = load_ours(family, folder)
    config = model.config
    ids = token_ids()
    prefill_len = 13
    # page_size 4: the decode steps cross many page boundaries
    shape = KVCacheShape(config.num_layers, config.num_kv_heads, config.head_dim, page_size=4, num_pages=16)
    cache = PagedKVCache(shape, torch.float32, "cpu")
    handle = 7

    def step(context_len: int, query_len: int) -> torch.Tensor:
        cache.reserve(handle, context_len + query_len)
        meta = build_metadata(cache, [handle], [context_len], [query_len], "cpu")
        positions = torch.arange(context_len, context_len + query_len)
        hidden = model(ids[context_len : context_len + query_len], positions, PagedAttention(cache, meta))
        return model.compute_logits(hidden[-1:])[0]

    logits = step(0, prefill_len)
    for context_len in range(prefill_len, SEQ_LEN):
        logits = step(context_len, 1)
    expected = hf_model(ids[None]).logits[0, -1]
    assert (logits - expected).abs().max().item() < TOL


@torch.no_grad()
def test_ragged_batch_matches_separate_sequences():
    """A prefill chunk and a decode step in one pass: each token gets its own position."""
    config = decoder_config.llama_tiny_config(VOCAB)
    model = CausalLM(config).eval()
    init_random_weights(model, seed=3)
    a, b = token_ids(20, seed=4), token_ids(9, seed=5)
    expected_a = full_forward(model, a)[-1]
    expected_b = full_forward(model, b)[-1]

    shape = KVCacheShape(config.num_layers, config.num_kv_heads, config.head_dim, page_size=4, num_pages=16)
    cache = PagedKVCache(shape, torch.float32, "cpu")
    # pass 1: sequence a prefills 19 tokens alone
    cache.reserve(0, 19)
    meta = build_metadata(cache, [0], [0], [19], "cpu")
    model(a[:19], torch.arange(19), PagedAttention(cache, meta))
    # pass 2: a decodes its last token (position 19) next to b's full prefill (0..8)
    cache.reserve(0, 20)
    cache.reserve(1, 9)
    meta = build_metadata(cache, [0, 1], [19, 0], [1, 9], "cpu")
    hidden = model(torch.cat([a[19:], b]), torch.cat([torch.tensor([19]), torch.arange(9)]),
                   PagedAttention(cache, meta))
    logits = model.compute_logits(hidden[[0, 9]])
    assert (logits[0] - expected_a).abs().max().item() < TOL
    assert (logits[1] - expected_b).abs().max().item() < TOL


def test_missing_tensor_is_named(tmp_path):
    hf_model = make_hf_model("qwen3", {"tie_word_embeddings": False})
    hf_model.save_pretrained(tmp_path)
    (file,) = tmp_path.glob("*.safetensors")
    tensors = load_file(file)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    tensors["model.layers.1.mlp.extra.weight"] = torch.zeros(2)
    save_file(tensors, file, metadata={"format": "pt"})
    model = CausalLM(decoder_config.qwen3_config_from_hf(read_hf_config(tmp_path)))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight") as info:
        load_checkpoint_weights(model, tmp_path)
    assert "model.layers.1.mlp.extra.weight" in str(info.value)


def test_config_from_hf_old_rope_layout():
    """transformers 4 files: rope_theta / rope_scaling at top level, no head_dim, int eos."""
    hf = {
        "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "eos_token_id": 2, "bos_token_id": 1,
        "rope_scaling": {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    }
    config = decoder_config.llama_config_from_hf(hf)
    assert config.head_dim == 16 and config.rope_theta == 500000.0 and config.eos_token_ids == (2,)
    assert config.rope_scaling["rope_type"] == "llama3" and not config.tie_word_embeddings
    assert decoder_config.llama_config_from_hf({**hf, "rope_scaling": None}).rope_scaling is None
    with pytest.raises(ValueError, match="yarn"):
        decoder_config.llama_config_from_hf({**hf, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(ValueError, match="multiple"):
        dataclasses.replace(decoder_config.llama_tiny_config(VOCAB), num_kv_heads=3)


def test_partial_rotary_matches_transformers():
    """Only the first rotary_dim dims rotate; inv_freq as transformers computes it."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import rotate_half

    rope = {**LLAMA3_ROPE, "partial_rotary_factor": 0.5}
    hf_config = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, head_dim=16,
                                         max_position_embeddings=256, rope_parameters=dict(rope))
    hf_inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_config)
    config = decoder_config.llama_config_from_hf(hf_config.to_dict())
    assert config.rotary_dim == 8
    rotary = RotaryEmbedding(config.rotary_dim, config.rope_theta, config.rope_scaling)
    assert torch.equal(rotary.inv_freq, hf_inv_freq)

    positions = torch.tensor([0, 5, 1000, 3])  # arbitrary, as in a ragged batch
    x = torch.randn(4, 2, 16, generator=torch.Generator().manual_seed(6))
    cos, sin = rotary(positions)
    freqs = positions[:, None].float() * hf_inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)[:, None]
    x_rot, x_pass = x[..., :8], x[..., 8:]
    expected = torch.cat([x_rot * emb.cos() + rotate_half(x_rot) * emb.sin(), x_pass], dim=-1)
    assert torch.equal(apply_rotary(x, cos, sin), expected)

    # casting the model to bf16 must not round the frequencies
    assert rotary.to(torch.bfloat16).inv_freq.dtype == torch.float32


def test_init_random_weights_is_deterministic():
    config = decoder_config.qwen3_tiny_config(VOCAB)
    first, second = CausalLM(config), CausalLM(config)
    init_random_weights(first, seed=11)
    torch.manual_seed(123)  # global RNG state must not matter
    init_random_weights(second, seed=11)
    for (name, p), q in zip(first.state_dict().items(), second.state_dict().values()):
        assert torch.equal(p, q), name
    assert torch.equal(first.model.norm.weight, torch.ones(64))
    assert first.lm_head.weight is first.model.embed_tokens.weight
    assert 0.015 < first.model.layers[0].mlp.gate_up_proj.weight.std().item() < 0.025


@pytest.mark.parametrize("text", [
    "The server reads the prompt, then writes one token at a time.",
    "naïve café, Grüße, 日本語のテキスト, emoji 🙂🚀 and\ttabs\n  and spaces  ",
])
def test_tiny_tokenizer_roundtrip(text):
    tokenizer = transformers.AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    assert len(tokenizer) == 512
    assert tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [0, 1, 2]
    assert tokenizer.eos_token_id == 0 and tokenizer.pad_token_id == 0
    assert tokenizer.decode(tokenizer.encode(text)) == text
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                           add_generation_prompt=True)
    assert prompt == f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.encode(prompt)[0] == 1  # special tokens stay whole
