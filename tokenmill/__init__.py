"""tokenmill: an LLM inference engine with a token-level paged KV cache and continuous batching."""

from tokenmill.config import EngineConfig
from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.engine.engine import Engine
from tokenmill.llm import LLM
from tokenmill.request import (
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    LoRARequest,
    PoolingParams,
    RequestOutput,
    RerankResult,
    SamplingParams,
    ScorePair,
    ScoringOutput,
    ScoringRequestOutput,
)

__all__ = [
    "LLM",
    "AsyncEngine",
    "CompletionOutput",
    "EmbeddingOutput",
    "EmbeddingRequestOutput",
    "Engine",
    "EngineConfig",
    "LoRARequest",
    "PoolingParams",
    "RequestOutput",
    "RerankResult",
    "SamplingParams",
    "ScorePair",
    "ScoringOutput",
    "ScoringRequestOutput",
]
__version__ = "0.1.0"
