"""Encoder models and scoring against transformers, fp32, models built here (``tests/tiny_encoders``).

- Embeddings of ``BertModel`` and ``XLMRobertaModel`` sentence-transformers folders ("cls" / "mean"
  pooling, with and without a Normalize module) against the pooled ``last_hidden_state`` of
  ``hf(**tokenizer(text, return_tensors="pt"))``: the folder's pooling is the default, explicit
  ``PoolingParams`` override it, batch composition changes nothing, token-id prompts get no special
  tokens; the position limit (BERT: 128 tokens, XLM-R: 126) and ``truncate_prompt_tokens`` (the
  tokenizer's ``truncation=True, max_length=k``).
- Cross-encoders (``BertForSequenceClassification`` with its token type ids,
  ``XLMRobertaForSequenceClassification``): ``LLM.score`` against ``sigmoid(hf(**tok(query, doc)).logits)``,
  ``LLM.rerank`` sorted by those.
- A decoder reranker (tiny qwen3, ``classifier_from_token``, ``score_template``, chunked prefill):
  the softmax of ``Qwen3ForCausalLM``'s last-position logits of the token pair.
- An embedder's score: the cosine similarity of two ``embed`` results (and of transformers' vectors).
- Refusals naming the parameter, before anything is allocated; encoder settings refused at build.
- Many mixed-length inputs under a small token budget: each whole in one step, each its oracle.
"""

from __future__ import annotations

import json
import math
import queue
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import transformers
from transformers import AutoTokenizer

from tests.embedding_checks import assert_embedding_close
from tests.tiny_encoders import save_tiny_encoder
from tests.tiny_models import save_tiny_checkpoint
from tests.tiny_tokenizer import WORDS
from tokenmill import LLM, PoolingParams, RequestOutput, SamplingParams
from tokenmill.model.config import ModelConfigError
from tokenmill.request import ParameterError

Tokenizer = transformers.PreTrainedTokenizerBase
Reranker = tuple[LLM, transformers.PreTrainedModel, Tokenizer]
HIDDEN = 64
"""The tiny encoders' hidden size."""
POSITION_LIMIT = {"bert": 128, "xlmr": 126}
"""Longest input of each family: max_position_embeddings 128 (XLM-R's positions start after pad id 1)."""


def words(n: int, shift: int = 0) -> str:
    """A text of ``n`` vocabulary words (each one token)."""
    return " ".join(WORDS[(7 * i + shift) % len(WORDS)] for i in range(n))


TEXTS = [words(3), words(19, 2), words(1, 5), words(9, 11), words(40, 3)]
IDS = [40, 7, 33, 8, 61, 90, 5, 12, 12, 77]
"""A token-id prompt (no pad id: XLM-R's transformers positions skip padding ids)."""


@dataclass
class Encoder:
    llm: LLM
    hf: transformers.PreTrainedModel
    tok: Tokenizer
    family: str
    pooling: str  # the folder's sentence-transformers pooling
    normalize: bool  # ... and whether it has a Normalize module


def hidden_states(hf: transformers.PreTrainedModel, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        return hf(**inputs).last_hidden_state[0].float()


def oracle(
    enc: Encoder,
    prompt: str | list[int],
    pooling: str,
    normalize: bool,
    dimensions: int | None = None,
    max_length: int | None = None,
) -> torch.Tensor:
    """transformers' embedding of a text (tokenized by the folder's tokenizer, truncated to
    ``max_length`` when given) or of token ids as given."""
    if isinstance(prompt, str):
        cut = {"truncation": True, "max_length": max_length} if max_length is not None else {}
        inputs = enc.tok(prompt, return_tensors="pt", **cut)
    else:
        inputs = {"input_ids": torch.tensor([prompt])}
    hidden = hidden_states(enc.hf, inputs)
    vector = hidden[0] if pooling == "cls" else hidden.mean(0)
    vector = vector[:dimensions] if dimensions is not None else vector
    return torch.nn.functional.normalize(vector, dim=0) if normalize else vector


def refused(llm: LLM, param: str, call: Callable[[], object], match: str | None = None) -> ParameterError:
    """``call()`` raises ParameterError naming ``param`` and leaves every KV page free as it was."""
    free = llm.engine.stats()["kv_free_pages"]
    with pytest.raises(ParameterError, match=match) as info:
        call()
    assert info.value.param == param
    assert llm.engine.stats()["kv_free_pages"] == free
    return info.value


def embed_in_one_step(llm: LLM, prompts: list[str | list[int]], params: PoolingParams) -> list[list[float]]:
    """Every prompt's embedding, all queued while the loop is paused so that they run in one step."""
    engine = llm.engine
    finals: queue.Queue[RequestOutput] = queue.Queue()
    steps = engine.stats()["scheduler"]["steps"]
    engine.pause_generation()
    try:
        for i, prompt in enumerate(prompts):
            engine.add_request(prompt, params, lambda d: finals.put(d) if d.finished else None, f"batch-{i}")
    finally:
        engine.resume_generation()
    got = {(d := finals.get(timeout=60)).request_id: d for _ in prompts}
    assert engine.stats()["scheduler"]["steps"] - steps == 1
    return [got[f"batch-{i}"].embedding for i in range(len(prompts))]


# ---------------------------------------------------------------------------------------- embedders
EMBEDDERS = [("bert", "cls", True, 5), ("bert", "mean", False, 6), ("xlmr", "cls", False, 6), ("xlmr", "mean", True, 5)]
"""(family, pooling, normalize, the sentence-transformers version whose pooling config layout the folder has)"""


@pytest.fixture(scope="module", params=EMBEDDERS, ids=lambda p: f"{p[0]}-{p[1]}-{'norm' if p[2] else 'raw'}-st{p[3]}")
def embedder(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Encoder]:
    family, pooling, normalize, layout = request.param
    path = tmp_path_factory.mktemp(f"{family}-{pooling}")
    hf = save_tiny_encoder(path, family, seed=1, st_pooling=pooling, st_normalize=normalize, st_layout=layout)
    llm = LLM(model=str(path), dtype="float32", num_kv_slots=1024)
    yield Encoder(llm, hf, AutoTokenizer.from_pretrained(path), family, pooling, normalize)
    llm.shutdown()


def test_the_folders_pooling_is_the_default(embedder: Encoder) -> None:
    assert embedder.llm.engine.runner == "pooling"
    outs = embedder.llm.embed(TEXTS, use_tqdm=False)
    for text, out in zip(TEXTS, outs):
        assert out.finish_reason == "stop" and out.prompt_token_ids == embedder.tok(text)["input_ids"]
        assert_embedding_close(out.outputs.embedding, oracle(embedder, text, embedder.pooling, embedder.normalize))
        norm = float(torch.tensor(out.outputs.embedding).norm())
        assert (abs(norm - 1) < 1e-5) == embedder.normalize


@pytest.mark.parametrize(
    ("pooling", "normalize", "dimensions"),
    [("cls", False, None), ("cls", True, 16), ("mean", False, 24), ("mean", True, None)],
)
def test_explicit_pooling_params_override_the_folders(
    embedder: Encoder, pooling: str, normalize: bool, dimensions: int | None
) -> None:
    params = PoolingParams(pooling=pooling, normalize=normalize, dimensions=dimensions)
    for text, out in zip(TEXTS, embedder.llm.embed(TEXTS, params, use_tqdm=False)):
        assert_embedding_close(out.outputs.embedding, oracle(embedder, text, pooling, normalize, dimensions))


@pytest.mark.parametrize("pooling", ["cls", "mean"])
def test_batch_composition_does_not_change_a_result(embedder: Encoder, pooling: str) -> None:
    """One step of five mixed-length inputs (padded attention) gives each what it gets alone."""
    params = PoolingParams(pooling=pooling, normalize=False)
    batch = embed_in_one_step(embedder.llm, list(TEXTS), params)
    for text, many in zip(TEXTS, batch):
        (alone,) = embedder.llm.embed([text], params, use_tqdm=False)
        torch.testing.assert_close(torch.tensor(many), torch.tensor(alone.outputs.embedding), atol=1e-5, rtol=0)
        assert_embedding_close(many, oracle(embedder, text, pooling, normalize=False))


def test_token_id_prompts_get_no_special_tokens(embedder: Encoder) -> None:
    outs = embedder.llm.embed([IDS, {"prompt_token_ids": IDS[:4]}], use_tqdm=False)
    for ids, out in zip([IDS, IDS[:4]], outs):
        assert out.prompt_token_ids == ids
        assert_embedding_close(out.outputs.embedding, oracle(embedder, ids, embedder.pooling, embedder.normalize))


def test_inputs_up_to_the_position_limit_and_truncation(embedder: Encoder) -> None:
    """The longest input the position table holds is embedded; one token more is refused, unless
    truncate_prompt_tokens cuts it: a text as its tokenizer cuts it (special tokens kept), token
    ids to their first k."""
    llm, limit = embedder.llm, POSITION_LIMIT[embedder.family]
    at_limit, over = words(limit - 2), words(limit - 1)  # plus the two special tokens
    assert len(embedder.tok(at_limit)["input_ids"]) == limit
    (out,) = llm.embed([at_limit], use_tqdm=False)
    assert_embedding_close(out.outputs.embedding, oracle(embedder, at_limit, embedder.pooling, embedder.normalize))
    refused(llm, "prompt", lambda: llm.embed([over], use_tqdm=False), match="truncate_prompt_tokens")
    long_ids = [4 + (5 * i) % 90 for i in range(limit + 1)]
    refused(llm, "prompt", lambda: llm.embed([long_ids], use_tqdm=False))
    for k in (limit, 20):
        params = PoolingParams(truncate_prompt_tokens=k)
        (cut,) = llm.embed([over], params, use_tqdm=False)
        expected_ids = embedder.tok(over, truncation=True, max_length=k)["input_ids"]
        assert cut.prompt_token_ids == expected_ids and len(expected_ids) == k
        assert_embedding_close(
            cut.outputs.embedding, oracle(embedder, over, embedder.pooling, embedder.normalize, None, k)
        )
        (cut_ids,) = llm.embed([long_ids], params, use_tqdm=False)
        assert cut_ids.prompt_token_ids == long_ids[:k]
        assert_embedding_close(
            cut_ids.outputs.embedding, oracle(embedder, long_ids[:k], embedder.pooling, embedder.normalize)
        )


def test_an_embedders_score_is_the_cosine_similarity_of_the_embeddings(embedder: Encoder) -> None:
    llm, query = embedder.llm, words(5, 1)
    docs = [words(4, 1), words(12, 9), words(2, 20), words(30, 4)]
    results = llm.score(query, docs, use_tqdm=False)
    unit = PoolingParams(normalize=True)
    q = torch.tensor(llm.embed([query], unit, use_tqdm=False)[0].outputs.embedding)
    q_hf = oracle(embedder, query, embedder.pooling, normalize=True)
    expected = []
    for doc, result in zip(docs, results):
        d = torch.tensor(llm.embed([doc], unit, use_tqdm=False)[0].outputs.embedding)
        assert result.finish_reason == "stop" and result.prompt_token_ids == embedder.tok(doc)["input_ids"]
        assert result.outputs.score == pytest.approx(float(q @ d), abs=1e-5)
        d_hf = oracle(embedder, doc, embedder.pooling, normalize=True)
        assert result.outputs.score == pytest.approx(float(q_hf @ d_hf), abs=1e-4)
        expected.append(float(q_hf @ d_hf))
    order = sorted(range(len(docs)), key=lambda i: -expected[i])
    assert min(expected[a] - expected[b] for a, b in zip(order, order[1:])) > 1e-3  # an order the test can check
    ranked = llm.rerank(query, docs, top_n=3)
    assert [r.index for r in ranked] == order[:3]
    assert [r.document for r in ranked] == [docs[i] for i in order[:3]]
    assert [r.score for r in ranked] == [results[i].outputs.score for i in order[:3]]


def test_embedder_refusals(embedder: Encoder) -> None:
    llm = embedder.llm
    refused(llm, "sampling_params", lambda: llm.generate([TEXTS[0]], SamplingParams(max_tokens=2), use_tqdm=False))
    refused(llm, "dimensions", lambda: llm.embed([TEXTS[0]], PoolingParams(dimensions=HIDDEN + 1), use_tqdm=False))
    refused(llm, "prompt", lambda: llm.embed([""], use_tqdm=False))
    refused(llm, "documents", lambda: llm.score(TEXTS[0], [], use_tqdm=False))
    refused(llm, "documents", lambda: llm.score(TEXTS[0], [TEXTS[1], ""], use_tqdm=False))
    refused(llm, "query", lambda: llm.score("", [TEXTS[1]], use_tqdm=False))


# ---------------------------------------------------------------------------------------- cross-encoders
@pytest.fixture(scope="module", params=["bert-cross", "xlmr-cross"])
def cross(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Encoder]:
    path = tmp_path_factory.mktemp(request.param)
    hf = save_tiny_encoder(path, request.param, seed=2)
    llm = LLM(model=str(path), dtype="float32", num_kv_slots=1024, max_score_documents=4)
    yield Encoder(llm, hf, AutoTokenizer.from_pretrained(path), request.param.split("-")[0], "cls", False)
    llm.shutdown()


QUERY = words(4, 2)
DOCS = [words(6, 1), words(15, 8), words(2, 13), words(9, 3)]


def cross_oracle(enc: Encoder, query: str, doc: str, zero_types: bool = False) -> float:
    inputs = enc.tok(query, doc, return_tensors="pt")
    if zero_types:
        inputs["token_type_ids"] = torch.zeros_like(inputs["token_type_ids"])
    with torch.no_grad():
        return float(torch.sigmoid(enc.hf(**inputs).logits[0, 0]))


def test_cross_encoder_scores_match_transformers(cross: Encoder) -> None:
    assert cross.llm.engine.runner == "pooling"
    results = cross.llm.score(QUERY, DOCS, use_tqdm=False)
    assert len(results) == len(DOCS)
    for doc, result in zip(DOCS, results):
        assert result.finish_reason == "stop" and result.error is None
        assert result.prompt_token_ids == cross.tok(QUERY, doc)["input_ids"]
        assert result.outputs.score == pytest.approx(cross_oracle(cross, QUERY, doc), abs=1e-5)
    (one,) = cross.llm.score(QUERY, DOCS[1], use_tqdm=False)  # one document as a string
    assert one.outputs.score == pytest.approx(results[1].outputs.score, abs=1e-6)
    if cross.family == "bert":  # the second segment is type 1, and that changes the score
        types = cross.tok(QUERY, DOCS[0])["token_type_ids"]
        assert types[0] == 0 and types[-1] == 1
        assert max(abs(r.outputs.score - cross_oracle(cross, QUERY, d, True)) for d, r in zip(DOCS, results)) > 1e-3


def test_cross_encoder_rerank_sorts_by_score(cross: Encoder) -> None:
    expected = [cross_oracle(cross, QUERY, doc) for doc in DOCS]
    order = sorted(range(len(DOCS)), key=lambda i: -expected[i])
    assert min(expected[a] - expected[b] for a, b in zip(order, order[1:])) > 1e-4  # an order the test can check
    for top_n in (2, None, len(DOCS) + 3):
        ranked = cross.llm.rerank(QUERY, DOCS, top_n=top_n)
        assert [r.index for r in ranked] == order[:top_n]
        assert [r.document for r in ranked] == [DOCS[i] for i in order[:top_n]]
        for r in ranked:
            assert r.score == pytest.approx(expected[r.index], abs=1e-5)


def test_cross_encoder_refusals(cross: Encoder) -> None:
    llm = cross.llm
    refused(llm, "task", lambda: llm.embed([QUERY], use_tqdm=False))
    refused(llm, "sampling_params", lambda: llm.generate([QUERY], SamplingParams(max_tokens=2), use_tqdm=False))
    refused(llm, "documents", lambda: llm.score(QUERY, [], use_tqdm=False))
    refused(llm, "documents", lambda: llm.score(QUERY, [DOCS[0], ""], use_tqdm=False))
    refused(llm, "documents", lambda: llm.score(QUERY, DOCS + [DOCS[0]], use_tqdm=False), "max_score_documents")
    refused(llm, "documents", lambda: llm.rerank(QUERY, DOCS + [DOCS[0]]))
    for top_n in (0, -1, True):
        refused(llm, "top_n", lambda n=top_n: llm.rerank(QUERY, DOCS, top_n=n))


def test_a_bad_top_n_is_refused_before_any_document_is_scored(cross: Encoder) -> None:
    finished = cross.llm.engine.stats()["finished_requests"]
    with pytest.raises(ParameterError):
        cross.llm.rerank(QUERY, DOCS, top_n=0)
    assert cross.llm.engine.stats()["finished_requests"] == finished


# ---------------------------------------------------------------------------------------- decoder reranker
@pytest.fixture(scope="module")
def reranker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Reranker]:
    path = tmp_path_factory.mktemp("qwen3-reranker")
    hf = save_tiny_checkpoint(path, "qwen3", seed=3)
    llm = LLM(
        model=str(path),
        dtype="float32",
        num_kv_slots=512,
        classifier_from_token="one,two",
        score_template="{query} : {document} is",
        max_num_batched_tokens=8,
    )
    yield llm, hf, AutoTokenizer.from_pretrained(path)
    llm.shutdown()


def test_decoder_reranker_scores_the_token_pairs_softmax(reranker: Reranker) -> None:
    llm, hf, tok = reranker
    assert llm.engine.runner == "pooling"
    no, yes = tok.convert_tokens_to_ids(["one", "two"])
    query, docs = words(6, 2), [words(5, 1), words(11, 7), words(3, 17)]
    chunked = llm.engine.stats()["scheduler"]["chunked_prefills"]
    results = llm.score(query, docs, use_tqdm=False)
    assert llm.engine.stats()["scheduler"]["chunked_prefills"] > chunked  # prompts of 11+ tokens, 8 a step
    expected = []
    for doc, result in zip(docs, results):
        ids = tok(f"{query} : {doc} is")["input_ids"]
        assert result.finish_reason == "stop" and result.prompt_token_ids == ids
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0, -1].float()
        expected.append(float(torch.softmax(logits[[no, yes]], dim=0)[1]))
        assert result.outputs.score == pytest.approx(expected[-1], abs=1e-5)
    order = sorted(range(len(docs)), key=lambda i: -expected[i])
    assert min(expected[a] - expected[b] for a, b in zip(order, order[1:])) > 1e-4
    assert [r.index for r in llm.rerank(query, docs, top_n=2)] == order[:2]
    refused(llm, "task", lambda: llm.embed([query], use_tqdm=False))
    refused(llm, "sampling_params", lambda: llm.generate([query], SamplingParams(max_tokens=2), use_tqdm=False))


# ---------------------------------------------------------------------------------------- token budget
@pytest.fixture(scope="module", params=["bert", "xlmr"])
def budgeted(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Encoder]:
    path = tmp_path_factory.mktemp(f"{request.param}-budget")
    hf = save_tiny_encoder(path, request.param, seed=4, st_pooling="mean", st_normalize=False)
    llm = LLM(model=str(path), dtype="float32", num_kv_slots=256, max_num_batched_tokens=64)
    yield Encoder(llm, hf, AutoTokenizer.from_pretrained(path), request.param, "mean", False)
    llm.shutdown()


def test_many_mixed_inputs_under_a_small_budget_each_run_whole(budgeted: Encoder) -> None:
    llm = budgeted.llm
    lengths = [5, 60, 17, 33, 8, 47, 24, 60, 12, 39, 5, 52, 29, 15]  # tokens, with the two special ones
    texts = [words(n - 2, i) for i, n in enumerate(lengths)]
    before = llm.engine.stats()["scheduler"]
    outs = llm.embed(texts, use_tqdm=False)
    after = llm.engine.stats()["scheduler"]
    assert after["chunked_prefills"] == before["chunked_prefills"]
    assert after["steps"] - before["steps"] >= math.ceil(sum(lengths) / 64) and after["max_batch_tokens"] <= 64
    for text, n, out in zip(texts, lengths, outs):
        assert out.finish_reason == "stop" and len(out.prompt_token_ids) == n
        assert_embedding_close(out.outputs.embedding, oracle(budgeted, text, "mean", normalize=False))


def test_an_input_over_the_step_budget_is_refused_unless_truncated(budgeted: Encoder) -> None:
    llm, text = budgeted.llm, words(70)
    refused(llm, "prompt", lambda: llm.embed([text], use_tqdm=False), match="max_num_batched_tokens")
    refused(llm, "prompt", lambda: llm.embed([list(range(4, 69))], use_tqdm=False), match="max_num_batched_tokens")
    (cut,) = llm.embed([text], PoolingParams(truncate_prompt_tokens=64), use_tqdm=False)
    assert cut.prompt_token_ids == budgeted.tok(text, truncation=True, max_length=64)["input_ids"]
    assert_embedding_close(cut.outputs.embedding, oracle(budgeted, text, "mean", False, None, 64))


# ---------------------------------------------------------------------------------------- build refusals
@pytest.fixture(scope="module")
def bert_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("bert-build")
    save_tiny_encoder(path, "bert", st_pooling="cls")
    return path


@pytest.mark.parametrize(("option", "value"), [("quantization", "int8"), ("enable_lora", True)])
def test_encoder_settings_refused_at_build(bert_folder: Path, option: str, value: object) -> None:
    with pytest.raises(ValueError, match=option):
        LLM(model=str(bert_folder), dtype="float32", num_kv_slots=64, **{option: value})


@pytest.mark.parametrize("mode", ["max", ["cls", "mean"], "weightedmean"])
def test_a_sentence_transformers_6_pooling_we_do_not_pool_by_is_refused(tmp_path: Path, mode: object) -> None:
    save_tiny_encoder(tmp_path, "bert", st_pooling="cls", st_layout=6)
    config = tmp_path / "1_Pooling" / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "pooling_mode": mode}))
    with pytest.raises(ModelConfigError, match="pooling_mode"):
        LLM(model=str(tmp_path), dtype="float32", num_kv_slots=64)


def test_an_encoder_does_not_generate(bert_folder: Path) -> None:
    with pytest.raises(ModelConfigError, match="pooling"):
        LLM(model=str(bert_folder), dtype="float32", num_kv_slots=64, runner="generate")


def test_bf16_embeddings_and_scores_within_twice_transformers_own_bf16_error(tmp_path: Path) -> None:
    """In bf16 an embedding (and a cross-encoder's score) differs from the fp32 oracle by at most
    twice (plus 1e-3) what transformers' own bf16 model differs by, over the same inputs."""
    texts = [words(12), words(33, 4)]
    for kind in ("bert", "bert-cross"):
        folder = tmp_path / kind
        hf = save_tiny_encoder(folder, kind, st_pooling="cls" if kind == "bert" else None)
        tok = AutoTokenizer.from_pretrained(folder)
        hf_bf16 = transformers.AutoModel.from_pretrained(folder) if kind == "bert" else None
        llm = LLM(model=str(folder), dtype="bfloat16", num_kv_slots=256)
        try:
            if kind == "bert":
                assert hf_bf16 is not None
                hf_bf16 = hf_bf16.to(torch.bfloat16).eval()
                got = [torch.tensor(o.outputs.embedding) for o in llm.embed(texts, use_tqdm=False)]
                for text, vector in zip(texts, got):
                    inputs = tok(text, return_tensors="pt")
                    exact = torch.nn.functional.normalize(hidden_states(hf, inputs)[0], dim=0)
                    theirs = torch.nn.functional.normalize(hidden_states(hf_bf16, inputs)[0], dim=0)
                    assert (vector - exact).abs().max() <= 2 * (theirs - exact).abs().max() + 1e-3
            else:
                hf_cross = transformers.AutoModelForSequenceClassification.from_pretrained(folder)
                hf_cross = hf_cross.to(torch.bfloat16).eval()
                scores = [r.outputs.score for r in llm.score(texts[0], texts, use_tqdm=False)]
                for text, score in zip(texts, scores):
                    inputs = tok(texts[0], text, return_tensors="pt")
                    with torch.no_grad():
                        exact = torch.sigmoid(hf(**inputs).logits[0, 0]).item()
                        theirs = torch.sigmoid(hf_cross(**inputs).logits[0, 0].float()).item()
                    assert abs(score - exact) <= 2 * abs(theirs - exact) + 1e-3
        finally:
            llm.shutdown()
