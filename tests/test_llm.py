"""README behaviours of the ``LLM`` API: ``chat`` (against transformers' chat template and greedy
generation), ``skip_tokenizer_init`` on a checkpoint without a tokenizer, and ``dtype="auto"`` on CPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, PreTrainedModel

from tests.tiny_models import hf_greedy, save_tiny_checkpoint, save_tiny_model
from tokenmill import LLM, SamplingParams
from tokenmill.config import EngineConfig
from tokenmill.hardware import native_bf16
from tokenmill.request import ParameterError

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
CONVERSATIONS = [
    [{"role": "system", "content": "the cat"}, {"role": "user", "content": "hello world"}],
    [
        {"role": "user", "content": "def x ( y )"},
        {"role": "assistant", "content": "return y + one"},
        {"role": "user", "content": "and the dog"},
    ],
]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, PreTrainedModel]:
    path = tmp_path_factory.mktemp("tiny-llama-chat")
    return path, save_tiny_checkpoint(path, "llama")


def test_chat_renders_the_template_and_generates_like_transformers(checkpoint) -> None:
    path, hf_model = checkpoint
    hf_model.generation_config.eos_token_id = None
    hf_tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    llm = LLM(dtype="float32", model=str(path), num_kv_slots=1024)
    try:
        batch = llm.chat(CONVERSATIONS, GREEDY, use_tqdm=False)  # a list of conversations
        single = llm.chat(CONVERSATIONS[1], GREEDY, use_tqdm=False)  # one conversation (the README's call)
        no_prompt = llm.chat(CONVERSATIONS[0], GREEDY, use_tqdm=False, add_generation_prompt=False)
    finally:
        llm.shutdown()
    assert len(batch) == 2 and len(single) == 1
    for conversation, out in zip(CONVERSATIONS, batch):
        expected = hf_tokenizer.apply_chat_template(
            conversation, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        assert out.prompt_token_ids == expected
        assert out.outputs[0].token_ids == hf_greedy(hf_model, expected, 6)
        whole, prompt_text = (hf_tokenizer.decode(ids) for ids in (expected + out.outputs[0].token_ids, expected))
        assert out.outputs[0].text == whole.removeprefix(prompt_text)
    assert single[0].prompt_token_ids == batch[1].prompt_token_ids
    assert single[0].outputs[0].token_ids == batch[1].outputs[0].token_ids
    assert no_prompt[0].prompt_token_ids == hf_tokenizer.apply_chat_template(
        CONVERSATIONS[0], add_generation_prompt=False, tokenize=True, return_dict=False
    )
    assert no_prompt[0].prompt_token_ids != batch[0].prompt_token_ids


def test_skip_tokenizer_init_serves_token_ids_from_a_folder_without_a_tokenizer(tmp_path: Path) -> None:
    hf_model = save_tiny_model(tmp_path, "llama")  # config.json + model.safetensors only
    hf_model.generation_config.eos_token_id = None
    with pytest.raises(FileNotFoundError, match="cannot load a tokenizer"):
        LLM(dtype="float32", model=str(tmp_path), num_kv_slots=256)
    llm = LLM(dtype="float32", model=str(tmp_path), num_kv_slots=256, skip_tokenizer_init=True)
    try:
        assert llm.engine.tokenizer is None
        prompts = [[5, 6, 7], [9, 10, 11, 12, 13]]
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
        for prompt, out in zip(prompts, outputs):
            assert out.prompt is None and out.prompt_token_ids == prompt
            assert out.outputs[0].token_ids == hf_greedy(hf_model, prompt, 6)
            assert out.outputs[0].text == ""  # no tokenizer, no text
        with pytest.raises(ParameterError, match="must be token ids") as text_prompt:
            llm.generate(["hello world"], GREEDY, use_tqdm=False)
        assert text_prompt.value.param == "prompt"
        with pytest.raises(ParameterError) as stop_string:
            llm.generate([[5, 6]], SamplingParams(max_tokens=4, stop=["x"]), use_tqdm=False)
        assert stop_string.value.param == "stop"
        tokens = outputs[0].outputs[0].token_ids  # stop token ids work without a tokenizer
        stop = SamplingParams(temperature=0.0, max_tokens=6, stop_token_ids=[tokens[-1]])
        stopped = llm.generate([prompts[0]], stop, use_tqdm=False)[0].outputs[0]
        assert stopped.token_ids == tokens[: tokens.index(tokens[-1]) + 1] and stopped.finish_reason == "stop"
    finally:
        llm.shutdown()


def test_dtype_auto_on_cpu_is_bf16_exactly_where_the_cpu_multiplies_bf16(
    checkpoint, monkeypatch: pytest.MonkeyPatch
) -> None:
    path, _ = checkpoint
    expected = torch.bfloat16 if native_bf16() else torch.float32
    llm = LLM(dtype="auto", device="cpu", model=str(path), num_kv_slots=256)  # the default dtype
    try:
        assert EngineConfig().dtype == "auto"
        assert llm.engine.dtype == expected
        assert {p.dtype for p in llm.engine.model.parameters()} == {expected}
        assert len(llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 6
    finally:
        llm.shutdown()
    # the rule itself, on both kinds of CPU, whatever the checkpoint's dtype
    for native, dtype in ((True, torch.bfloat16), (False, torch.float32)):
        monkeypatch.setattr("tokenmill.config.model.native_bf16", lambda native=native: native)
        for checkpoint_dtype in (None, torch.float16, torch.float32, torch.bfloat16):
            assert EngineConfig(dtype="auto", device="cpu").resolved_dtype(checkpoint_dtype) == dtype


def test_a_batch_larger_than_the_waiting_queue_completes_in_order(checkpoint) -> None:
    """Offline batches are not refused as overload: they go in as the waiting queue frees up."""
    path, _ = checkpoint
    llm = LLM(dtype="float32", model=str(path), num_kv_slots=1024, max_waiting_requests=2, max_running_requests=2)
    prompts = [[5, 6 + i, 7] for i in range(7)]
    try:
        together = llm.generate(prompts, GREEDY, use_tqdm=False)
        alone = [llm.generate([p], GREEDY, use_tqdm=False)[0] for p in prompts]
    finally:
        llm.shutdown()
    assert [o.prompt_token_ids for o in together] == prompts
    assert [o.outputs[0].token_ids for o in together] == [o.outputs[0].token_ids for o in alone]
    assert all(len(o.outputs[0].token_ids) == 6 for o in together)
