"""Constraints that can reach a dead end (issue: reliability round 3, item 4): refused at intake with
a ParameterError naming ``structured_outputs`` when no output can start, ended cleanly ("stop", with
what was produced) when the dead end is reached while decoding; siblings and other requests are
unaffected; never an internal error. Also: JSON schemas given as text obey the nesting cap."""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.request import MAX_SCHEMA_NESTING, ParameterError, StructuredOutputsParams

GREEDY = dict(temperature=0.0, max_tokens=16)


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    engine = LLM(dtype="float32", num_kv_slots=1024)
    yield engine
    engine.shutdown()


def constrained(**spec: object) -> SamplingParams:
    return SamplingParams(**GREEDY, structured_outputs=StructuredOutputsParams(**spec))


@pytest.mark.parametrize(
    "spec",
    [
        {"grammar": "root ::= root"},
        {"grammar": "start: start"},
        {"regex": r"[^\s\S]"},
    ],
    ids=["ebnf-self-loop", "lark-self-loop", "empty-regex-class"],
)
def test_constraints_that_match_nothing_are_refused_at_intake(llm: LLM, spec: dict) -> None:
    with pytest.raises(ParameterError) as caught:
        llm.generate(["x = "], constrained(**spec), use_tqdm=False)
    assert caught.value.param == "structured_outputs"


def test_a_dead_end_reached_while_decoding_ends_with_stop(llm: LLM) -> None:
    """``x`` then a character class with no member: the output stops after what it could write."""
    dead_end = constrained(json={"type": "string", "pattern": "^x[^\\s\\S]$"})
    plain = SamplingParams(**GREEDY)
    outs = llm.generate(["x = ", "y = "], [dead_end, plain], use_tqdm=False)
    stopped = outs[0].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.error is None
    assert stopped.text in ('"x', '"', "")
    assert outs[1].outputs[0].finish_reason in ("length", "stop") and len(outs[1].outputs[0].token_ids) > 0


def test_a_choice_whose_only_token_is_banned_ends_with_stop_for_every_sibling(llm: LLM) -> None:
    tokenizer = llm.engine.tokenizer
    [only] = tokenizer.encode("a", add_special_tokens=False)  # one character: one tokenization
    params = SamplingParams(
        n=2,
        temperature=0.0,
        max_tokens=8,
        min_tokens=2,
        stop_token_ids=[only],
        structured_outputs=StructuredOutputsParams(choice=["a"]),
    )
    [out] = llm.generate(["x = "], params, use_tqdm=False)
    assert [(c.finish_reason, c.token_ids) for c in out.outputs] == [("stop", []), ("stop", [])]


def test_a_schema_given_as_text_obeys_the_nesting_cap(llm: LLM) -> None:
    deep = '{"items": ' * 1200 + "{}" + "}" * 1200
    levels = MAX_SCHEMA_NESTING - 1  # plus the innermost {}: exactly the cap
    at_the_cap = '{"type": "array", "items": ' * levels + "{}" + "}" * levels
    for schema in (deep, '{"a": ' * (MAX_SCHEMA_NESTING + 1) + "1" + "}" * (MAX_SCHEMA_NESTING + 1)):
        with pytest.raises(ParameterError, match="nests deeper than the limit"):
            StructuredOutputsParams(json=schema).validate(None)
    StructuredOutputsParams(json=at_the_cap).validate(None)


def test_a_grammar_whose_matching_cost_explodes_ends_with_an_error_others_finish(llm: LLM) -> None:
    """``(a*)*b`` fed "a" after "a": each token's matching costs more than the last; the sequence
    ends with an error once one token takes over the budget, and a plain request beside it finishes."""
    [a] = llm.engine.tokenizer.encode("a", add_special_tokens=False)
    explosive = SamplingParams(
        temperature=0.0,
        max_tokens=600,
        logit_bias={a: 100.0},
        structured_outputs=StructuredOutputsParams(regex="(a*)*b"),
    )
    outs = llm.generate(["x = ", "y = "], [explosive, SamplingParams(**GREEDY)], use_tqdm=False)
    ended = outs[0].outputs[0]
    assert ended.finish_reason == "error" and "matching one token took" in ended.error
    assert 0 < len(ended.token_ids) < 600
    assert outs[1].outputs[0].finish_reason in ("length", "stop") and outs[1].outputs[0].error is None


@pytest.mark.parametrize(
    "schema, why",
    [
        ({"not": {"type": "string"}}, "not is not enforced"),
        ({"type": "array", "contains": {"const": 5}}, "contains is not enforced"),
        ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "oneOf is enforced only with a discriminator"),
        ({"$ref": "https://example.com/s.json"}, "points outside the schema"),
        ({"type": "string", "maxLength": -1}, "maxLength must be a non-negative integer"),
        ({"type": "object", "properties": {"a": {"type": "array", "contains": {}}}}, "contains is not enforced"),
        ({"$defs": {"x": {"not": {}}}, "$ref": "#/$defs/x"}, "not is not enforced"),
    ],
)
def test_schemas_with_keywords_that_are_not_enforced_are_refused(llm: LLM, schema: dict, why: str) -> None:
    with pytest.raises(ParameterError, match="cannot be enforced: .*" + re.escape(why)):
        llm.generate(["x = "], constrained(json=schema), use_tqdm=False)


def test_enforced_keywords_and_property_names_that_look_like_keywords_are_accepted(llm: LLM) -> None:
    """A property called "not", uniqueItems and a discriminated oneOf compile (xgrammar enforces them)."""
    schema = {
        "type": "object",
        "properties": {
            "not": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True, "maxItems": 2},
            "pet": {
                "oneOf": [
                    {"type": "object", "properties": {"kind": {"const": "cat"}}, "required": ["kind"]},
                    {"type": "object", "properties": {"kind": {"const": "dog"}}, "required": ["kind"]},
                ],
                "discriminator": {"propertyName": "kind"},
            },
        },
        "required": ["not", "pet"],
    }
    [out] = llm.generate(["x = "], constrained(json=schema), use_tqdm=False)
    assert out.outputs[0].error is None
