"""omniwalk: a serving runtime for composite multimodal models."""

from omniwalk.api import Engine, GenerationChunk, GenerationRequest, GenerationResult
from omniwalk.engine.sampler import SamplingParams
from omniwalk.loading import EngineArgs
from omniwalk.runtime import QueueFullError

__all__ = [
    "Engine", "EngineArgs", "GenerationChunk", "GenerationRequest", "GenerationResult",
    "QueueFullError", "SamplingParams",
]
