"""Builds the files of the built-in `tiny-whisper` in `assets/tiny-whisper/`.

    tokenizer.json, tokenizer_config.json, special_tokens_map.json
        a byte-level BPE over the tiny corpus of `omniwalk/models/assets/make_tiny_tokenizer.py`,
        followed by Whisper's special tokens in Whisper's order (large-v3's 100 languages):

        ids 0 .. T-1        text tokens (256 byte symbols, then learned merges)
        T                   <|endoftext|>           eos, bos, pad
        T + 1               <|startoftranscript|>   decoder_start_token_id
        T + 2 .. T + 101    <|en|> <|zh|> ... <|yue|>
        T + 102, T + 103    <|translate|> <|transcribe|>
        T + 104 .. T + 106  <|startoflm|> <|startofprev|> <|nospeech|>
        T + 107             <|notimestamps|>
        T + 108 .. T + 1608 <|0.00|> <|0.02|> ... <|30.00|>   timestamp tokens (timestamp_begin = T + 108)

    generation_config.json   forced prompt, language and task ids, suppress lists, as a
                             Whisper checkpoint's generation config has them
    preprocessor_config.json WhisperFeatureExtractor settings (80 mel bins, 30 s windows)

Run from anywhere: `python omniwalk/models/whisper/assets/make_tiny_whisper.py`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

sys.path.insert(0, str(Path(__file__).parents[2] / "assets"))
from make_tiny_tokenizer import CORPUS  # noqa: E402

TEXT_TOKENS = 404          # with the 108 special tokens: 512 ids in all
OUTPUT = Path(__file__).parent / "tiny-whisper"

# large-v3's languages, in its token order (transformers' LANGUAGES)
LANGUAGES = (
    "en zh de es ru ko fr ja pt tr pl ca nl ar sv it id hi fi vi he uk el ms cs ro da hu ta no th ur hr bg "
    "lt la mi ml cy sk te fa lv bn sr az sl kn et mk br eu is hy ne mn bs kk sq sw gl mr pa si km sn yo so "
    "af oc ka be tg sd gu am yi lo uz fo ht ps tk nn mt sa lb my bo tl mg as tt haw ln ha ba jw su yue"
).split()
TASKS = ("translate", "transcribe")
SPECIAL_TOKENS = (
    ["<|endoftext|>", "<|startoftranscript|>"] + [f"<|{code}|>" for code in LANGUAGES]
    + [f"<|{task}|>" for task in TASKS]
    + ["<|startoflm|>", "<|startofprev|>", "<|nospeech|>", "<|notimestamps|>"]
)
# Whisper's timestamp tokens: 0.00 s to 30.00 s in steps of 0.02 s (special here, so that a
# text decode skips them; ids past <|notimestamps|> are timestamps whatever the tokenizer says)
TIMESTAMP_TOKENS = [f"<|{i * 0.02:.2f}|>" for i in range(1501)]
# openai-whisper's non-speech symbols, suppressed at every step (those the vocabulary has as one token)
SUPPRESSED_SYMBOLS = list('"#()*+/:;<=>@[\\]^_`{|}~') + [" -", " '"]


def build_tokenizer() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=TEXT_TOKENS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS.split("\n\n"), trainer=trainer)
    if tokenizer.get_vocab_size() != TEXT_TOKENS:
        raise RuntimeError(f"trained {tokenizer.get_vocab_size()} tokens, wanted {TEXT_TOKENS}")
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                  for t in SPECIAL_TOKENS + TIMESTAMP_TOKENS])
    return tokenizer


def generation_config(tokenizer: Tokenizer) -> dict:
    ids = {token: tokenizer.token_to_id(token) for token in SPECIAL_TOKENS}
    eot = ids["<|endoftext|>"]
    symbols = []
    for symbol in SUPPRESSED_SYMBOLS:
        encoded = tokenizer.encode(symbol).ids
        if len(encoded) == 1:
            symbols.append(encoded[0])
    specials = [ids[t] for t in ("<|startoftranscript|>", "<|translate|>", "<|transcribe|>", "<|startoflm|>",
                                 "<|startofprev|>", "<|nospeech|>")]
    return {
        "alignment_heads": [[1, 0], [1, 1], [1, 2], [1, 3]],   # tiny-whisper's last decoder layer
        "begin_suppress_tokens": [tokenizer.encode(" ").ids[0], eot],
        "bos_token_id": eot,
        "decoder_start_token_id": ids["<|startoftranscript|>"],
        "eos_token_id": eot,
        "forced_decoder_ids": None,
        "is_multilingual": True,
        "lang_to_id": {f"<|{code}|>": ids[f"<|{code}|>"] for code in LANGUAGES},
        "max_initial_timestamp_index": 50,
        "max_length": 448,
        "no_timestamps_token_id": ids["<|notimestamps|>"],
        "pad_token_id": eot,
        "prev_sot_token_id": ids["<|startofprev|>"],
        "return_timestamps": False,
        "suppress_tokens": sorted(set(symbols)) + specials,
        "task_to_id": {task: ids[f"<|{task}|>"] for task in TASKS},
    }


def write_folder(tokenizer: Tokenizer, folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    specials = SPECIAL_TOKENS[1:]
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|endoftext|>",
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "unk_token": "<|endoftext|>",
        "additional_special_tokens": specials,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 448,
    }
    special_map = {key: config[key] for key in ("bos_token", "eos_token", "pad_token", "unk_token")}
    special_map["additional_special_tokens"] = specials
    preprocessor = {
        "feature_extractor_type": "WhisperFeatureExtractor", "feature_size": 80, "sampling_rate": 16000,
        "hop_length": 160, "chunk_length": 30, "n_fft": 400, "n_samples": 480000, "nb_max_frames": 3000,
        "padding_side": "right", "padding_value": 0.0, "return_attention_mask": False,
    }
    files = {
        "tokenizer_config.json": config, "special_tokens_map.json": special_map,
        "generation_config.json": generation_config(tokenizer), "preprocessor_config.json": preprocessor,
    }
    for name, content in files.items():
        (folder / name).write_text(json.dumps(content, indent=2) + "\n")


def main() -> None:
    tokenizer = build_tokenizer()
    assert tokenizer.get_vocab_size() == TEXT_TOKENS + len(SPECIAL_TOKENS) + len(TIMESTAMP_TOKENS) == 2013
    write_folder(tokenizer, OUTPUT)
    print(f"wrote {OUTPUT} ({tokenizer.get_vocab_size()} tokens)")


if __name__ == "__main__":
    main()
