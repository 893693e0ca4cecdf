"""omniwalk: a serving runtime for composite multimodal models."""

from omniwalk.api import Engine
from omniwalk.capabilities import Capability
from omniwalk.capabilities.speech import SpeechRequest, synthesize
from omniwalk.capabilities.text import GenerationChunk, GenerationRequest, GenerationResult
from omniwalk.capabilities.transcription import TranscriptionRequest, transcribe
from omniwalk.engine.sampler import SamplingParams
from omniwalk.loading import EngineArgs
from omniwalk.runtime import QueueFullError

__all__ = [
    "Capability", "Engine", "EngineArgs", "GenerationChunk", "GenerationRequest", "GenerationResult",
    "QueueFullError", "SamplingParams", "SpeechRequest", "TranscriptionRequest", "synthesize", "transcribe",
]
