"""Requests and their results: SamplingParams (validated against RequestLimits), PoolingParams
(an embedding or a score instead of generated tokens) and ScorePair, RequestOutput, CompletionOutput,
EmbeddingRequestOutput, ScoringRequestOutput, RerankResult, and ParameterError, the one error type
for a refused request parameter.

Names and defaults follow vLLM so users can switch engines without relearning the API.
"""

from __future__ import annotations

import enum
import json
import math
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the context limit
    ABORT = "abort"  # cancelled by the caller (e.g. the client went away)
    ERROR = "error"  # the engine failed this request; ``CompletionOutput.error`` says why


GREEDY_TEMPERATURE = 1e-5
INT63 = 2**63


class ParameterError(ValueError):
    """A refused request parameter; ``param`` names it, and the message starts with that name."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param} {message}")
        self.param = param
        self.detail = message

    def message_for(self, names: Mapping[str, str]) -> str:
        """The message in an API's own parameter names (``names``: engine name -> API name): the
        leading name, and parameter names (those with an underscore) in the rest, renamed."""
        detail = self.detail
        for engine_name, api_name in names.items():
            if "_" in engine_name:
                detail = re.sub(rf"\b{re.escape(engine_name)}\b", api_name, detail)
        return f"{names.get(self.param, self.param)} {detail}"


class ContextLengthError(ParameterError):
    """A prompt that, with the output asked for, does not fit the context limit (``param``: "prompt")."""

    def __init__(self, message: str) -> None:
        super().__init__("prompt", message)


@dataclass(frozen=True)
class RequestLimits:
    """What the engine accepts: the model's vocabulary and the operator's caps (None: no cap)."""

    vocab_size: int
    max_n: int | None = None
    max_tokens_cap: int | None = None
    max_top_logprobs: int | None = None
    max_stop_strings: int | None = None
    max_stop_chars: int | None = None
    max_stop_token_ids: int | None = None
    max_structured_output_chars: int | None = None


def _require(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise ParameterError(param, message)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


MAX_SCHEMA_NESTING = 64
"""The deepest a JSON schema may nest (dicts and lists), given as a dict or as text."""


def json_nesting(value: Any) -> int:
    """The nesting depth of a parsed JSON value (dicts and lists), measured level by level (no recursion)."""
    depth, level = 0, [value]
    while containers := [item for item in level if isinstance(item, (dict, list))]:
        depth += 1
        level = [child for item in containers for child in (item.values() if isinstance(item, dict) else item)]
    return depth


UNENFORCED_SCHEMA_KEYWORDS = ("not", "contains", "minContains", "maxContains")
"""JSON Schema keywords the grammar engine accepts but does not enforce: refused (as OpenAI's strict mode)."""
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_VALUES = ("items", "additionalProperties", "if", "then", "else", "propertyNames", "unevaluatedProperties")
_COUNTS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties")


def unenforced_schema_part(schema: Any) -> str | None:
    """Why ``schema`` (a parsed JSON schema) cannot be enforced as written, or None. Refused: the
    keywords of :data:`UNENFORCED_SCHEMA_KEYWORDS`; ``oneOf`` without a ``discriminator`` (enforced
    only as ``anyOf``: overlapping branches would match more than one); a ``$ref`` outside the
    document; a length or count bound that is not a non-negative integer. Walks every subschema,
    iteratively (depth is capped elsewhere)."""
    pending = [schema]
    while pending:
        node = pending.pop()
        if not isinstance(node, dict):
            continue
        for keyword in UNENFORCED_SCHEMA_KEYWORDS:
            if keyword in node:
                return f"{keyword} is not enforced"
        if "oneOf" in node and "discriminator" not in node:
            return "oneOf is enforced only with a discriminator (else as anyOf); use anyOf"
        ref = node.get("$ref")
        if isinstance(ref, str) and not ref.startswith("#"):
            return f"$ref {ref[:100]!r} points outside the schema (only '#...' references are resolved)"
        for name in _COUNTS:
            if name in node and not (_is_int(node[name]) and node[name] >= 0):
                return f"{name} must be a non-negative integer, got {node[name]!r}"
        for name in _SCHEMA_MAPS:
            if isinstance(node.get(name), dict):
                pending.extend(node[name].values())
        for name in _SCHEMA_LISTS:
            if isinstance(node.get(name), list):
                pending.extend(node[name])
        for name in _SCHEMA_VALUES:
            pending.append(node.get(name))
        if isinstance(node.get("items"), list):
            pending.extend(node["items"])
    return None


@dataclass
class StructuredOutputsParams:
    """A constraint on the output (vLLM's names); exactly one field must be set.

    ``json``: a JSON schema (a dict or its JSON text); objects allow no properties beyond the
    schema's unless it says ``additionalProperties`` (as OpenAI's ``strict`` mode). ``regex``: the
    whole output matches it. ``choice``: the output is one of these strings. ``grammar``: an EBNF
    grammar in the GBNF dialect of xgrammar and llama.cpp (``root ::= ...``) or a Lark grammar
    (``start: ...``); text containing ``::=`` is read as EBNF, any other as Lark. ``json_object``:
    any JSON object. The output ends ("stop") as soon as the constraint allows nothing more.
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False

    @property
    def kind(self) -> str:
        """The name of the field that is set: "json", "regex", "choice", "grammar" or "json_object"."""
        set_fields = self._set_fields()
        if len(set_fields) != 1:
            raise ParameterError("structured_outputs", f"must set exactly one field, got {set_fields or 'none'}")
        return set_fields[0]

    def _set_fields(self) -> list[str]:
        names = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        return names + (["json_object"] if self.json_object is not False else [])

    def validate(self, max_chars: int | None) -> None:
        """Raise ParameterError("structured_outputs") unless exactly one field is set, with the right
        type, the spec holds at most ``max_chars`` characters (None: no cap), and a JSON schema (dict
        or text) parses, nests at most :data:`MAX_SCHEMA_NESTING` levels and has no part
        :func:`unenforced_schema_part` refuses. Whether the schema,
        regex or grammar compiles is checked when it is compiled, at intake."""
        param = "structured_outputs"
        _require(isinstance(self.json_object, bool), param, f"json_object must be a boolean, got {self.json_object!r}")
        set_fields = self._set_fields()
        _require(
            len(set_fields) == 1,
            param,
            f"must set exactly one of json, regex, choice, grammar, json_object; got {set_fields or 'none'}",
        )
        _require(self.json is None or isinstance(self.json, (str, dict)), param, "json must be a schema (dict or text)")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            _require(value is None or isinstance(value, str), param, f"{name} must be a string")
        if self.choice is not None:
            _require(isinstance(self.choice, list) and bool(self.choice), param, "choice must be a non-empty list")
            bad = [c for c in self.choice if not (isinstance(c, str) and c)]
            _require(not bad, param, f"choice must hold non-empty strings, got {bad[:1]!r}")
        chars = self.size()
        _require(
            max_chars is None or chars <= max_chars, param, f"may hold at most {max_chars} characters, got {chars}"
        )
        if self.json is not None:
            try:
                schema = json.loads(self.json) if isinstance(self.json, str) else self.json
                depth = json_nesting(schema)
            except RecursionError:  # deeper than Python's decoder goes: far over the limit
                depth = MAX_SCHEMA_NESTING + 1
            except ValueError as exc:
                raise ParameterError(param, f"json is invalid: {exc}") from None
            _require(
                depth <= MAX_SCHEMA_NESTING,
                param,
                f"the json schema nests deeper than the limit of {MAX_SCHEMA_NESTING} levels",
            )
            why = unenforced_schema_part(schema)
            _require(why is None, param, f"the json schema cannot be enforced: {why}")

    def size(self) -> int:
        """Characters in the spec (a dict schema counts as its compact JSON text)."""
        if isinstance(self.json, dict):
            try:
                return len(json.dumps(self.json, separators=(",", ":")))
            except (TypeError, ValueError) as exc:
                raise ParameterError("structured_outputs", f"json is not a JSON document: {exc}") from exc
        if self.choice is not None:
            return sum(len(c) for c in self.choice)
        return len(self.json or self.regex or self.grammar or "")


@dataclass
class SamplingParams:
    """Per-request generation parameters (vLLM names and defaults).

    ``temperature == 0`` (or below 1e-5) is exact greedy argmax. ``top_k <= 0`` disables top-k. ``logprobs=k``
    returns the chosen token's logprob plus the ``k`` most likely (k=0: only the chosen one),
    computed from the model's log-softmax before any sampling transform.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]

    @property
    def is_greedy(self) -> bool:
        """Temperatures below ``GREEDY_TEMPERATURE`` are exact argmax (as in vLLM)."""
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def stop_strings(self) -> list[str]:
        return list(self.stop or [])

    @property
    def uses_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    def validate(self, limits: RequestLimits) -> None:
        """Raise :class:`ParameterError` naming the first bad parameter (type, range or cap)."""
        ints = ("n", "top_k", "min_tokens")
        floats = ("temperature", "top_p", "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty")
        for name in ints:
            _require(_is_int(getattr(self, name)), name, f"must be an integer, got {getattr(self, name)!r}")
        for name in floats:
            _require(_is_number(getattr(self, name)), name, f"must be a finite number, got {getattr(self, name)!r}")
        for name in ("seed", "max_tokens", "logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _require(value is None or _is_int(value), name, f"must be an integer or None, got {value!r}")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            _require(isinstance(getattr(self, name), bool), name, f"must be a boolean, got {getattr(self, name)!r}")
        _require(self.n >= 1, "n", f"must be >= 1, got {self.n}")
        _require(limits.max_n is None or self.n <= limits.max_n, "n", f"must be <= {limits.max_n}, got {self.n}")
        _require(
            -1 <= self.top_k < 2**31,
            "top_k",
            f"must be -1 or 0 (disabled) or a positive count below 2**31, got {self.top_k}",
        )
        _require(self.seed is None or 0 <= self.seed < INT63, "seed", f"must be in [0, 2**63), got {self.seed}")
        _require(self.temperature >= 0, "temperature", f"must be >= 0, got {self.temperature}")
        _require(0 < self.top_p <= 1, "top_p", f"must be in (0, 1], got {self.top_p}")
        _require(0 <= self.min_p <= 1, "min_p", f"must be in [0, 1], got {self.min_p}")
        _require(
            1e-3 <= self.repetition_penalty <= 1e3,
            "repetition_penalty",
            f"must be in [0.001, 1000], got {self.repetition_penalty}",
        )
        for name in ("frequency_penalty", "presence_penalty"):
            _require(-2 <= getattr(self, name) <= 2, name, f"must be in [-2, 2], got {getattr(self, name)}")
        if self.max_tokens is not None:
            _require(self.max_tokens >= 1, "max_tokens", f"must be >= 1, got {self.max_tokens}")
            cap = limits.max_tokens_cap
            _require(cap is None or self.max_tokens <= cap, "max_tokens", f"must be <= {cap}, got {self.max_tokens}")
        _require(
            self.min_tokens >= 0 and (self.max_tokens is None or self.min_tokens <= self.max_tokens),
            "min_tokens",
            f"must be in [0, max_tokens], got {self.min_tokens}",
        )
        vocab_size = limits.vocab_size
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _require(value is None or 0 <= value <= vocab_size, name, f"must be in [0, {vocab_size}], got {value}")
            cap = limits.max_top_logprobs
            _require(value is None or cap is None or value <= cap, name, f"must be <= {cap}, got {value}")
        # Counts are checked before anything walks a list, and messages never echo a whole list.
        _require(self.stop is None or isinstance(self.stop, list), "stop", "must be a string or a list of strings")
        cap = limits.max_stop_strings
        _require(
            cap is None or len(self.stop_strings) <= cap,
            "stop",
            f"may hold at most {cap} strings, got {len(self.stop_strings)}",
        )
        empty_or_not_str = [s for s in self.stop_strings if not (isinstance(s, str) and s)]
        _require(not empty_or_not_str, "stop", f"must hold non-empty strings, got {empty_or_not_str[:1]!r}")
        cap, chars = limits.max_stop_chars, sum(len(s) for s in self.stop_strings)
        _require(cap is None or chars <= cap, "stop", f"may hold at most {cap} characters in all, got {chars}")
        if self.stop_token_ids is not None:
            _require(isinstance(self.stop_token_ids, list), "stop_token_ids", "must be a list of integers")
            cap = limits.max_stop_token_ids
            _require(
                cap is None or len(self.stop_token_ids) <= cap,
                "stop_token_ids",
                f"may hold at most {cap} token ids, got {len(self.stop_token_ids)}",
            )
            not_int = [t for t in self.stop_token_ids if not _is_int(t)]
            _require(not not_int, "stop_token_ids", f"must be a list of integers, got {not_int[:1]!r}")
            bad = [t for t in self.stop_token_ids if not 0 <= t < vocab_size]
            _require(not bad, "stop_token_ids", f"{bad} are outside the vocabulary [0, {vocab_size})")
        if self.logit_bias is not None:
            _require(
                isinstance(self.logit_bias, dict),
                "logit_bias",
                f"must be a mapping of token id to bias, got {self.logit_bias!r}",
            )
            for token, bias in self.logit_bias.items():
                _require(
                    _is_int(token) and 0 <= token < vocab_size,
                    "logit_bias",
                    f"token id {token!r} is outside the vocabulary [0, {vocab_size})",
                )
                _require(
                    _is_number(bias) and -100 <= bias <= 100,
                    "logit_bias",
                    f"value for token {token} must be in [-100, 100], got {bias!r}",
                )
        if self.structured_outputs is not None:
            _require(
                isinstance(self.structured_outputs, StructuredOutputsParams),
                "structured_outputs",
                f"must be StructuredOutputsParams, got {type(self.structured_outputs).__name__}",
            )
            self.structured_outputs.validate(limits.max_structured_output_chars)


LOGPROB_FLOOR = -9999.0
"""The lowest logprob reported: -inf (a zero probability) and NaN (non-finite logits, e.g. after a
bad weight update) read as this, so a logprob is always a number JSON can carry."""


@dataclass
class Logprob:
    """Log-probability of one token, with its rank (1 = most likely) under the model; always finite:
    at least :data:`LOGPROB_FLOOR` (what a zero probability or a non-finite model output reads as)."""

    logprob: float
    rank: int


@dataclass
class CompletionOutput:
    """One of the ``n`` completions of a request. In a streamed delta, text/token_ids are the new part."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    weight_versions: list[int] = field(default_factory=list)  # weight version that produced each token
    lora_versions: list[int] = field(default_factory=list)  # with a LoRA adapter: its version for each token

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    num_cached_tokens: int = 0
    embedding: list[float] | None = None  # an embedding request's final delta (see PoolingParams)
    score: float | None = None  # a scoring request's final delta (PoolingParams.task "score")


@dataclass(frozen=True)
class LoRARequest:
    """A request's LoRA adapter, with vLLM's names: ``lora_name`` names an adapter the engine has
    loaded; with ``lora_path`` (a PEFT adapter folder) ``LLM.generate`` loads it under that name
    first if it is not loaded yet. ``lora_int_id`` is accepted for vLLM compatibility and unused."""

    lora_name: str
    lora_int_id: int = 0
    lora_path: str | None = None


@dataclass
class PoolingParams:
    """A pooling request: the prompt's embedding, or its score, instead of generated tokens.

    ``task`` "embed": ``pooling`` "cls" (the first token's final hidden state), "last" (the last
    token's, after the final norm: the Qwen3-Embedding recipe) or "mean" (over every prompt
    position); ``dimensions``: keep the first ``d`` values (Matryoshka), then ``normalize`` (L2).
    None for ``pooling`` / ``normalize``: the model's own (its sentence-transformers files, else
    "cls" for an encoder, "last" for a decoder; normalized). ``task`` "score": the prompt is a
    :class:`ScorePair` and the result one relevance score from the model's classification head or
    its ``classifier_from_token`` pair; ``pooling``, ``normalize`` and ``dimensions`` do not apply.
    ``truncate_prompt_tokens``: cut a longer prompt to ``k`` tokens (a decoder's last ones, an
    encoder's text as its tokenizer truncates it); None: a prompt over the limit is refused."""

    pooling: str | None = None
    normalize: bool | None = None
    dimensions: int | None = None
    truncate_prompt_tokens: int | None = None
    task: str = "embed"

    def validate(self, hidden_size: int, context_limit: int) -> None:
        """Raise :class:`ParameterError` naming the first bad parameter."""
        keep = self.truncate_prompt_tokens
        _require(
            keep is None or (_is_int(keep) and 1 <= keep <= context_limit),
            "truncate_prompt_tokens",
            f"must be an integer in [1, {context_limit}] (the context limit) or None, got {keep!r}",
        )
        _require(self.task in ("embed", "score"), "task", f'must be "embed" or "score", got {self.task!r}')
        _require(
            self.pooling in (None, "cls", "last", "mean"),
            "pooling",
            f'must be "cls", "last", "mean" or None, got {self.pooling!r}',
        )
        _require(self.normalize in (None, True, False), "normalize", f"must be a boolean, got {self.normalize!r}")
        dims = self.dimensions
        _require(dims is None or _is_int(dims), "dimensions", f"must be an integer or None, got {dims!r}")
        _require(
            dims is None or 1 <= dims <= hidden_size,
            "dimensions",
            f"must be in [1, {hidden_size}] (the model's hidden size), got {dims}",
        )
        if self.task == "score":
            for name in ("pooling", "normalize", "dimensions"):
                _require(getattr(self, name) is None, name, "does not apply to scoring (task 'score')")


@dataclass(frozen=True)
class ScorePair:
    """The prompt of a scoring request: how relevant ``document`` is to ``query``; ``instruction``
    fills a decoder reranker's template (None: the template's default)."""

    query: str
    document: str
    instruction: str | None = None


@dataclass
class EmbeddingOutput:
    embedding: list[float]


@dataclass
class EmbeddingRequestOutput:
    """A pooling request's result (vLLM's names); ``finish_reason`` "stop", or "abort"/"error"
    (then ``error`` says why and the embedding is empty)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: EmbeddingOutput
    finished: bool = True
    finish_reason: str | None = None
    error: str | None = None

    @staticmethod
    def from_output(output: RequestOutput) -> EmbeddingRequestOutput:
        """The final delta of a pooling request as its result."""
        completion = output.outputs[0]
        return EmbeddingRequestOutput(
            request_id=output.request_id,
            prompt_token_ids=output.prompt_token_ids,
            outputs=EmbeddingOutput(output.embedding or []),
            finished=output.finished,
            finish_reason=completion.finish_reason,
            error=completion.error,
        )


@dataclass
class ScoringOutput:
    score: float


@dataclass
class ScoringRequestOutput:
    """A scoring request's result (vLLM's names); ``finish_reason`` "stop", or "abort"/"error"
    (then ``error`` says why and the score is NaN)."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: ScoringOutput
    finished: bool = True
    finish_reason: str | None = None
    error: str | None = None

    @staticmethod
    def from_output(output: RequestOutput) -> ScoringRequestOutput:
        """The final delta of a scoring request as its result."""
        completion = output.outputs[0]
        return ScoringRequestOutput(
            request_id=output.request_id,
            prompt_token_ids=output.prompt_token_ids,
            outputs=ScoringOutput(float("nan") if output.score is None else output.score),
            finished=output.finished,
            finish_reason=completion.finish_reason,
            error=completion.error,
        )


@dataclass(frozen=True)
class RerankResult:
    """One document of a reranking: its index in the call's documents, its score and its text."""

    index: int
    score: float
    document: str


OutputCallback = Callable[[RequestOutput], None]


def now() -> float:
    return time.monotonic()


def accumulate(total: RequestOutput | None, delta: RequestOutput) -> RequestOutput:
    """Fold a streamed delta into the cumulative output of a request (returns the new total)."""
    if total is None:
        total = RequestOutput(
            request_id=delta.request_id,
            prompt=delta.prompt,
            prompt_token_ids=delta.prompt_token_ids,
            outputs=[],
            finished=False,
            metrics=delta.metrics,
            prompt_logprobs=delta.prompt_logprobs,
            num_cached_tokens=delta.num_cached_tokens,
        )
    by_index = {c.index: c for c in total.outputs}
    for part in delta.outputs:
        acc = by_index.get(part.index)
        if acc is None:
            acc = by_index[part.index] = CompletionOutput(
                index=part.index, logprobs=[] if part.logprobs is not None else None
            )
        acc.text += part.text
        acc.token_ids += part.token_ids
        acc.weight_versions += part.weight_versions
        acc.lora_versions += part.lora_versions
        if part.logprobs is not None and acc.logprobs is not None:
            acc.logprobs += part.logprobs
        acc.finish_reason, acc.stop_reason, acc.error = part.finish_reason, part.stop_reason, part.error
    total.outputs = [by_index[i] for i in sorted(by_index)]
    total.finished = delta.finished
    total.metrics = delta.metrics
    if delta.prompt_logprobs is not None:
        total.prompt_logprobs = delta.prompt_logprobs
    if delta.embedding is not None:
        total.embedding = delta.embedding
    if delta.score is not None:
        total.score = delta.score
    return total
