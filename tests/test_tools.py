"""tools/: the default-model trainer's ``transformers`` Llama has the bundled model's architecture, one training
step saves a checkpoint that tokenmill and transformers load, and the tools import each other one way only."""

from __future__ import annotations

import ast
import importlib
import json
import math
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from tokenmill import LLM, SamplingParams

ROOT = Path(__file__).resolve().parents[1]
TOOLS = ROOT / "tools"
BUNDLED = ROOT / "tokenmill" / "assets" / "tiny-model"


@pytest.fixture(scope="module")
def trainer() -> Iterator[ModuleType]:
    sys.path.insert(0, str(TOOLS))
    try:
        yield importlib.import_module("train_default_model")
    finally:
        sys.path.remove(str(TOOLS))


def _tensor_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    return {name: tuple(tensor.shape) for name, tensor in load_file(path).items()}


def test_one_step_checkpoint_matches_bundled_layout_and_loads(trainer: ModuleType, tmp_path: Path) -> None:
    ids = {token: i for i, token in enumerate(trainer.SPECIAL_TOKENS)}
    model = trainer.build_model(ids)
    assert model.model.embed_tokens.padding_idx is None  # the EOS separator's embedding is trained
    windows = torch.randint(0, trainer.ARCHITECTURE["vocab_size"], (4, 17))
    settings = trainer.TrainSettings(
        steps=1,
        batch_size=2,
        seq_len=16,
        lr=1e-3,
        min_lr_ratio=0.1,
        warmup_steps=1,
        weight_decay=0.1,
        grad_clip=1.0,
        eval_every=1,
        eval_windows=2,
        seed=0,
    )
    [(step, train_loss, val_loss)] = trainer.train(model, windows, windows, settings)
    assert step == 1 and math.isfinite(train_loss) and math.isfinite(val_loss)

    model.save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(BUNDLED / name, tmp_path / name)
    assert _tensor_shapes(tmp_path / "model.safetensors") == _tensor_shapes(BUNDLED / "model.safetensors")
    # save_pretrained adds "transformers_version" and drops the transformers-4 spellings the old writer kept.
    dropped = {"config.json": {"rope_theta", "rope_scaling", "torch_dtype"}, "generation_config.json": set()}
    for name, gone in dropped.items():
        saved, bundled = (json.loads((folder / name).read_text()) for folder in (tmp_path, BUNDLED))
        assert saved.keys() - bundled.keys() == {"transformers_version"} and bundled.keys() - saved.keys() == gone
        kept = bundled.keys() - gone
        assert {key: saved[key] for key in kept} == {key: bundled[key] for key in kept}, name

    batch = windows[:2, :-1]
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, local_files_only=True, dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(batch).logits, model.eval()(batch).logits)

    prompt = batch[0, :8].tolist()
    with torch.no_grad():
        ids = torch.tensor([prompt])
        expected = reloaded.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=4,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )[0, len(prompt) :].tolist()
    llm = LLM(dtype="float32", model=str(tmp_path))
    try:
        [out] = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    finally:
        llm.shutdown()
    assert out.outputs[0].token_ids == expected  # tokenmill runs the trained checkpoint as transformers does


def _imported_modules(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_tools_import_each_other_one_way() -> None:
    tools = {path.stem for path in TOOLS.glob("*.py")}
    assert _imported_modules(TOOLS / "corpus.py") & tools == set()
    assert _imported_modules(TOOLS / "measure_perplexity.py") & tools == {"corpus"}
    assert _imported_modules(TOOLS / "train_default_model.py") & tools == {"corpus", "measure_perplexity"}
