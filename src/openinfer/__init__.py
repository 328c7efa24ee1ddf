"""openinfer: a Qwen3 inference server (CUDA engine under a thin Python layer)."""
from .config import EngineConfig, ModelConfig
from .engine import Engine, LLMEngine, RequestOutput
from .sampling_params import InvalidRequest, SamplingParams
from .scheduler import QueueFull, RequestRejected, RequestUpdate

__version__ = "0.1.0"
__all__ = ["Engine", "LLMEngine", "EngineConfig", "ModelConfig", "SamplingParams", "InvalidRequest",
           "RequestOutput", "RequestUpdate", "RequestRejected", "QueueFull"]
