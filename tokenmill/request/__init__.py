"""The request layer's public names: requests and their results, as the rest of tokenmill and its
users import them (``from tokenmill.request import SamplingParams``). Each lives in its own module:

* :mod:`~tokenmill.request.errors`: ParameterError, the one error type for a refused request
  parameter, and ContextLengthError;
* :mod:`~tokenmill.request.limits`: RequestLimits, what SamplingParams are validated against;
* :mod:`~tokenmill.request.structured_outputs`: StructuredOutputsParams and its JSON-schema checks;
* :mod:`~tokenmill.request.sampling_params`: SamplingParams;
* :mod:`~tokenmill.request.pooling_params`: PoolingParams (an embedding or a score instead of
  generated tokens) and ScorePair;
* :mod:`~tokenmill.request.lora_request`: LoRARequest;
* :mod:`~tokenmill.request.outputs`: RequestOutput, CompletionOutput, EmbeddingRequestOutput,
  ScoringRequestOutput, RerankResult and the rest of a request's results.

Names and defaults follow vLLM so users can switch engines without relearning the API.
"""

from tokenmill.request.errors import ContextLengthError, ParameterError
from tokenmill.request.limits import RequestLimits
from tokenmill.request.lora_request import LoRARequest
from tokenmill.request.outputs import (
    LOGPROB_FLOOR,
    CompletionOutput,
    EmbeddingOutput,
    EmbeddingRequestOutput,
    FinishReason,
    Logprob,
    OutputCallback,
    RequestMetrics,
    RequestOutput,
    RerankResult,
    ScoringOutput,
    ScoringRequestOutput,
    accumulate,
    now,
)
from tokenmill.request.pooling_params import PoolingParams, ScorePair
from tokenmill.request.sampling_params import INT63, SamplingParams
from tokenmill.request.structured_outputs import (
    MAX_SCHEMA_NESTING,
    StructuredOutputsParams,
    json_nesting,
    unenforced_schema_part,
)

__all__ = [
    "INT63",
    "LOGPROB_FLOOR",
    "MAX_SCHEMA_NESTING",
    "CompletionOutput",
    "ContextLengthError",
    "EmbeddingOutput",
    "EmbeddingRequestOutput",
    "FinishReason",
    "LoRARequest",
    "Logprob",
    "OutputCallback",
    "ParameterError",
    "PoolingParams",
    "RequestLimits",
    "RequestMetrics",
    "RequestOutput",
    "RerankResult",
    "SamplingParams",
    "ScorePair",
    "ScoringOutput",
    "ScoringRequestOutput",
    "StructuredOutputsParams",
    "accumulate",
    "json_nesting",
    "now",
    "unenforced_schema_part",
]
