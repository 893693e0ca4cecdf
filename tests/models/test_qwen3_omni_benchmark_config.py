"""benchmarks/qwen3-omni-30b-a3b-full: the whole Qwen3-Omni-30B-A3B-Instruct (Thinker, Talker,
Code2Wav) as omniwalk reads it, and its tokenizer (the built-in tiny one) framing chat turns
the Talker finds. Config parsing only: the model is 35B parameters."""

from __future__ import annotations

import json
from pathlib import Path

from omniwalk.models.qwen3_omni.code2wav import emitted_samples
from omniwalk.models.qwen3_omni.config import thinker_config_from_hf
from omniwalk.models.qwen3_omni.talker_prompt import assistant_start, talker_prompt
from omniwalk.tokenizer import load_tokenizer

FOLDER = Path(__file__).resolve().parents[2] / "benchmarks" / "qwen3-omni-30b-a3b-full"


def test_full_config_has_the_released_shapes():
    hf = json.loads((FOLDER / "config.json").read_text())
    assert hf["architectures"] == ["Qwen3OmniMoeForConditionalGeneration"] and hf["enable_audio_output"]
    config = thinker_config_from_hf(hf)
    text, speech = config.text, config.speech
    assert (text.num_layers, text.hidden_size, config.num_experts, config.num_experts_per_tok) == (48, 2048, 128, 8)
    talker = speech.talker
    assert (talker.text.num_layers, talker.text.hidden_size, talker.num_experts, talker.num_experts_per_tok,
            talker.shared_expert_intermediate_size) == (20, 1024, 128, 6, 768)
    assert (talker.code_predictor.decoder.num_layers, talker.num_code_groups, talker.accept_hidden_layer) == (5, 16, 24)
    assert talker.codec.eos == 2150 and sorted(talker.speakers) == ["aiden", "chelsie", "ethan"]
    assert talker.speaker_id("Ethan") == 2302
    code2wav = speech.code2wav
    assert (code2wav.num_quantizers, code2wav.codebook_size, code2wav.samples_per_frame) == (16, 2048, 1920)
    assert emitted_samples(code2wav, 660) == 660 * 1920 - 555


def test_its_tokenizer_frames_turns_the_talker_finds():
    """The folder's chat ids are its tokenizer's (the tiny one's), so a chat the template renders
    opens an assistant turn the Talker can speak."""
    talker = thinker_config_from_hf(json.loads((FOLDER / "config.json").read_text())).speech.talker
    tokenizer = load_tokenizer(FOLDER)
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hello there"}], tokenize=False,
                                         add_generation_prompt=True)
    ids = tokenizer.encode(chat, add_special_tokens=False)
    start = assistant_start(ids, talker.prompt)
    assert ids[start] == tokenizer.convert_tokens_to_ids("<|im_start|>") == talker.prompt.im_start
    prompt = talker_prompt(ids, [7, 8], talker.speaker_id("ethan"), talker)
    # the tiny tokenizer spells "assistant\n" in 7 ids, not the real one's 2: the turn's 4th id on
    # (the rest of them, then the whole answer) are the text of the Talker's decode steps
    assert prompt.trailing_ids == tuple(ids[start + 4:]) + (7, 8) and len(prompt.rope_ids) == len(prompt.text_ids)
    assert talker.prompt.user in ids[: start]    # the user turn is read too
