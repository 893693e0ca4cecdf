"""What a full Qwen3-Omni checkpoint holds, under transformers' names: `thinker.`, `talker.`
(with its code predictor) and `code2wav.` (`Qwen3OmniMoeForConditionalGeneration`).

Under tensor parallelism only the Thinker's language model is split; the Talker, its code
predictor and Code2Wav are built whole on every rank (`replicated`): every rank computes
and samples the same frames. The one collective on their path is the Talker's lookup of
the Thinker's (vocab-parallel) token embeddings for its text rows, on every rank alike."""

from __future__ import annotations

from torch import nn

from omniwalk.engine.tensor_parallel import replicated
from omniwalk.models.qwen3_omni.code2wav import Code2Wav
from omniwalk.models.qwen3_omni.config import ThinkerConfig
from omniwalk.models.qwen3_omni.talker import Talker
from omniwalk.models.qwen3_omni.thinker import Thinker


class Qwen3Omni(nn.Module):
    def __init__(self, config: ThinkerConfig):
        super().__init__()
        if config.speech is None:
            raise ValueError("a config without a Talker builds the Thinker alone")
        self.thinker = Thinker(config)   # split over tensor-parallel ranks
        with replicated():   # whole on every rank: each computes the same frames and samples
            self.talker = Talker(config.speech.talker)
            self.code2wav = Code2Wav(config.speech.code2wav)
