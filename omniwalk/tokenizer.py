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


#: texts up to this many characters are encoded by the backend's `encode`, which holds the
#: interpreter lock for the whole call (~7 ms for 4096 characters at worst); longer ones by
#: `encode_batch`, which releases it (a 10 MB prompt held it for 18 s: no other thread, the
#: server's event loop included, ran meanwhile)
SHORT_TEXT_CHARS = 4096
#: a normalizer may shrink text by this factor at most (NFC composes 3 Hangul jamo into 1 syllable)
NORMALIZED_SHRINK = 3


def encode(tokenizer, text: str, what: str = "the text", add_special_tokens: bool = True,
           max_tokens: int | None = None) -> list[int]:
    """`tokenizer.encode(text, add_special_tokens=...)`. A fast tokenizer's Rust backend is
    called directly: the same ids, without the batch path's thread-pool dispatch (half of a
    speech request's submit; a burst of 256 submits shares the GIL with the engine loop),
    and a long text through its batch path, which lets other threads run (SHORT_TEXT_CHARS).
    With `max_tokens`, a text of more tokens raises ValueError ("{what} has N tokens; the
    context holds M") before its id list is made, and a text too long to fit whatever it
    says (`could_fit`) before it is tokenized at all. Raises ValueError for text no
    tokenizer can encode."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if max_tokens is not None and backend is not None:
        could_fit(tokenizer, text, what, max_tokens)
    try:
        if backend is None:
            ids = tokenizer.encode(text, add_special_tokens=add_special_tokens)
        elif len(text) <= SHORT_TEXT_CHARS:
            ids = backend.encode(text, add_special_tokens=add_special_tokens).ids
        else:
            encoding = backend.encode_batch([text], add_special_tokens=add_special_tokens)[0]
            if max_tokens is not None and len(encoding) > max_tokens:   # before a list of millions is made
                raise _too_many(what, len(encoding), max_tokens)
            ids = encoding.ids
    except ValueError:
        raise
    except Exception as exc:   # e.g. lone surrogates: bad input, not a server fault
        raise ValueError(f"{what} cannot be tokenized: {exc}") from exc
    if max_tokens is not None and len(ids) > max_tokens:
        raise _too_many(what, len(ids), max_tokens)
    return ids


def _too_many(what: str, num_tokens: int, max_tokens: int) -> ValueError:
    return ValueError(f"{what} has {num_tokens} tokens; the context holds {max_tokens}")


def could_fit(tokenizer, text: str, what: str, max_tokens: int) -> None:
    """ValueError when `text` has more UTF-8 bytes than `max_tokens` tokens can stand for:
    no token of the vocabulary covers more than `max_token_bytes` bytes of normalized text,
    and normalizing shrinks text by NORMALIZED_SHRINK at most. Tokenizing a 30 MB prompt
    would keep a thread busy for a minute only to say that it does not fit."""
    bound = max_tokens * max_token_bytes(tokenizer) * NORMALIZED_SHRINK
    if len(text) > bound and len(text.encode("utf-8", "surrogatepass")) > bound:
        raise ValueError(f"{what} is {len(text.encode('utf-8', 'surrogatepass'))} bytes: more than the context of "
                         f"{max_tokens} tokens can hold")


def max_token_bytes(tokenizer) -> int:
    """The most UTF-8 bytes of any token's text, added tokens included (a byte-level BPE
    symbol counts 2 for the 1 byte it stands for: an upper bound is what is needed).
    Computed once per tokenizer, kept on it."""
    cached = getattr(tokenizer, "_omniwalk_max_token_bytes", None)
    if cached is None:
        vocab = tokenizer.backend_tokenizer.get_vocab(with_added_tokens=True)
        cached = max((len(token.encode("utf-8", "surrogatepass")) for token in vocab), default=1)
        tokenizer._omniwalk_max_token_bytes = cached
    return cached
