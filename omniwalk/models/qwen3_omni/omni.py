"""What a full Qwen3-Omni checkpoint holds, under transformers' names: `thinker.`, `talker.`
(with its code predictor) and `code2wav.` (`Qwen3OmniMoeForConditionalGeneration`)."""

from __future__ import annotations

from torch import nn

from omniwalk.models.qwen3_omni.code2wav import Code2Wav
from omniwalk.models.qwen3_omni.config import ThinkerConfig
from omniwalk.models.qwen3_omni.talker import Talker
from omniwalk.models.qwen3_omni.thinker import Thinker


class Qwen3Omni(nn.Module):
    def __init__(self, config: ThinkerConfig):
        super().__init__()
        if config.speech is None:
            raise ValueError("a config without a Talker builds the Thinker alone")
        self.thinker = Thinker(config)
        self.talker = Talker(config.speech.talker)
        self.code2wav = Code2Wav(config.speech.code2wav)
