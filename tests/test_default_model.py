"""The default model (SmolLM2-135M-Instruct, Q4_1 GGUF): what runs when no model is named, its
tokenizer and chat template equal transformers' GGUF tokenizer, and its greedy chat answers equal
transformers' (which dequantizes the same file) in fp32."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tokenmill import LLM, SamplingParams
from tokenmill.bench.workload import copy_heavy_messages
from tokenmill.config import EngineConfig
from tokenmill.default_model import DEFAULT_MODEL_DIR, DEFAULT_MODEL_FILE, FETCH_COMMAND

pytestmark = pytest.mark.skipif(
    not (DEFAULT_MODEL_DIR / DEFAULT_MODEL_FILE).is_file(),
    reason=f"the default model is not fetched (`{FETCH_COMMAND}`; .ci/run fetches it)",
)
QUESTIONS = ["What is the capital of France?", "What is 2+2?", "Name a primary color."]
TEXTS = ["Hello world", "def f(x):\n\treturn x  # ünïcode ✓", "  leading spaces and <|im_end|> text"]
ANSWER_TOKENS = 24


@pytest.fixture(scope="module")
def transformers_gguf() -> tuple:
    tokenizer = AutoTokenizer.from_pretrained(str(DEFAULT_MODEL_DIR), gguf_file=DEFAULT_MODEL_FILE)
    model = AutoModelForCausalLM.from_pretrained(
        str(DEFAULT_MODEL_DIR), gguf_file=DEFAULT_MODEL_FILE, dtype=torch.float32
    )
    return tokenizer, model


@pytest.fixture(scope="module")
def llm() -> LLM:
    engine = LLM(model=str(DEFAULT_MODEL_DIR), dtype="float32", num_kv_slots=2048)
    yield engine
    engine.shutdown()


def test_no_model_means_the_default_model(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TOKENMILL_DEFAULT_MODEL")
    config = EngineConfig()
    assert config.model_name() == DEFAULT_MODEL_DIR.name
    assert config.model_path() == EngineConfig(model=str(DEFAULT_MODEL_DIR / DEFAULT_MODEL_FILE)).model_path()


def test_tokenizer_and_chat_template_equal_transformers(llm: LLM, transformers_gguf: tuple) -> None:
    theirs, _ = transformers_gguf
    ours = llm.engine.tokenizer
    for text in TEXTS:
        ids = theirs.encode(text)
        assert ours.encode(text) == ids
        assert ours.decode(ids, skip_special_tokens=False) == theirs.decode(ids, skip_special_tokens=False)
    for question in QUESTIONS:
        messages = [{"role": "user", "content": question}]
        assert ours.apply_chat_template(messages) == _template_ids(theirs, messages)


def test_greedy_chat_answers_equal_transformers(llm: LLM, transformers_gguf: tuple) -> None:
    tokenizer, model = transformers_gguf
    params = SamplingParams(temperature=0.0, max_tokens=ANSWER_TOKENS)
    conversations = [[{"role": "user", "content": q}] for q in QUESTIONS]
    outputs = llm.chat(conversations, params, use_tqdm=False)
    for messages, out in zip(conversations, outputs):
        prompt = torch.tensor([_template_ids(tokenizer, messages)])
        with torch.no_grad():
            ref = model.generate(
                prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=ANSWER_TOKENS, do_sample=False
            )
        expected = ref[0, prompt.shape[1] :].tolist()
        if expected[-1] == tokenizer.eos_token_id:
            expected = expected[:-1]  # tokenmill leaves the EOS token out of the text's ids
        assert out.outputs[0].token_ids[: len(expected)] == expected
    assert "Paris" in outputs[0].outputs[0].text


def test_the_default_dtype_answers_like_transformers_too() -> None:
    """bf16 with int8-activation kernels where the CPU has them (else fp32): the first token's top two
    logits are 0.08 apart in fp32, which one int8 activation pass flips (llama.cpp's answer)."""
    llm = LLM(model=str(DEFAULT_MODEL_DIR), num_kv_slots=1024)
    try:
        [out] = llm.chat([{"role": "user", "content": QUESTIONS[0]}], SamplingParams(temperature=0.0, max_tokens=12))
    finally:
        llm.shutdown()
    assert out.outputs[0].text.startswith("The capital of France is Paris")


def test_prompt_lookup_in_the_default_dtype_gives_plain_decodings_tokens_and_logprobs() -> None:
    """Every projection of this file is quantized (Q4_1, a Q8_0 head): in the default dtype on a
    VNNI / AMX CPU a verification's 6 rows run the int8 kernels in tiles where a plain step's one
    row runs the vector path, so equal tokens and logprobs need each row's product to be the same
    bits whatever rows stand beside it (on other CPUs: fp32, the same contract)."""
    messages = copy_heavy_messages()[:2]
    params = SamplingParams(temperature=0.0, max_tokens=48, logprobs=1)
    runs, stats = [], None
    for speculative in (None, {"method": "ngram", "num_speculative_tokens": 5, "disable_by_batch_size": 8}):
        llm = LLM(model=str(DEFAULT_MODEL_DIR), num_kv_slots=4096, speculative_config=speculative)
        try:
            runs.append([o.outputs[0] for o in llm.chat(messages, params, use_tqdm=False)])
            stats = llm.engine.stats()["speculative"]
        finally:
            llm.shutdown()
    plain, speculated = runs
    assert 0 < stats["accepted_tokens"] < stats["proposed_tokens"]
    assert [o.token_ids for o in speculated] == [o.token_ids for o in plain]
    assert [o.logprobs for o in speculated] == [o.logprobs for o in plain]


def _template_ids(tokenizer: AutoTokenizer, messages: list[dict]) -> list[int]:
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
