"""Request lifecycle, planning, continuous batching, budgets and stops."""

from omniwalk.runtime.executor import FunctionExecutor, NodeCall, NodeExecutor
from omniwalk.runtime.request import FinishReason, Request, RequestOutput, StopConfig, StreamParams
from omniwalk.runtime.runtime import QueueFullError, Runtime, SchedulerConfig, ServedModel

__all__ = [
    "FinishReason", "FunctionExecutor", "NodeCall", "NodeExecutor", "QueueFullError", "Request",
    "RequestOutput", "Runtime", "SchedulerConfig", "ServedModel", "StopConfig", "StreamParams",
]
