"""OpenAI request fields -> SamplingParams (:func:`openai_params`) and the request's output constraint.

An OpenAI request constrains its output through at most one of ``response_format`` (other than
"text"), vLLM's ``structured_outputs``, or one of its older ``guided_json`` / ``guided_regex`` /
``guided_choice`` / ``guided_grammar``; :func:`structured_outputs` says which one, so that the
engine's refusal of the constraint names the request's own parameter.
"""

from __future__ import annotations

from tokenmill.request import ParameterError, SamplingParams, StructuredOutputsParams
from tokenmill.server.openai.protocol import OpenAISampling
from tokenmill.server.shared.params import OutputConstraint, sampling_params

# vLLM's older names -> the StructuredOutputsParams field each one sets
_GUIDED_FIELDS = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


_OPENAI_FIELDS = (
    "n",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "frequency_penalty",
    "presence_penalty",
    "seed",
    "min_tokens",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "include_stop_str_in_output",
    "skip_special_tokens",
    "prompt_logprobs",
)


def openai_params(
    body: OpenAISampling, max_tokens: int | None, logprobs: int | None, constraint: OutputConstraint | None = None
) -> SamplingParams:
    """SamplingParams of an OpenAI request (``logit_bias`` keys are token ids as strings)."""
    fields = {name: getattr(body, name) for name in _OPENAI_FIELDS}
    fields["structured_outputs"] = constraint.spec if constraint else None
    if body.logit_bias:
        try:
            fields["logit_bias"] = {int(token): bias for token, bias in body.logit_bias.items()}
        except ValueError as exc:
            raise ParameterError("logit_bias", f"keys must be token ids, got {list(body.logit_bias)}") from exc
    return sampling_params(fields, max_tokens, logprobs)


def structured_outputs(body: OpenAISampling) -> OutputConstraint | None:
    """The request's output constraint; None if unconstrained.

    Raises ParameterError naming the second parameter when two of them are set.
    """
    given: list[OutputConstraint] = []
    response_format = body.response_format
    if response_format is not None and response_format.type != "text":
        json_schema = response_format.json_schema
        if json_schema is not None and json_schema.schema_ is not None:
            given.append(OutputConstraint("response_format", StructuredOutputsParams(json=json_schema.schema_)))
        else:
            given.append(OutputConstraint("response_format", StructuredOutputsParams(json_object=True)))
    if body.structured_outputs is not None:
        spec = body.structured_outputs.model_dump(by_alias=True, exclude_none=True)
        given.append(OutputConstraint("structured_outputs", StructuredOutputsParams(**spec)))
    for name, field in _GUIDED_FIELDS.items():
        value = getattr(body, name)
        if value is not None:
            given.append(OutputConstraint(name, StructuredOutputsParams(**{field: value})))
    if len(given) > 1:
        first, second = given[0].param, given[1].param
        raise ParameterError(second, f"cannot be combined with {first}: a request takes one output constraint")
    return given[0] if given else None
