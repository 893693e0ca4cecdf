"""Text generation on the Thinker, with images and audio in the prompt.

A prompt marks each media item's place with Qwen3-Omni's chat-template markers
(`<|vision_start|><|image_pad|><|vision_end|>`, `<|audio_start|><|audio_pad|><|audio_end|>`);
the i-th image placeholder takes the request's i-th image, and likewise for audio. The
frontend decodes and preprocesses each item (on the API side: resize and patches, log-mel
features), expands its one placeholder into as many tokens as its encoder yields, computes
the prompt's rotary positions, and keys the placeholders for the prefix cache by the
item's content. Errors name the item (`MediaInput.name`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import re
from typing import Any

import numpy as np
import torch

from omniwalk.audio import MEDIA_MAX_SECONDS, load_audio
from omniwalk.capabilities.media import AudioInput, ImageInput
from omniwalk.capabilities import Prepared
from omniwalk.capabilities.text import GenerationRequest, SpeechOutput, TextFrontend
from omniwalk.engine.sampler import SamplingParams
from omniwalk.models.decoder_lm.model import WARMUP_PROMPT_TOKENS, WARMUP_REQUESTS, warmup_prompt
from omniwalk.models.qwen3_omni.code2wav import emitted_samples
from omniwalk.models.qwen3_omni.config import MEDIA_MARKER_TOKENS, TINY_MEDIA_TOKENS, ThinkerConfig
from omniwalk.models.qwen3_omni.executors import ImagePatches, MediaSpan
from omniwalk.models.qwen3_omni.media import AudioProcessor, ImageProcessor, audio_token_count, decode_image
from omniwalk.models.qwen3_omni.model import AUDIO_STREAM, TALKER_STREAM, TEXT_STREAM, ThinkerRequest, talker_media
from omniwalk.models.qwen3_omni.talker_prompt import assistant_start
from omniwalk.models.qwen3_omni.positions import prompt_positions
from omniwalk.runtime import Request, StopConfig, StreamParams
from omniwalk.tokenizer import encode

logger = logging.getLogger(__name__)


#: the frame budget of a request that names none (transformers' generate: 4,096 Talker tokens)
DEFAULT_MAX_FRAMES = 4096


class ThinkerTextFrontend(TextFrontend):
    """`TextFrontend` whose prompts may hold images and audio, and whose answers a model with
    a Talker also speaks (`GenerationRequest.speech`)."""

    media_markers = {kind: "".join(tokens) for kind, tokens in MEDIA_MARKER_TOKENS.items()}

    @property
    def voices(self) -> tuple[str, ...]:
        """The voices a request may ask to be answered in; none for a model that does not speak."""
        speech = self.config.speech
        return tuple(sorted(speech.talker.speakers)) if speech is not None else ()

    @property
    def audio_sample_rate(self) -> int | None:
        speech = self.config.speech
        return speech.code2wav.sample_rate if speech is not None else None

    def audio_samples(self, frames: int) -> int | None:
        """F frames are F * 1920 - 555 samples on the released model (code2wav.emitted_samples)."""
        speech = self.config.speech
        return emitted_samples(speech.code2wav, frames) if speech is not None else None

    def prepare(self, request: GenerationRequest, request_id: str, draw_seed) -> Prepared:
        prepared = super().prepare(request, request_id, draw_seed)
        if request.speech is not None:
            return self._speaking(request, prepared)
        prepared.request.streams.update(silent_streams(self.config))
        return prepared

    def _speaking(self, request: GenerationRequest, prepared: Prepared) -> Prepared:
        """The prepared text request, with the Talker's and Code2Wav's streams."""
        speech = self.config.speech
        if speech is None:
            raise ValueError("this model does not speak (its checkpoint has no Talker)")
        talker = speech.talker
        try:
            speaker = talker.speaker_id(request.speech.voice)
        except KeyError as exc:
            raise ValueError(exc.args[0]) from None
        prompt: ThinkerRequest = prepared.request.inputs
        try:
            assistant_start(prompt.token_ids, talker.prompt)
        except ValueError:
            raise ValueError("a spoken answer needs a chat prompt that opens the assistant's turn "
                             "(<|im_start|>assistant): send messages") from None
        room = talker.text.max_position_embeddings - len(prompt.token_ids) - 16
        max_frames = request.speech.max_frames or min(DEFAULT_MAX_FRAMES, room)
        if max_frames > room:
            raise ValueError(f"max_frames ({max_frames}) exceeds what the Talker's context leaves ({room})")
        text = prepared.request.streams[self.stream]
        streams = {
            self.stream: text,
            TALKER_STREAM: StreamParams(max_frames, StopConfig(eos_ids=frozenset({talker.codec.eos}),
                                                               ignore_eos=request.ignore_eos),
                                        request.speech.sampling, text.seed),
            AUDIO_STREAM: StreamParams(),
        }
        # media in the user turns: the Talker reads the Thinker's hidden states there
        media_hidden = talker_media(prompt, talker) if prompt.spans else None
        runtime_request = Request(prepared.request.request_id,
                                  dataclasses.replace(prompt, speaker=speaker, media_hidden=media_hidden), streams)
        prepared.processor.speaks(TALKER_STREAM, AUDIO_STREAM)
        return Prepared(runtime_request, prepared.processor, prepared.prompt_token_ids)

    def __init__(self, *, config: ThinkerConfig, image_processor: ImageProcessor, audio_processor: AudioProcessor,
                 **text):
        super().__init__(make_prompt=None, **text)
        self.config = config
        self.image_processor = image_processor
        self.audio_processor = audio_processor
        # a marker without an id in the vocabulary (a config that names no vision_end) is plain text
        self.marker_ids = {marker: token for marker, default in config.tokens.of_marker().items()
                           if 0 <= (token := self._token_id(marker, default)) < config.vocab_size}
        self.marker_pattern = re.compile("(" + "|".join(map(re.escape, self.marker_ids)) + ")")

    def _token_id(self, token: str, default: int) -> int:
        """The tokenizer's id of a marker token if it has one (a real checkpoint), else the config's."""
        convert = getattr(self.tokenizer, "convert_tokens_to_ids", None)
        found = convert(token) if convert is not None else None
        unknown = getattr(self.tokenizer, "unk_token_id", None)
        return found if isinstance(found, int) and found != unknown else default

    def tokenize(self, request: GenerationRequest) -> list[int]:
        if request.prompt is None:
            return super().tokenize(request)
        ids = []
        for piece in self.marker_pattern.split(request.prompt):
            if piece in self.marker_ids:
                ids.append(self.marker_ids[piece])
            elif piece:
                ids.extend(encode(self.tokenizer, piece, "the prompt", max_tokens=self.max_model_len))
        if not ids:
            raise ValueError("the prompt is empty")
        return ids

    def prompt_of(self, request: GenerationRequest) -> tuple[list[int], Any]:
        ids = self.tokenize(request)
        tokens = self.config.tokens
        images = [item for item in request.media if isinstance(item, ImageInput)]
        audios = [item for item in request.media if isinstance(item, AudioInput)]
        if request.media and tokens.image not in ids and tokens.audio not in ids:
            # no placeholder at all: the items go first, in order (as a chat message whose
            # media parts come before its text)
            ids = [marker for item in request.media for marker in self._marker_ids(item)] + ids
        for kind, pad, items in (("image", tokens.image, images), ("audio", tokens.audio, audios)):
            found = ids.count(pad)
            if found != len(items):
                raise ValueError(f"the prompt has {found} {kind} placeholder(s) for {len(items)} {kind} input(s); "
                                 f"mark each with {self.media_markers[kind]}")
        if not request.media:
            return ids, ThinkerRequest(ids, prompt_positions(ids, tokens.image, [], 0))
        patches = [self._image(item) for item in images]
        features = [self._audio(item) for item in audios]
        merge = self.config.vision.spatial_merge_size
        grids = [(t, h // merge, w // merge) for t, h, w in (p.grid for p in patches)]
        lengths = {"image": [t * h * w for t, h, w in grids],
                   "audio": [audio_token_count(f.shape[-1], self.config.audio.n_window) for f in features]}
        hashes = {"image": [_content_hash(p.patches) for p in patches], "audio": [_content_hash(f) for f in features]}
        expanded, keys, spans, seen = [], [], [], {"image": 0, "audio": 0}
        for token in ids:
            kind = "image" if token == tokens.image else "audio" if token == tokens.audio else None
            if kind is None:
                expanded.append(token)
                keys.append(token)
                continue
            index = seen[kind]
            seen[kind] += 1
            length = lengths[kind][index]
            spans.append(MediaSpan(kind, index, len(expanded), length))
            expanded.extend([token] * length)
            # placeholders keyed by content: negative, so never equal to an id
            keys.extend(-(1 + (hashes[kind][index] + j) % (1 << 62)) for j in range(length))
        positions = prompt_positions(expanded, tokens.image, grids, self.config.position_id_per_seconds)
        return expanded, ThinkerRequest(expanded, positions, tuple(spans), tuple(features), tuple(patches), keys)

    def _marker_ids(self, item) -> list[int]:
        kind = "image" if isinstance(item, ImageInput) else "audio"
        return [self.marker_ids[token] for token in MEDIA_MARKER_TOKENS[kind] if token in self.marker_ids]

    def _image(self, item: ImageInput) -> ImagePatches:
        try:
            patches, grid = self.image_processor(decode_image(item.data))
        except ValueError as exc:
            raise ValueError(f"{item.name}: {exc}") from None
        return ImagePatches(torch.as_tensor(patches), tuple(int(v) for v in grid))

    def _audio(self, item: AudioInput) -> torch.Tensor:
        try:
            samples = load_audio(item.data, self.config.audio_settings.sampling_rate, max_seconds=MEDIA_MAX_SECONDS)
            return torch.as_tensor(self.audio_processor(samples))
        except ValueError as exc:
            raise ValueError(f"{item.name}: {exc}") from None


def silent_streams(config: ThinkerConfig) -> dict[str, StreamParams]:
    """The talker stream's params of a request that asks for no audio, on a model that speaks:
    every budgeted stream has a limit; this one ends with the text, without a walk."""
    return {TALKER_STREAM: StreamParams(1)} if config.speech is not None else {}


def _content_hash(tensor: torch.Tensor) -> int:
    data = np.ascontiguousarray(tensor.numpy())
    digest = hashlib.sha256(repr(data.shape).encode() + data.tobytes()).digest()
    return int.from_bytes(digest[:8], "little")


def thinker_frontends(loaded) -> list[ThinkerTextFrontend]:
    """Text generation with media, over the loaded Thinker's one text stream."""
    config: ThinkerConfig = loaded.config
    return [ThinkerTextFrontend(
        config=config, image_processor=ImageProcessor(config.image_settings),
        audio_processor=AudioProcessor(config.audio_settings),
        tokenizer=loaded.tokenizer, vocab_size=config.vocab_size, max_model_len=loaded.max_model_len,
        kv_capacity_tokens=loaded.kv_capacity_tokens, eos_token_ids=loaded.eos_token_ids, stream=TEXT_STREAM)]


#: the speaking warm-up: up to this many spoken answers at once (a full batch of the Talker's
#: steps and of Code2Wav's chunks), each of a few words and this many frames: chunks of 4, 4
#: and 8 frames, the shapes of every stream's first second. Measured cold on the H200, the
#: first batch of 32 spoken answers waited 3.8 s for its first audio (Code2Wav's first batch-32
#: step alone 1 s), the same batch warm 0.3 s.
SPEAKING_WARMUP_REQUESTS, SPEAKING_WARMUP_FRAMES = 32, 16


def thinker_warmup(loaded) -> list[Request]:
    """Text prompts whose prefill is one eager pass and whose decode steps replay the graphs
    (as the decoder LMs' warm-up); media encoders compile on their first request. A model
    that speaks adds spoken answers (`speaking_warmup`)."""
    vocab = loaded.config.text.vocab_size - TINY_MEDIA_TOKENS   # ordinary ids in any vocabulary
    prompt_len = max(1, min(WARMUP_PROMPT_TOKENS, loaded.max_model_len // 4))
    budget = max(1, min(8, loaded.max_model_len - prompt_len))
    requests = []
    for i in range(WARMUP_REQUESTS):
        ids = warmup_prompt(i, prompt_len, vocab)
        params = StreamParams(budget, StopConfig(ignore_eos=True), SamplingParams(temperature=1.0, top_p=0.9, seed=i), i)
        requests.append(Request(f"warmup-{i}", ThinkerRequest(ids, prompt_positions(ids, -1, [], 0)),
                                {TEXT_STREAM: params, **silent_streams(loaded.config)}))
    if loaded.config.speech is not None:
        requests += speaking_warmup(loaded)
    return requests


def speaking_warmup(loaded) -> list[Request]:
    """Spoken answers to a short chat message, prepared as the frontend prepares a request:
    as many at once as the engine batches (at most `SPEAKING_WARMUP_REQUESTS`), greedy text,
    the Talker's default sampling, exactly `SPEAKING_WARMUP_FRAMES` frames."""
    frontend = thinker_frontends(loaded)[0]
    try:
        prompt = loaded.tokenizer.apply_chat_template([{"role": "user", "content": "Say hello."}], tokenize=False,
                                                      add_generation_prompt=True)
    except Exception as exc:   # a tokenizer without a chat template: its first spoken answers warm up
        logger.info("no speaking warm-up: the tokenizer renders no chat (%s)", exc)
        return []
    count = min(SPEAKING_WARMUP_REQUESTS, loaded.served.max_batch_size)
    return [frontend.prepare(GenerationRequest(prompt=prompt, max_tokens=8, ignore_eos=True,
                                               sampling=SamplingParams(temperature=0.0, seed=i),
                                               speech=SpeechOutput(frontend.voices[0], SPEAKING_WARMUP_FRAMES)),
                             f"warmup-speech-{i}", lambda: 0).request
            for i in range(count)]
