"""Structured output through the engine: JSON schema, JSON object, regex, choice, EBNF and Lark
grammars on the bundled default model (which cannot write JSON unconstrained: the grammar does all
the work), with jsonschema / re.fullmatch as oracles; the masked distribution against transformers
on a tiny random model; preemption, stop strings, weight updates, abort; bad specs refused at intake."""

from __future__ import annotations

import contextlib
import json
import os
import re
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import jsonschema
import pytest
import torch
import xgrammar as xgr
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tokenmill.engine.grammar as grammar_module
from tests.tiny_models import save_tiny_checkpoint
from tests.tiny_tokenizer import WORDS
from tokenmill import LLM, SamplingParams
from tokenmill.engine.grammar import apply_grammar_masks
from tokenmill.engine.grammar_compile_worker import CompileWorkerPool
from tokenmill.engine.overload import EngineOverloadedError
from tokenmill.engine.request_state import RequestState
from tokenmill.request import (
    LOGPROB_FLOOR,
    ParameterError,
    RequestLimits,
    RequestOutput,
    StructuredOutputsParams,
    accumulate,
)

PROMPT = "def parse(text):\n"
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "admin": {"type": "boolean"},
        "role": {"enum": ["dev", "ops"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 3},
    },
    "required": ["name", "age", "admin", "role", "tags"],
}
EMAIL = r"[a-z]{1,8}@[a-z]{1,8}\.(com|org)"


@pytest.fixture(scope="module")
def llm() -> LLM:
    engine = LLM(dtype="float32", num_kv_slots=8192)  # the bundled default model
    yield engine
    engine.shutdown()


def generate(llm: LLM, spec: StructuredOutputsParams, prompt: str = PROMPT, **kwargs) -> list:
    params = SamplingParams(structured_outputs=spec, **{"max_tokens": 256, **kwargs})
    return llm.generate([prompt], params, use_tqdm=False)[0].outputs


@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=1.0, seed=3, top_p=0.9, top_k=50)])
def test_json_schema_output_parses_and_validates(llm: LLM, sampling: dict) -> None:
    for spec in (StructuredOutputsParams(json=PERSON), StructuredOutputsParams(json=json.dumps(PERSON))):
        (out,) = generate(llm, spec, **sampling)
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), PERSON)


def test_the_default_model_does_not_write_json_unconstrained(llm: LLM) -> None:
    (out,) = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=64), use_tqdm=False)[0].outputs
    with pytest.raises(json.JSONDecodeError):
        json.loads(out.text)


def test_json_object_is_a_json_object(llm: LLM) -> None:
    outs = generate(llm, StructuredOutputsParams(json_object=True), n=3, seed=0, temperature=1.0, max_tokens=300)
    finished = [o for o in outs if o.finish_reason == "stop"]
    assert finished, [o.text for o in outs]  # a reply may hit max_tokens ("length"), but not all of them
    for out in finished:
        assert isinstance(json.loads(out.text), dict)
    for out in outs:
        assert out.text.startswith("{")


@pytest.mark.parametrize("sampling", [dict(temperature=0.0), dict(temperature=1.0, seed=7)])
def test_regex_output_fully_matches(llm: LLM, sampling: dict) -> None:
    (out,) = generate(llm, StructuredOutputsParams(regex=EMAIL), **sampling)
    assert out.finish_reason == "stop"
    assert re.fullmatch(EMAIL, out.text), out.text


def test_choices_are_literal_text(llm: LLM, capfd: pytest.CaptureFixture[str]) -> None:
    """Characters that mean something in a regex or an EBNF grammar are matched as themselves."""
    choices = ["a+b (c)?", 'say "hi" \\ now', "é ~&|*", "[x]{2}"]
    outputs = generate(llm, StructuredOutputsParams(choice=choices), n=8, seed=3, temperature=1.5)
    assert all(o.text in choices and o.finish_reason == "stop" for o in outputs), [o.text for o in outputs]
    assert "Warning" not in capfd.readouterr().err  # xgrammar warns about escapes its parser does not know


def test_n_siblings_each_follow_their_own_grammar_reproducibly(llm: LLM) -> None:
    choices = ["yes", "no", "maybe not", "it depends"]
    spec = StructuredOutputsParams(choice=choices)
    first = generate(llm, spec, n=6, seed=11, temperature=1.5)
    again = generate(llm, spec, n=6, seed=11, temperature=1.5)
    assert [o.text for o in first] == [o.text for o in again]
    assert all(o.text in choices and o.finish_reason == "stop" for o in first), [o.text for o in first]
    assert len({o.text for o in first}) > 1  # siblings are not copies of one matcher
    jsons = generate(llm, StructuredOutputsParams(json=PERSON), n=3, seed=5, temperature=1.0)
    for out in jsons:
        jsonschema.validate(json.loads(out.text), PERSON)


@pytest.mark.parametrize(
    "grammar, oracle",
    [
        ('root ::= "x=" [0-9] [0-9]? ("," [0-9] [0-9]?)?', r"x=[0-9]{1,2}(,[0-9]{1,2})?"),
        ('start: WORD (" " WORD)?\nWORD: /[a-z]{1,5}/', r"[a-z]{1,5}( [a-z]{1,5})?"),
    ],
    ids=["ebnf", "lark"],
)
def test_grammar_output_matches(llm: LLM, grammar: str, oracle: str) -> None:
    for sampling in (dict(temperature=0.0), dict(temperature=1.0, seed=2)):
        (out,) = generate(llm, StructuredOutputsParams(grammar=grammar), **sampling)
        assert out.finish_reason == "stop"
        assert re.fullmatch(oracle, out.text), out.text


def test_eos_only_when_the_grammar_may_end_and_length_before_it_ends(llm: LLM) -> None:
    spec = StructuredOutputsParams(regex="[a-z]{40}")
    (out,) = generate(llm, spec, temperature=0.0, max_tokens=4)
    assert out.finish_reason == "length" and len(out.token_ids) == 4
    (out,) = generate(llm, spec, temperature=0.0, max_tokens=100, ignore_eos=True)
    assert out.finish_reason == "stop" and re.fullmatch("[a-z]{40}", out.text)
    assert not set(out.token_ids) & llm.engine.eos_token_ids  # the grammar ends the output before any EOS


def test_logprobs_come_from_the_masked_distribution(llm: LLM) -> None:
    (out,) = generate(llm, StructuredOutputsParams(choice=["alpha", "beta"]), temperature=0.0, logprobs=20)
    tokenizer = llm.get_tokenizer()
    first = out.logprobs[0]
    possible = {token: lp.logprob for token, lp in first.items() if lp.logprob > LOGPROB_FLOOR}
    texts = [tokenizer.decode([token]) for token in possible]
    assert {"a", "b"} <= set(texts)
    assert all("alpha".startswith(text) or "beta".startswith(text) for text in texts), texts
    # under 20 tokens may start a choice: all are listed, the rest have probability 0 (the floor)
    assert sum(torch.tensor(list(possible.values())).exp()) == pytest.approx(1.0, abs=1e-4)


def test_stop_strings_end_a_constrained_output(llm: LLM) -> None:
    (out,) = generate(llm, StructuredOutputsParams(choice=["hello world"]), temperature=0.0, stop=["wor"])
    assert (out.text, out.finish_reason, out.stop_reason) == ("hello ", "stop", "wor")


def test_preempted_requests_keep_their_grammar(tmp_path: Path) -> None:
    prompts = [f"{PROMPT}    # case {i}\n" for i in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=200, structured_outputs=StructuredOutputsParams(json=PERSON))
    small = LLM(dtype="float32", num_kv_slots=512, max_num_batched_tokens=64, page_size=4)
    try:
        batched = small.generate(prompts, params, use_tqdm=False)
        assert small.engine.stats()["scheduler"]["preemptions"] > 0
        alone = [small.generate([p], params, use_tqdm=False)[0] for p in prompts]
    finally:
        small.shutdown()
    for together, by_itself in zip(batched, alone):
        assert together.outputs[0].token_ids == by_itself.outputs[0].token_ids
        jsonschema.validate(json.loads(together.outputs[0].text), PERSON)


def test_a_weight_update_mid_request_keeps_the_grammar(llm: LLM) -> None:
    engine = llm.engine
    first, done = threading.Event(), threading.Event()
    total: list[RequestOutput | None] = [None]

    def collect(delta: RequestOutput) -> None:
        total[0] = accumulate(total[0], delta)
        first.set()
        if delta.finished:
            done.set()

    pattern = "[a-z]{300}"
    params = SamplingParams(temperature=0.0, max_tokens=400, structured_outputs=StructuredOutputsParams(regex=pattern))
    engine.add_request(PROMPT, params, collect)
    assert first.wait(60)
    engine.pause_generation()
    try:
        assert not done.is_set()  # 300 letters take far more steps than one
        weights = [(name, t.detach().clone()) for name, t in engine.model.state_dict().items()]
        llm.update_weights(iter([weights[0]]))
    finally:
        engine.resume_generation()
    assert done.wait(120)
    out = total[0].outputs[0]
    assert out.finish_reason == "stop" and re.fullmatch(pattern, out.text)
    assert len(set(out.weight_versions)) == 2


def test_finished_and_aborted_sequences_release_their_matcher(llm: LLM) -> None:
    engine = llm.engine
    ended = {"abort": threading.Event(), "stop": threading.Event()}

    def on_output(delta: RequestOutput) -> None:
        if delta.finished:
            ended[delta.outputs[0].finish_reason].set()

    def intake(spec: StructuredOutputsParams) -> RequestState:
        return engine.intake(PROMPT, SamplingParams(max_tokens=400, structured_outputs=spec), on_output)

    aborted = intake(StructuredOutputsParams(regex="[a-z]{300}"))
    assert aborted.seqs[0].grammar is not None
    engine.submit(aborted)
    engine.abort(aborted.request_id)
    assert ended["abort"].wait(60) and aborted.seqs[0].grammar is None
    finished = intake(StructuredOutputsParams(choice=["ok"]))
    engine.submit(finished)
    assert ended["stop"].wait(60) and finished.seqs[0].grammar is None


@pytest.mark.parametrize(
    "spec, message",
    [
        (dict(regex="("), "regex is invalid: Regex parsing error"),
        (dict(json={"type": "foo"}), 'json is invalid: Unsupported type "foo"'),
        (dict(json="{not json"), "json is invalid"),
        (dict(grammar="root ::= "), "grammar is invalid"),
        (dict(grammar="start: undefined_rule"), "grammar is invalid"),
        (dict(regex="a", choice=["b"]), "must set exactly one of"),
        (dict(), "must set exactly one of"),
        (dict(choice=[]), "choice must be a non-empty list"),
        (dict(choice=["a", ""]), "choice must hold non-empty strings"),
        (dict(json=12), "json must be a schema"),
        (dict(regex="x" * 40_000), "may hold at most 32768 characters"),
        (dict(regex=""), "regex matches only the empty output"),
    ],
)
def test_bad_specs_are_refused_at_intake_before_anything_is_allocated(llm: LLM, spec: dict, message: str) -> None:
    before = llm.engine.stats()
    params = SamplingParams(structured_outputs=StructuredOutputsParams(**spec))
    with pytest.raises(ParameterError, match=re.escape(message)) as refused:
        llm.engine.intake(PROMPT, params, lambda d: None)
    assert refused.value.param == "structured_outputs"
    after = llm.engine.stats()
    assert (after["kv_free_pages"], after["free_rows"], after["active_requests"]) == (
        before["kv_free_pages"],
        before["free_rows"],
        before["active_requests"],
    )


def test_compile_time_limit_and_param_type() -> None:
    engine = LLM(dtype="float32", num_kv_slots=256, structured_output_compile_timeout=1e-9).engine
    slow = SamplingParams(structured_outputs=StructuredOutputsParams(regex="[a-z]{1,500}"))
    try:
        with pytest.raises(ParameterError, match="took longer than 1e-09s to compile") as refused:
            engine.intake(PROMPT, slow, lambda d: None)
    finally:
        engine.shutdown()
    assert refused.value.param == "structured_outputs"
    with pytest.raises(ParameterError, match="must be StructuredOutputsParams"):
        SamplingParams(structured_outputs={"regex": "a"}).validate(RequestLimits(vocab_size=8192))


def test_a_compile_past_its_timeout_is_killed_and_frees_its_slot() -> None:
    """Compiles that outlive their timeout (an object of 800 optional properties takes seconds on
    the tiny vocabulary) are refused at the timeout and stop: with every slot used by such a compile
    a moment earlier, the next spec still compiles (a compile that kept running would hold its slot
    and the next request would be refused as overload), and no compile process keeps using a CPU."""
    engine = LLM(dtype="float32", num_kv_slots=256, structured_output_compile_timeout=0.5).engine
    properties = {f"p{i}": {"type": "integer"} for i in range(800)}
    slow = SamplingParams(structured_outputs=StructuredOutputsParams(json={"type": "object", "properties": properties}))
    quick = SamplingParams(structured_outputs=StructuredOutputsParams(regex="[a-z]{3}"))
    try:
        for _ in range(grammar_module.MAX_CONCURRENT_COMPILES):
            with pytest.raises(ParameterError, match="took longer than 0.5s to compile"):
                engine.intake(PROMPT, slow, lambda d: None)
        state = engine.intake(PROMPT, quick, lambda d: None)
        assert [seq.grammar is not None for seq in state.seqs] == [True]
        before = _children_cpu_seconds()
        time.sleep(1.0)
        assert _children_cpu_seconds() - before < 0.2
    finally:
        engine.shutdown()


def test_a_request_finding_every_compile_slot_busy_is_refused_as_overload(monkeypatch: pytest.MonkeyPatch) -> None:
    """A slot is held for a compile process's start plus at most the timeout: while
    MAX_CONCURRENT_COMPILES slow compiles in new processes hold every slot, a request arriving just
    after them waits its timeout for a slot and is refused as overload (nothing allocated); the
    slow ones end as too slow."""
    monkeypatch.setattr(grammar_module, "WORKERS", CompileWorkerPool())  # no idle process: each compile starts one
    engine = LLM(dtype="float32", num_kv_slots=256, structured_output_compile_timeout=3.0).engine
    properties = {f"p{i}": {"type": "integer"} for i in range(1200)}
    slow = SamplingParams(structured_outputs=StructuredOutputsParams(json={"type": "object", "properties": properties}))
    errors: list[Exception] = []

    def compile_slow() -> None:
        try:
            engine.intake(PROMPT, slow, lambda d: None)
        except ParameterError as exc:
            errors.append(exc)

    threads = [threading.Thread(target=compile_slow) for _ in range(grammar_module.MAX_CONCURRENT_COMPILES)]
    try:
        for thread in threads:
            thread.start()
        time.sleep(0.5)  # both hold a slot: a process starting (importing xgrammar), then 3 s of compiling
        quick = SamplingParams(structured_outputs=StructuredOutputsParams(regex="[a-z]{3}"))
        with pytest.raises(EngineOverloadedError, match="grammar-compile slots stayed busy"):
            engine.intake(PROMPT, quick, lambda d: None)
        for thread in threads:
            thread.join(60)
        assert [str(e) for e in errors] == ["structured_outputs json took longer than 3s to compile; simplify it"] * 2
        assert engine.stats()["active_requests"] == 0
    finally:
        engine.shutdown()


def _children_cpu_seconds() -> float:
    """CPU seconds used so far by this process's live child processes (Linux /proc)."""
    ticks = 0
    for task in Path(f"/proc/{os.getpid()}/task").iterdir():
        for child in (task / "children").read_text().split():
            with contextlib.suppress(FileNotFoundError):
                fields = Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()
                ticks += int(fields[11]) + int(fields[12])  # utime, stime
    return ticks / os.sysconf("SC_CLK_TCK")


def test_masked_greedy_tokens_and_logprobs_equal_transformers(tmp_path: Path) -> None:
    """A tiny word-level model: the grammar allows the words cat/dog/mat, then also EOS (ids 2, 3)."""
    hf_model = save_tiny_checkpoint(tmp_path, "llama")
    words = [WORDS.index(w) + 4 for w in ("cat", "dog", "mat")]
    tiny = LLM(dtype="float32", model=str(tmp_path), num_kv_slots=512)
    prompt = [5, 6, 7, 8, 9]
    spec = StructuredOutputsParams(grammar='root ::= ("cat" | "dog" | "mat")+')
    try:
        out = tiny.generate(
            [prompt],
            SamplingParams(temperature=0.0, max_tokens=12, logprobs=2, structured_outputs=spec),
            use_tqdm=False,
        )[0].outputs[0]
    finally:
        tiny.shutdown()
    ids, expected, expected_lp = list(prompt), [], []
    for step in range(12):
        with torch.no_grad():
            logits = hf_model(torch.tensor([ids])).logits[0, -1].float()
        allowed = words + ([2, 3] if step > 0 else [])
        masked = torch.full_like(logits, float("-inf"))
        masked[allowed] = logits[allowed]
        token = int(masked.argmax())
        expected.append(token)
        expected_lp.append(torch.log_softmax(masked, -1)[token].item())
        if token in (2, 3):
            break
        ids.append(token)
    assert out.token_ids == expected
    assert [lp[t].logprob for lp, t in zip(out.logprobs, out.token_ids)] == pytest.approx(expected_lp, abs=1e-4)
    assert all(set(lp) <= set(words) | {2, 3} for lp in out.logprobs)
    assert out.finish_reason == ("stop" if expected[-1] in (2, 3) else "length")


STRING = st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(1, 10))
INTEGER = st.builds(
    lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
    st.integers(-50, 50),
    st.integers(0, 1000),
)
BOOLEAN = st.just({"type": "boolean"})
ENUM = st.builds(
    lambda values: {"enum": values},
    st.lists(st.text("abcxyz", min_size=1, max_size=5), min_size=1, max_size=3, unique=True),
)
SCALAR = st.one_of(STRING, INTEGER, BOOLEAN, ENUM)
ARRAY = st.builds(lambda items, n: {"type": "array", "items": items, "maxItems": n}, SCALAR, st.integers(0, 3))


@st.composite
def object_schemas(draw: st.DrawFn) -> dict:
    names = draw(st.lists(st.text("abcdefgh", min_size=1, max_size=6), min_size=1, max_size=4, unique=True))
    properties = {name: draw(st.one_of(SCALAR, ARRAY)) for name in names}
    required = [name for name in names if draw(st.booleans())]
    return {"type": "object", "properties": properties, "required": required}


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(schema=object_schemas(), seed=st.integers(0, 2**31))
def test_every_output_under_a_random_schema_validates_and_finishes(llm: LLM, schema: dict, seed: int) -> None:
    spec = StructuredOutputsParams(json=schema)
    params = [
        SamplingParams(temperature=0.0, max_tokens=400, structured_outputs=spec),
        SamplingParams(temperature=1.0, seed=seed, max_tokens=400, structured_outputs=spec),
    ]
    for result in llm.generate([PROMPT, PROMPT], params, use_tqdm=False):
        out = result.outputs[0]
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), schema)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [[0, 1, 2, 3, 4], [3, 0], [4]])
def test_mask_application_equals_xgrammars_kernel(dtype: torch.dtype, rows: list[int]) -> None:
    """The table-lookup mask sets exactly the tokens xgrammar's own kernel sets, in the given rows
    only, whatever the row order, with a vocabulary that is not a multiple of 32 and infinities kept."""
    vocab, generator = 1000, torch.Generator().manual_seed(len(rows))
    logits = torch.randn(5, vocab, generator=generator).to(dtype)
    logits[:, 7], logits[:, 8] = float("inf"), float("-inf")
    words = (vocab + 31) // 32 + 1  # a bitmask may be wider than the logits
    bitmasks = torch.randint(-(2**31), 2**31 - 1, (len(rows), words), dtype=torch.int32, generator=generator)
    expected, by_row = logits.float().clone(), torch.full((5, words), -1, dtype=torch.int32)
    by_row[rows] = bitmasks  # xgrammar's kernel reads row r's bitmask at row r
    xgr.apply_token_bitmask_inplace(expected, by_row, vocab_size=vocab, indices=rows)
    apply_grammar_masks(logits, rows, [SimpleNamespace(bitmask=bitmasks[i : i + 1]) for i in range(len(rows))])
    assert torch.equal(logits.float(), expected)
    assert (logits == float("-inf")).sum() > len(rows) * vocab // 3  # the masks did mask
