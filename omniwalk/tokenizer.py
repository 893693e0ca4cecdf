"""Tokenizers: loading them, standing in when a folder has none, encoding text fast."""

from __future__ import annotations

from pathlib import Path


class NoTokenizer:
    """Stands in for a checkpoint folder without tokenizer files (e.g. a config-only folder
    for `--load-format dummy` benchmarks): ids in, ids out, no text."""

    def __len__(self) -> int:
        return 0

    def encode(self, text: str, **kwargs) -> list[int]:
        raise ValueError("this model has no tokenizer files: send prompt_token_ids instead of text")

    def decode(self, ids, **kwargs) -> str:
        return ""

    def apply_chat_template(self, *args, **kwargs):
        raise ValueError("this model has no tokenizer files: chat is unavailable")


def has_tokenizer_files(folder: Path) -> bool:
    return any((folder / name).is_file() for name in ("tokenizer.json", "tokenizer.model", "vocab.json"))


def load_tokenizer(folder: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


def encode(tokenizer, text: str, what: str = "the text") -> list[int]:
    """`tokenizer.encode(text, add_special_tokens=True)`. A fast tokenizer's Rust backend is
    called directly: the same ids, without the batch path's thread-pool dispatch (half of a
    speech request's submit; a burst of 256 submits shares the GIL with the engine loop).
    Raises ValueError for text no tokenizer can encode."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    try:
        if backend is not None:
            return backend.encode(text, add_special_tokens=True).ids
        return tokenizer.encode(text, add_special_tokens=True)
    except ValueError:
        raise
    except Exception as exc:   # e.g. lone surrogates: bad input, not a server fault
        raise ValueError(f"{what} cannot be tokenized: {exc}") from exc
