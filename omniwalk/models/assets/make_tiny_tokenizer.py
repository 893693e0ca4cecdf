"""Builds the tiny byte-level BPE tokenizer that ships in `assets/tiny-tokenizer/`.

Tiny models in tests and CPU demos need a real tokenizer that loads offline with
`transformers.AutoTokenizer`. This one is trained on the short corpus below, has 512
tokens, and is byte-level, so every string (any language, emoji) encodes and decodes
back losslessly even though it only learned English merges.

    ids 0, 1, 2:   <|endoftext|>  <|im_start|>  <|im_end|>
    ids 3..258:    the 256 byte symbols
    ids 259..511:  learned merges

Run from anywhere: `python omniwalk/models/assets/make_tiny_tokenizer.py`.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

VOCAB_SIZE = 512
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
OUTPUT = Path(__file__).parent / "tiny-tokenizer"

# ChatML, as Qwen writes it: one block per message, then the assistant header on request.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)

CORPUS = """\
The river ran past the old mill at the edge of the town, where the road turned north
toward the hills. In the morning the water was cold and clear, and the children who
lived along the bank would walk to school on the stones when the level was low. Their
parents told them to be careful, but nobody ever fell in, or at least nobody admitted it.

A serving system takes requests from many users at once and answers each of them as
quickly as it can. Every request is a small program: read the prompt, think for a
while, then write the answer one token at a time. The server keeps a cache of what it
has already read, so that the next step only has to look at the newest token. When the
cache is full, some requests must wait until others finish and give their memory back.

She opened the window and listened. Somewhere down the street a dog was barking, and
a radio played a song she had not heard in years. It reminded her of the summer they
spent by the sea, of the small house with the blue door, and of the long evenings when
the light stayed in the sky until almost midnight. She smiled, closed the window, and
went back to her work.

What time is it? It is a quarter past nine. Would you like some tea or coffee? Yes,
please, with a little milk and no sugar. Thank you very much. You are welcome. Where
are you going today? I am going to the library to return some books, and then I will
meet a friend for lunch near the park. We might go for a walk if the weather is good.

Numbers and symbols appear in text as well: 1, 2, 3, 10, 42, 100, 2025; 3.14 and 0.5;
a + b = c; x * y / z; (one) [two] {three}; "quoted words" and 'single quotes'; e-mail
addresses like name@example.com; paths like /home/user/data.txt; and a question mark?
An exclamation mark! A colon: a semicolon; a dash - and the end of the sentence.

The engine reads the model weights from disk, places them on the device, and builds
the attention layers. Each layer writes its keys and values into pages of memory, and
each sequence owns a list of pages. Because the pages are all the same size, memory is
easy to share between short and long sequences, and nothing needs to be copied when a
sequence grows. This is the main idea behind paged attention.
"""


def build_tokenizer() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,  # first, so they get ids 0, 1, 2
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS.split("\n\n"), trainer=trainer)
    return tokenizer


def write_folder(tokenizer: Tokenizer, folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "add_bos_token": False,
        "add_eos_token": False,
        # " ." must stay " ." for decode(encode(s)) == s
        "clean_up_tokenization_spaces": False,
        "model_max_length": 4096,
        "chat_template": CHAT_TEMPLATE,
    }
    special_tokens_map = {
        "eos_token": "<|endoftext|>",
        "pad_token": "<|endoftext|>",
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (folder / "special_tokens_map.json").write_text(json.dumps(special_tokens_map, indent=2) + "\n")


def main() -> None:
    tokenizer = build_tokenizer()
    if tokenizer.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(f"trained {tokenizer.get_vocab_size()} tokens, wanted {VOCAB_SIZE}: grow the corpus")
    for token_id, token in enumerate(SPECIAL_TOKENS):
        assert tokenizer.token_to_id(token) == token_id, token
    write_folder(tokenizer, OUTPUT)
    print(f"wrote {OUTPUT} ({VOCAB_SIZE} tokens)")


if __name__ == "__main__":
    main()
