"""The README's commands run as a user runs them (the installed ``tokenmill`` script, a process each):
``generate`` and ``chat`` on the bundled default model print what the Python API generates, with the
sampling defaults of a model's ``generation_config.json``; ``bench throughput`` on a tiny checkpoint
reports the workload it was asked for; every option explains itself in ``--help``."""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.tiny_models import save_tiny_checkpoint
from tokenmill import LLM, SamplingParams
from tokenmill.bench.workload import make_workload
from tokenmill.cli import build_parser
from tokenmill.hardware import native_bf16

MAX_TOKENS = 8
ENGINE_FLAGS = ["--dtype", "float32", "--num-kv-slots", "2048"]  # engine options are flags too


def tokenmill(*args: str, columns: int = 80) -> subprocess.CompletedProcess[str]:
    """Run the ``tokenmill`` console script with this process's torch thread count (same numerics);
    ``columns``: the terminal width help text is wrapped to."""
    script = Path(sys.executable).with_name("tokenmill")
    command = [str(script)] if script.is_file() else [shutil.which("tokenmill") or "tokenmill"]
    env = os.environ | {"OMP_NUM_THREADS": str(torch.get_num_threads()), "COLUMNS": str(columns)}
    result = subprocess.run([*command, *args], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr
    return result


@pytest.fixture(scope="module")
def default_llm() -> LLM:
    llm = LLM(dtype="float32", num_kv_slots=2048)  # the bundled default model, as the commands use it
    yield llm
    llm.shutdown()


def test_generate_prints_the_prompt_and_its_greedy_continuation(default_llm: LLM) -> None:
    prompt = "def fibonacci("
    result = tokenmill("generate", prompt, "--max-tokens", str(MAX_TOKENS), *ENGINE_FLAGS)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    expected = default_llm.generate([prompt], greedy, use_tqdm=False)[0].outputs[0]
    assert len(expected.token_ids) == MAX_TOKENS and expected.text
    assert result.stdout == prompt + expected.text + "\n"
    assert "LlamaForCausalLM on cpu in float32" in result.stderr  # the start-up log line


def test_chat_prints_each_reply_with_the_history_in_the_prompt(default_llm: LLM) -> None:
    first, second = "Explain this function: def f(x): return x + 1", "And def g(x): return f(x) * 2?"
    # 16 tokens: enough for the second reply to depend on the first (the default model attends mostly nearby)
    result = tokenmill("chat", "--message", first, "--message", second, "--max-tokens", "16", *ENGINE_FLAGS)
    greedy = SamplingParams(temperature=0.0, max_tokens=16)
    history = [{"role": "user", "content": first}]
    reply = default_llm.chat(history, greedy, use_tqdm=False)[0].outputs[0].text
    history += [{"role": "assistant", "content": reply}, {"role": "user", "content": second}]
    reply2 = default_llm.chat(history, greedy, use_tqdm=False)[0].outputs[0].text
    assert reply and reply2
    assert result.stdout == reply + "\n" + reply2 + "\n"


def test_sampling_defaults_come_from_the_models_generation_config(tmp_path: Path) -> None:
    """Options the user does not give take the model's generation_config.json values (named once on
    stderr); options the user gives win. The oracle: the Python API with those values."""
    save_tiny_checkpoint(tmp_path, "llama")
    config = json.loads((tmp_path / "generation_config.json").read_text())  # transformers' own: EOS ids
    config |= {"temperature": 0.7, "top_k": 5, "repetition_penalty": 1.3, "max_new_tokens": 6, "do_sample": True}
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    flags = ["--model", str(tmp_path), "--seed", "3", *ENGINE_FLAGS]
    prompt, message = "the cat sat", "hello world"
    llm = LLM(model=str(tmp_path), dtype="float32", num_kv_slots=2048, seed=3)
    try:
        model_defaults = SamplingParams(temperature=0.7, top_k=5, repetition_penalty=1.3, max_tokens=6, seed=3)
        sampled = llm.generate([prompt], model_defaults, use_tqdm=False)[0].outputs[0]
        user_wins = SamplingParams(temperature=0.0, top_k=5, repetition_penalty=1.3, max_tokens=4, seed=3)
        greedy = llm.generate([prompt], user_wins, use_tqdm=False)[0].outputs[0]
        chatted = llm.chat([{"role": "user", "content": message}], model_defaults, use_tqdm=False)[0].outputs[0]
    finally:
        llm.shutdown()
    assert (len(sampled.token_ids), len(greedy.token_ids)) == (6, 4), "the tiny model ended early; pick another prompt"

    result = tokenmill("generate", prompt, *flags)
    assert result.stdout == prompt + sampled.text + "\n"
    note = "sampling defaults from the model's generation_config.json: "
    notes = [line for line in result.stderr.splitlines() if line.startswith(note)]
    assert notes == [note + "max_tokens=6, temperature=0.7, top_k=5, repetition_penalty=1.3"]

    result = tokenmill("generate", prompt, "--temperature", "0", "--max-tokens", "4", *flags)
    assert result.stdout == prompt + greedy.text + "\n"
    assert [line for line in result.stderr.splitlines() if line.startswith(note)] == [
        note + "top_k=5, repetition_penalty=1.3"
    ]

    result = tokenmill("chat", "--message", message, "--message", message, *flags)
    assert result.stdout.splitlines()[0] == chatted.text
    assert len([line for line in result.stderr.splitlines() if line.startswith(note)]) == 1  # once, not per turn


def options(parser: argparse.ArgumentParser, command: str = "tokenmill") -> dict[str, argparse.Action]:
    """Every option of ``parser`` and of its subcommands, as ``"command --option"``."""
    found = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found |= options(sub, f"{command} {name}")
        for flag in action.option_strings:
            found[f"{command} {flag}"] = action
    return found


def test_every_option_of_every_command_explains_itself() -> None:
    every = options(build_parser())
    assert {"tokenmill serve --page-size", "tokenmill serve --header-timeout-seconds", "tokenmill chat --top-p"} <= set(
        every
    )
    assert {"tokenmill bench serve --request-rate", "tokenmill generate --no-cuda-graphs"} <= set(every)
    undocumented = sorted(name for name, action in every.items() if not action.help or not action.help.strip())
    assert undocumented == []
    # the engine options' help is the EngineConfig field's help, as config.py has it, and the default
    page_size = "Slots per KV page (power of two, 1..256). 1 = token-level allocation."
    assert every["tokenmill serve --page-size"].help == page_size + " (default: 1)"

    help_text = tokenmill("serve", "--help", columns=1000).stdout  # one line per option: no wrapping
    assert re.search(rf"^  --page-size INT +{re.escape(page_size)} \(default: 1\)$", help_text, re.MULTILINE)
    for group in (
        "engine options: model:",
        "engine options: KV cache:",
        "engine options: Batching:",
        "connection limits:",
    ):
        assert f"\n{group}\n" in help_text
    assert re.search(r"^  --port PORT +port to listen on \(default: 8000\)$", help_text, re.MULTILINE)


def test_bench_throughput_reports_the_requested_workload(tmp_path: Path) -> None:
    save_tiny_checkpoint(tmp_path, "llama")
    workload = ["--num-prompts", "2", "--prompt-len", "4", "8", "--output-len", "2", "4", "--model", str(tmp_path)]
    report = json.loads(tokenmill("bench", "throughput", *workload, "--json").stdout)
    work = make_workload(2, (4, 8), (2, 4), vocab_size=97, seed=0)  # the command's default seed
    assert report["n_requests"] == 2 and report["preemptions"] == 0
    assert report["prompt_tokens"] == sum(map(len, work.prompts))
    assert report["output_tokens"] == sum(work.output_lens)  # greedy, ignore_eos: exactly the asked lengths
    assert report["dtype"] == ("bfloat16" if native_bf16() else "float32")  # dtype "auto"
    assert isinstance(report["attention_backend"], str) and report["attention_backend"]
    elapsed = report["elapsed_s"]
    assert elapsed > 0 and report["requests_per_s"] == pytest.approx(2 / elapsed)
    assert report["input_tok_per_s"] == pytest.approx(report["prompt_tokens"] / elapsed)
    assert report["output_tok_per_s"] == pytest.approx(report["output_tokens"] / elapsed)
    for latency in ("ttft_ms", "tpot_ms"):
        s = report[latency]
        assert set(s) == {"mean", "p50", "p99"} and 0 < min(s.values()) and s["p50"] <= s["p99"]
    assert 0 <= report["peak_kv_usage"] <= 1 and 0 <= report["engine_overhead"] <= 1
    assert report["quantization"] == "none" and report["weight_bytes"] > 0
    assert report["kv_cache_dtype"] == report["dtype"]  # "auto": the model's

    text = tokenmill("bench", "throughput", *workload, "--quantization", "int8").stdout.splitlines()
    number = r"\d+(\.\d+)?"
    mib = re.search(r"weights int8-per-channel (\d+\.\d+) MiB", text[0])
    assert mib is not None and float(mib.group(1)) < report["weight_bytes"] / 2**20  # int8: fewer bytes
    expected_lines = [
        rf"requests: 2, prompt tokens: {report['prompt_tokens']}, output tokens: {report['output_tokens']} "
        rf"\({report['dtype']}, KV {report['kv_cache_dtype']}, attention backend {report['attention_backend']}, "
        rf"weights int8-per-channel "
        rf"{number} MiB\)",
        rf"elapsed {number} s: {number} req/s, {number} input tok/s, {number} output tok/s",
        rf"TTFT ms: mean {number}, p50 {number}, p99 {number}",
        rf"TPOT ms: mean {number}, p50 {number}, p99 {number}",
        rf"peak KV usage {number}%, engine overhead {number}%, preemptions 0",
    ]
    assert len(text) == len(expected_lines)
    for line, pattern in zip(text, expected_lines):
        assert re.fullmatch(pattern, line), (line, pattern)


def test_a_model_that_cannot_be_had_ends_the_command_as_a_bad_flag_does(tmp_path: Path) -> None:
    """A path that is no checkpoint, a missing draft model, a path given to ``pull``: one line
    ``tokenmill: error: ...`` and exit status 2, no traceback (#62)."""
    save_tiny_checkpoint(tmp_path / "tiny")
    draft = json.dumps({"method": "draft_model", "model": str(tmp_path / "nowhere"), "num_speculative_tokens": 2})
    script = Path(sys.executable).with_name("tokenmill")
    command = [str(script)] if script.is_file() else [shutil.which("tokenmill") or "tokenmill"]
    cases = [
        (["generate", "--model", "../../x", "hi"], "no config.json in ../../x"),
        (["generate", "--model", str(tmp_path / "tiny"), "--speculative-config", draft, "hi"], "nowhere"),
        (["pull", "../../x"], "is not a Hugging Face id"),
    ]
    for args, message in cases:
        result = subprocess.run([*command, *args], capture_output=True, text=True, cwd=tmp_path, timeout=300)
        assert result.returncode == 2, (args, result.stderr)
        assert "Traceback" not in result.stderr and "tokenmill: error: " in result.stderr, result.stderr
        assert message in result.stderr, result.stderr
