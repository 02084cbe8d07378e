"""LLM: the offline batch API, with vLLM's names (``LLM(model=...).generate(prompts, params,
lora_request=...)``, ``LLM.embed(prompts, pooling_params)``, ``LLM.score(query, documents)``,
``LLM.rerank(query, documents, top_n)``, ``LLM.load_lora(...)``)."""

from __future__ import annotations

import queue
from collections.abc import Sequence as SequenceABC
from typing import Any

from tqdm import tqdm

from tokenmill.config import EngineConfig
from tokenmill.engine.engine import Engine
from tokenmill.engine.overload import EngineOverloadedError
from tokenmill.engine.request_state import new_request_id
from tokenmill.engine.scoring import check_documents, rerank, score_outputs, score_requests
from tokenmill.model.pooling_config import PoolingConfig
from tokenmill.request import (
    EmbeddingRequestOutput,
    LoRARequest,
    ParameterError,
    PoolingParams,
    RequestOutput,
    RerankResult,
    SamplingParams,
    ScorePair,
    ScoringRequestOutput,
    accumulate,
)

Prompt = str | list[int] | dict[str, Any] | ScorePair
OVERLOAD_RETRY_S = 0.05
"""Seconds between submit retries while the waiting queue is full of other callers' requests."""
Message = dict[str, Any]


class LLM:
    """Runs batches of prompts to completion. ``LLM(model=None)`` uses the default model (``default_model.py``).

    Keyword arguments are :class:`~tokenmill.config.EngineConfig` fields.
    """

    def __init__(self, model: str | None = None, **engine_options: Any) -> None:
        self.engine = Engine(EngineConfig.from_kwargs(model=model, **engine_options))

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer.hf

    def generate(
        self,
        prompts: Prompt | list[Prompt],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | list[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Complete every prompt; outputs in input order.

        ``prompts``: a string, a list of token ids, ``{"prompt_token_ids": [...]}`` or
        ``{"prompt": "..."}``, or a list of those. ``lora_request``: the adapter of every prompt, or
        one per prompt (None: the base model); an adapter named with a ``lora_path`` that is not
        loaded yet is loaded first. All prompts are validated before any runs, so a
        bad one raises ValueError without leaving others half done. An interrupt (Ctrl-C) aborts the
        batch's requests before it propagates; if the engine shuts down meanwhile, the unfinished
        outputs end with ``finish_reason == "abort"``.
        """
        batch = _as_batch(prompts)
        params = _params_for(batch, sampling_params)
        return self._run(batch, params, use_tqdm, self._lora_names(batch, lora_request))

    def load_lora(self, name: str, path: str) -> None:
        """Load the PEFT adapter folder ``path`` as adapter ``name`` (see :meth:`tokenmill.Engine.load_lora`)."""
        self.engine.load_lora(name, path)

    def unload_lora(self, name: str) -> None:
        """Drop adapter ``name`` (see :meth:`tokenmill.Engine.unload_lora`)."""
        self.engine.unload_lora(name)

    def update_lora(self, name: str, tensors: dict[str, Any]) -> int:
        """Replace adapter ``name``'s matrices (see :meth:`tokenmill.Engine.update_lora`); returns its version."""
        return self.engine.update_lora(name, tensors)

    def list_loras(self) -> list[str]:
        """The names of the loaded adapters."""
        return list(self.engine.lora_adapters())

    def _lora_names(
        self, batch: list[Prompt], lora_request: LoRARequest | list[LoRARequest | None] | None
    ) -> list[str | None]:
        """Each prompt's adapter name, loading the adapters given with a path that are not loaded yet."""
        requests = lora_request if isinstance(lora_request, list) else [lora_request] * len(batch)
        if len(requests) != len(batch):
            raise ParameterError("lora_request", f"has {len(requests)} entries for {len(batch)} prompts")
        for request in requests:
            if request is not None and not isinstance(request, LoRARequest):
                raise ParameterError("lora_request", f"must be LoRARequest or None, got {type(request).__name__}")
            if request is not None and request.lora_path and request.lora_name not in self.engine.lora_adapters():
                self.engine.load_lora(request.lora_name, request.lora_path)
        return [None if request is None else request.lora_name for request in requests]

    def embed(
        self,
        prompts: Prompt | list[Prompt],
        pooling_params: PoolingParams | None = None,
        use_tqdm: bool = True,
    ) -> list[EmbeddingRequestOutput]:
        """Embed every prompt (prompts as in :meth:`generate`); outputs in input order. Each runs
        through the same scheduler as generation (token budget, chunked prefill, limits)."""
        batch = _as_batch(prompts)
        params = pooling_params if pooling_params is not None else PoolingParams()
        if not isinstance(params, PoolingParams):
            raise ParameterError("pooling_params", f"must be PoolingParams, got {type(params).__name__}")
        outputs = self._run(batch, [params] * len(batch), use_tqdm)
        return [EmbeddingRequestOutput.from_output(output) for output in outputs]

    def score(
        self,
        query: str,
        documents: str | list[str],
        instruction: str | None = None,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
    ) -> list[ScoringRequestOutput]:
        """How relevant each document is to ``query``, in document order (``engine/scoring.py``: a
        cross-encoder's or decoder reranker's score of the pair, else the cosine similarity of the
        embeddings); ``instruction`` fills a decoder reranker's template; ``truncate_prompt_tokens``
        as in :class:`~tokenmill.request.PoolingParams`. Needs runner "pooling"."""
        pooling = self._pooling("score")
        docs = check_documents(documents, self.engine.config.max_score_documents)
        prompts, params = score_requests(pooling, query, docs, instruction, truncate_prompt_tokens)
        return score_outputs(pooling, self._run(list(prompts), [params] * len(prompts), use_tqdm))

    def rerank(
        self,
        query: str,
        documents: list[str],
        top_n: int | None = None,
        instruction: str | None = None,
        truncate_prompt_tokens: int | None = None,
    ) -> list[RerankResult]:
        """The documents by relevance to ``query`` (:meth:`score`), highest first, the first
        ``top_n``; RuntimeError if a document could not be scored."""
        rerank([], [], top_n)  # a bad top_n is refused before anything runs
        results = self.score(query, documents, instruction, truncate_prompt_tokens, use_tqdm=False)
        failed = next((r for r in results if r.error is not None or r.finish_reason != "stop"), None)
        if failed is not None:
            raise RuntimeError(f"scoring request {failed.request_id} failed: {failed.error or failed.finish_reason}")
        docs = [documents] if isinstance(documents, str) else documents
        return rerank([r.outputs.score for r in results], docs, top_n)

    def _pooling(self, task: str) -> PoolingConfig:
        """The model's pooling defaults; ParameterError (``runner``) on a generating engine."""
        if self.engine.pooling is None:
            raise ParameterError("runner", f"{task} needs a pooling model (runner 'pooling'); this engine generates")
        return self.engine.pooling

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        allow_special_tokens_in_content: bool = False,
        lora_request: LoRARequest | list[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of conversations (the chat template), with
        ``lora_request`` as in :meth:`generate`.

        Special-token text inside messages or tools is tokenized as plain text unless
        ``allow_special_tokens_in_content`` (see :meth:`tokenmill.tokenizer.Tokenizer.apply_chat_template`).
        """
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tok = self.engine.tokenizer
        batch: list[Prompt] = [
            tok.apply_chat_template(
                conv,
                add_generation_prompt=add_generation_prompt,
                tools=tools,
                allow_special_tokens_in_content=allow_special_tokens_in_content,
            )
            for conv in conversations
        ]
        return self._run(batch, _params_for(batch, sampling_params), use_tqdm, self._lora_names(batch, lora_request))

    def update_weights(self, weights: Any, **kwargs: Any) -> int:
        """Push new weights (see :meth:`tokenmill.Engine.update_weights`); returns the new version."""
        return self.engine.update_weights(weights, **kwargs)

    @property
    def weight_version(self) -> int:
        return self.engine.weight_version

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix, on the device and in the host and disk tiers
        (:meth:`tokenmill.Engine.reset_prefix_cache`)."""
        self.engine.reset_prefix_cache()

    def shutdown(self) -> None:
        self.engine.shutdown()

    def _run(
        self,
        batch: list[Prompt],
        params: list[SamplingParams] | list[PoolingParams],
        use_tqdm: bool,
        lora_names: list[str | None] | None = None,
    ) -> list[RequestOutput]:
        """Every prompt to completion, in order. A batch larger than ``max_waiting_requests`` goes in
        as the waiting queue frees up: a refused submit is retried after the batch's next delta
        (requests leave the queue when scheduled or finished)."""
        engine = self.engine
        deltas: queue.Queue[RequestOutput] = queue.Queue()
        # validate (and tokenize) everything before queueing anything
        call = new_request_id()  # the batch is one call: admitted beside other calls, not before them
        names = lora_names or [None] * len(batch)
        states = [
            engine.intake(_prompt_value(prompt), p, deltas.put, None, call, name)
            for prompt, p, name in zip(batch, params, names)
        ]
        ids: list[str] = []
        totals: dict[str, RequestOutput] = {}
        try:
            done = 0
            with tqdm(total=len(states), desc="Processed prompts", disable=not use_tqdm) as bar:
                while done < len(states):
                    while len(ids) < len(states):
                        try:
                            ids.append(engine.submit(states[len(ids)]))
                        except EngineOverloadedError:
                            break
                    try:  # the engine sends every request a final delta, even when it stops
                        delta = deltas.get(timeout=None if len(ids) > done else OVERLOAD_RETRY_S)
                    except queue.Empty:  # nothing of this batch runs: others fill the queue; retry
                        continue
                    totals[delta.request_id] = accumulate(totals.get(delta.request_id), delta)
                    if delta.finished:
                        done += 1
                        bar.update(1)
        except BaseException:  # Ctrl-C, or a submit refused: nobody waits for the batch any more
            for request_id in ids:
                engine.abort(request_id)
            raise
        return [totals[i] for i in ids]


def _as_batch(prompts: Prompt | list[Prompt]) -> list[Prompt]:
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, SequenceABC) and prompts and all(isinstance(t, int) for t in prompts):
        return [list(prompts)]
    return list(prompts)


def _prompt_value(prompt: Prompt) -> str | list[int]:
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return list(prompt["prompt_token_ids"])
        if "prompt" in prompt:
            return prompt["prompt"]
        raise ValueError("a dict prompt needs 'prompt' or 'prompt_token_ids'")
    return prompt


def _params_for(batch: list[Prompt], params: SamplingParams | list[SamplingParams] | None) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams() for _ in batch]
    if isinstance(params, SamplingParams):
        return [params] * len(batch)
    if len(params) != len(batch):
        raise ValueError(f"{len(params)} sampling params for {len(batch)} prompts")
    return list(params)
