"""The Thinker's nodes: two stateless media encoders and the stateful language model.

Encoders: a batch takes the items (clips, images) of every call that reached the node in
the step and encodes them in one pass; each call gets its items' outputs back.

Language model: the shared `CausalLMExecutor` (chunked prefill beside decode steps, the
decode CUDA graphs, look-ahead, sampling), plus per stream what its prompt takes from
media, bound into eager passes as a `ChunkMedia` (`_eager_inputs`):

    prompt:   T T <as> A A A <ae> T <vs> I I I I <ve> T T
    embeds:           a a a               i i i i           rows the encoders' outputs replace
    deepstack:                            d d d d           added after the first layers
    rope:     one position per token, (t, h, w) for image patches; past the prompt: p + offset

A chunk of a prefill takes the rows of its own range. Decode steps are text: the decode
graphs read one rotary position per row (`SequenceState.rope_offset`).

Prefix caching: the pages of a prompt are keyed by its ids, except media placeholders,
which are keyed by their item's content hash (`ThinkerPrompt.cache_keys`): two requests with
the same image share pages; two with different images never do, though their ids match.

Speaking about media: the Talker's prompt reads the Thinker's hidden states (layer
`accept_hidden_layer`) at the media rows of the user turns. A request that speaks and has
such rows carries a `MediaHidden`; every eager pass over some of them asks the model for
those rows alone (`HiddenCapture`, [rows, hidden]), written into it when the step commits,
chunk by chunk. Such a prompt takes cached pages only before its first media row (the cache
keeps KV, not hidden states); a recompute after preemption leaves the rows already kept.
Other requests pass nothing and copy nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from omniwalk.engine.causal_lm_executor import CausalLMExecutor, SequenceState
from omniwalk.engine.host_to_device import to_device
from omniwalk.models.qwen3_omni.positions import PromptPositions
from omniwalk.models.qwen3_omni.thinker import ChunkMedia
from omniwalk.runtime.executor import NodeCall, NodeExecutor


@dataclass(frozen=True)
class ImagePatches:
    """One preprocessed image: its patches [N, C * T * P * P] float32 (CPU) and grid (t, h, w) in patches."""

    patches: torch.Tensor
    grid: tuple[int, int, int]


@dataclass(frozen=True)
class EncodedImage:
    embeds: torch.Tensor       # [tokens, hidden]
    deepstack: torch.Tensor    # [levels, tokens, hidden]


class MediaEncoderExecutor(NodeExecutor):
    """A stateless encoder node over one of the Thinker's encoders; a call's work is one unit."""

    def __init__(self, encoder: torch.nn.Module, max_batch_size: int = 256):
        self.encoder = encoder
        self.max_batch_size = max_batch_size
        weight = next(encoder.parameters())
        self.device, self.dtype = weight.device, weight.dtype

    def pending_work(self, stream) -> int:
        return 1


class AudioEncoderExecutor(MediaEncoderExecutor):
    """Node `audio_encoder`: features (list of [mels, frames]) -> audio_embeds (list of [tokens, hidden])."""

    @torch.inference_mode()
    def run(self, calls: list[NodeCall]) -> list[dict]:
        clips = [clip.to(self.device, self.dtype, non_blocking=True) for call in calls for clip in call.inputs["features"]]
        encoded = iter(self.encoder(clips))
        return [{"audio_embeds": [next(encoded) for _ in call.inputs["features"]]} for call in calls]


class VisionEncoderExecutor(MediaEncoderExecutor):
    """Node `vision_encoder`: images (list of ImagePatches) -> image_embeds (list of EncodedImage)."""

    def __init__(self, encoder: torch.nn.Module, merge_size: int, max_batch_size: int = 256):
        super().__init__(encoder, max_batch_size)
        self.merge = merge_size

    @torch.inference_mode()
    def run(self, calls: list[NodeCall]) -> list[dict]:
        images = [image for call in calls for image in call.inputs["images"]]
        patches = torch.cat([image.patches for image in images]).to(self.device, self.dtype, non_blocking=True)
        embeds, deepstack = self.encoder(patches, [image.grid for image in images])
        sizes = [t * h * w // self.merge ** 2 for t, h, w in (image.grid for image in images)]
        levels = torch.stack(deepstack) if deepstack else embeds.new_zeros(0, embeds.shape[0], embeds.shape[1])
        # one request's outputs must not keep the whole batch alive: copies per image
        encoded = iter([EncodedImage(e.clone(), d.clone())
                        for e, d in zip(embeds.split(sizes), levels.split(sizes, dim=1))])
        return [{"image_embeds": [next(encoded) for _ in call.inputs["images"]]} for call in calls]


@dataclass(frozen=True)
class MediaSpan:
    """Where one media item's tokens sit in the prompt."""

    kind: str          # "audio" | "image"
    index: int         # the item among those of its kind
    start: int         # first placeholder token
    length: int


class MediaHidden:
    """The Thinker's hidden states at layer `accept_hidden_layer` at some prompt positions
    (the media rows of user turns, which the Talker's prompt reads): made empty with a
    request that speaks about media, written by the Thinker's prefill, read once by the
    talker stream's first walk (`talker_plan`).

    Rows are written in prompt order, chunk by chunk (`written`: how many so far); a
    recompute after preemption finds them written and leaves them. Only the prefill
    writes them, so its sequence takes no prefix-cache hit past the first of them
    (`ThinkerExecutor._prefix_match_key`)."""

    def __init__(self, positions: tuple[int, ...]):
        if not positions or list(positions) != sorted(set(positions)):
            raise ValueError("media hidden states need increasing prompt positions")
        self.positions = tuple(positions)
        self.index = np.asarray(positions, dtype=np.int64)
        self.states: torch.Tensor | None = None   # [len(positions), hidden] once the first row is written
        self.written = 0

    @property
    def complete(self) -> bool:
        return self.written == len(self.positions)

    def write(self, lo: int, hi: int, rows: torch.Tensor) -> None:
        """Rows [lo, hi) of `positions` (rows: [hi - lo, hidden]); rows before `written` stay."""
        if self.states is None:
            self.states = rows.new_empty(len(self.positions), rows.shape[-1])
        skip = max(0, self.written - lo)
        if lo + skip < hi:
            self.states[lo + skip : hi] = rows[skip:]
        self.written = max(self.written, hi)

    def __getstate__(self):   # crosses to the engine process before anything is written
        return {"positions": self.positions}

    def __setstate__(self, state):
        self.__init__(state["positions"])


@dataclass
class HiddenCapture:
    """An eager pass's request for hidden states: the pass's token rows `rows` at
    `layer` (transformers' `hidden_states[layer]`: 0 the embeddings, i the output of layer
    i - 1 before deepstack is added, the last the final norm's output). The model sets `states`."""

    rows: torch.Tensor    # [n] int64 on the device
    layer: int
    states: torch.Tensor | None = None


@dataclass(frozen=True)
class ThinkerPrompt:
    """The language model's prefill input: the expanded prompt and what its media became."""

    token_ids: list[int]
    positions: PromptPositions
    spans: tuple[MediaSpan, ...] = ()
    cache_keys: list[int] | None = None               # prefix-cache keys (None: the ids)
    audio_embeds: list[torch.Tensor] = field(default_factory=list)
    image_embeds: list[EncodedImage] = field(default_factory=list)
    media_hidden: MediaHidden | None = None           # speaking about media: the Talker's rows to keep


@dataclass
class PromptMedia:
    """A stream's media rows, assembled once at `begin` (on the device)."""

    rope: np.ndarray | None            # [3, prompt_len]
    embed_index: np.ndarray            # [n] prompt indices, increasing
    embeds: torch.Tensor               # [n, hidden]
    deepstack_index: np.ndarray        # [m] prompt indices of image tokens
    deepstack: torch.Tensor | None     # [levels, m, hidden]


@dataclass
class ThinkerSequence(SequenceState):
    media: PromptMedia | None = None
    cache_keys: list[int] | None = None    # the prompt's prefix-cache keys
    media_hidden: MediaHidden | None = None   # rows the prefill keeps for the Talker, until all are written


def assemble_media(prompt: ThinkerPrompt) -> PromptMedia | None:
    if not prompt.spans and prompt.positions.rope is None:
        return None
    rows, embeds, image_rows, levels = [], [], [], []
    for span in prompt.spans:   # in prompt order
        index = np.arange(span.start, span.start + span.length)
        rows.append(index)
        if span.kind == "audio":
            embeds.append(prompt.audio_embeds[span.index])
        else:
            image = prompt.image_embeds[span.index]
            embeds.append(image.embeds)
            image_rows.append(index)
            levels.append(image.deepstack)
        if embeds[-1].shape[0] != span.length:
            raise ValueError(f"{span.kind} {span.index}: {embeds[-1].shape[0]} embeddings for {span.length} tokens")
    empty = np.zeros(0, dtype=np.int64)
    return PromptMedia(
        rope=prompt.positions.rope,
        embed_index=np.concatenate(rows) if rows else empty,
        embeds=torch.cat(embeds) if embeds else None,
        deepstack_index=np.concatenate(image_rows) if image_rows else empty,
        deepstack=torch.cat(levels, dim=1) if levels and levels[0].shape[0] else None,
    )


class ThinkerExecutor(CausalLMExecutor):
    """Node `thinker`: the language model, `inputs=("tokens",)` (a ThinkerPrompt to prefill,
    then each sampled token), `outputs=("token", "logprobs")`. Every stream's sequence is a
    `ThinkerSequence` (made by `begin` from the prefill's ThinkerPrompt).

    `hidden_layer`: the layer whose hidden states a prompt's `MediaHidden` keeps (the
    Talker's `accept_hidden_layer`; None on a model that does not speak). A pass whose
    rows hold such positions captures them (`HiddenCapture`); they are written into the
    request's `MediaHidden` once the step succeeded (`_commit_states`)."""

    def __init__(self, *args, hidden_layer: int | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        if hidden_layer is not None and not 0 <= hidden_layer <= len(self.model.model.layers):
            raise ValueError(f"hidden layer {hidden_layer} of a Thinker of {len(self.model.model.layers)} layers")
        self.hidden_layer = hidden_layer
        self._captures: list[tuple[MediaHidden, int, int, HiddenCapture, int]] = []   # this step's, uncommitted

    def begin(self, stream, inputs) -> None:
        prompt = inputs["tokens"]
        if isinstance(prompt, ThinkerPrompt):
            sequence = self.sequences.get(stream.handle)
            if sequence is None:
                sequence = self.sequences[stream.handle] = ThinkerSequence()
            sequence.media = assemble_media(prompt)
            sequence.rope_offset = prompt.positions.offset
            sequence.cache_keys = prompt.cache_keys
            hidden = prompt.media_hidden
            if hidden is not None and self.hidden_layer is None:
                raise ValueError("this Thinker keeps no hidden states for a Talker")
            sequence.media_hidden = None if hidden is None or hidden.complete else hidden
            inputs = {"tokens": prompt.token_ids}
        super().begin(stream, inputs)

    def _prefix_key(self, sequence: ThinkerSequence) -> list[int]:
        keys = sequence.cache_keys
        if keys is None:
            return sequence.token_ids
        return keys + sequence.token_ids[len(keys):]

    def _prefix_match_key(self, sequence: ThinkerSequence) -> list[int]:
        key = self._prefix_key(sequence)
        hidden = sequence.media_hidden
        if hidden is None:
            return key
        # the prefill computes the rows the Talker reads: cached pages only before the first
        return key[: hidden.positions[0] + 1]

    def _graphable(self, handles: list[int]) -> bool:
        # a prompt with media needs its embeddings and (t, h, w) positions: an eager pass
        return all(self.sequences[h].media is None for h in handles)

    def _eager_inputs(self, handles: list[int], query_lens: list[int]) -> tuple:
        if self._captures:   # a pass that failed before its commit
            self._captures = []
        sequences = [self.sequences[h] for h in handles]
        if all(s.media is None for s in sequences):
            return ()
        rope, embed_rows, embeds, ds_rows, deepstack = [], [], [], [], []
        capture_rows, captures = [], []
        offset = 0   # the row's first token in the pass
        for sequence, count in zip(sequences, query_lens):
            start, end = sequence.num_computed, sequence.num_computed + count
            media = sequence.media
            hidden = sequence.media_hidden
            if hidden is not None:
                lo, hi = np.searchsorted(hidden.index, (start, end))
                lo = max(lo, hidden.written)   # rows a pass before this one (preempted since) wrote
                if hi > lo:
                    captures.append((hidden, int(lo), int(hi), sum(len(r) for r in capture_rows)))
                    capture_rows.append(hidden.index[lo:hi] - start + offset)
            # the prompt's own (t, h, w) positions up to prompt_end, then text positions
            prompt_end = (max(start, min(end, sequence.prompt_len)) if media is not None and media.rope is not None
                          else start)
            if prompt_end > start:
                rope.append(media.rope[:, start:prompt_end])
            rope.append(np.broadcast_to(np.arange(prompt_end, end) + sequence.rope_offset, (3, end - prompt_end)))
            if media is not None and media.embeds is not None:
                lo, hi = np.searchsorted(media.embed_index, (start, end))
                if hi > lo:
                    embed_rows.append(media.embed_index[lo:hi] - start + offset)
                    embeds.append(media.embeds[lo:hi])
                lo, hi = np.searchsorted(media.deepstack_index, (start, end))
                if hi > lo and media.deepstack is not None:
                    ds_rows.append(media.deepstack_index[lo:hi] - start + offset)
                    deepstack.append(media.deepstack[:, lo:hi])
            offset += count
        device = self.device
        chunk = ChunkMedia(
            rope_positions=to_device(np.concatenate(rope, axis=1), torch.long, device),
            embed_rows=to_device(np.concatenate(embed_rows), torch.long, device) if embed_rows else None,
            embeds=torch.cat(embeds) if embeds else None,
            deepstack_rows=to_device(np.concatenate(ds_rows), torch.long, device) if ds_rows else None,
            deepstack=torch.cat(deepstack, dim=1) if deepstack else None,
        )
        if not captures:
            return (chunk,)
        capture = HiddenCapture(to_device(np.concatenate(capture_rows), torch.long, device), self.hidden_layer)
        self._captures = [(hidden, lo, hi, capture, first) for hidden, lo, hi, first in captures]
        return (chunk, capture)

    def _commit_states(self, handles: list[int]) -> None:
        if not self._captures:
            return
        captures, self._captures = self._captures, []
        for hidden, lo, hi, capture, first in captures:
            hidden.write(lo, hi, capture.states[first : first + hi - lo])
        for handle in handles:   # a sequence whose rows are all kept looks no further
            sequence = self.sequences[handle]
            if sequence.media_hidden is not None and sequence.media_hidden.complete:
                sequence.media_hidden = None
