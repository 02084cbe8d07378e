"""Draft-model proposals: a smaller checkpoint with the target's vocabulary proposes its greedy
continuation of a sequence, run on the engine thread with a model worker and KV cache of its own.

Per sequence the proposer keeps the draft's KV (a row and pages of its own cache) for the tokens it
last saw: the sequence's tokens then its own proposal but the last. At the next proposal it keeps
the sequence's tokens and the proposals the target accepted (compared past the tokens it had
confirmed), drops the rest (a length change), computes the new tokens in one forward and then
decodes ``k - 1`` more tokens one at a time. A greedy proposal is a point mass, for which the verifier's
rule (sample the target, accept on equality) is the speculative-sampling rule, so the output's
distribution is the target's whatever the draft proposes. Sequences that stop decoding (finished,
preempted, or speculation switched off for the step's batch) give their draft KV back at the next
proposal round (:meth:`DraftModelProposer.retain`).
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from tokenmill.cache.handle import KVHandle
from tokenmill.cache.manager import CacheManager
from tokenmill.cache.storage import ReqToTokenPool
from tokenmill.config import EngineConfig
from tokenmill.engine.sequence import Sequence
from tokenmill.gguf_checkpoint import is_converted
from tokenmill.model.parallel import SINGLE
from tokenmill.model.prequantized import checkpoint_format
from tokenmill.model.registry import resolve_config
from tokenmill.tokenizer import Tokenizer
from tokenmill.worker.forward_step import ForwardStep, TableWrites
from tokenmill.worker.model_worker import ModelWorker, build_model_worker

logger = logging.getLogger("tokenmill.engine")

MAX_DECODE_ROWS = 8
"""Most new tokens the draft computes as one decode step (one-token requests on one row)."""


@dataclasses.dataclass
class _DraftKV:
    """The draft's KV of one sequence: positions ``0 .. confirmed-1`` hold the sequence's own
    tokens, the ``guesses`` after them the draft's last proposal but its final token
    (``kv.n_kv == confirmed + len(guesses)``)."""

    kv: KVHandle
    confirmed: int = 0
    guesses: list[int] = dataclasses.field(default_factory=list)


class DraftModelProposer:
    """Proposes the draft model's greedy continuation (engine thread only)."""

    def __init__(self, worker: ModelWorker, cache: CacheManager, vocab_size: int) -> None:
        """``vocab_size``: the target's; proposals are the draft's most likely token below it."""
        self.worker = worker
        self.cache = cache
        self.vocab_size = vocab_size
        self._held: dict[int, _DraftKV] = {}  # seq_id -> the draft's KV of that sequence

    @classmethod
    def build(
        cls,
        target: EngineConfig,
        draft_path: str,
        rows: int,
        context_limit: int,
        kv_tokens: int,
        vocab_size: int,
        tokenizer: Tokenizer | None,
        device: torch.device,
    ) -> DraftModelProposer:
        """The draft of ``target``'s engine from checkpoint ``draft_path``, with KV for ``rows``
        sequences of up to ``context_limit`` tokens, ``kv_tokens`` in all (the target's capacity:
        the draft never holds more tokens than the target), in the target's dtype and quantization
        (none for a GGUF or pre-quantized draft: it loads as stored). Raises ValueError naming what
        does not match: the vocabulary (the tokenizers' token -> id maps, or the model's width where
        the target has no tokenizer) or a context shorter than ``context_limit``."""
        draft = target.replace(
            model=draft_path,
            revision=None,
            tokenizer=None,
            speculative_config=None,
            enable_prefix_caching=False,
            kv_cache_disk_dir=None,
            kv_cache_host_bytes=0,
            enable_lora=False,
            lora_modules=(),
            max_running_requests=rows,
            max_context_len=None,
            num_kv_slots=-(-kv_tokens // target.page_size) * target.page_size,
        )
        resolved, draft_config = resolve_config(draft)
        path = resolved.model_path
        if is_converted(path) or checkpoint_format(path) is not None:  # loads quantized as stored
            draft = draft.replace(quantization=None)
        if tokenizer is not None:
            if Tokenizer(path).hf.get_vocab() != tokenizer.hf.get_vocab():
                raise ValueError(
                    f"speculative_config: the draft model {draft_path} has another vocabulary than the target "
                    "(its tokenizer maps tokens to other ids); a draft must share the target's tokenizer"
                )
        elif draft_config.vocab_size != vocab_size:
            raise ValueError(
                f"speculative_config: the draft model's vocabulary has {draft_config.vocab_size} tokens, "
                f"the target's {vocab_size}"
            )
        if resolved.max_context_len < context_limit:
            raise ValueError(
                f"speculative_config: the draft model's context ({resolved.max_context_len} tokens) is shorter "
                f"than the target's ({context_limit})"
            )
        pool = ReqToTokenPool(rows, context_limit, device)
        sized = dataclasses.replace(resolved, device=device, max_context_len=context_limit)
        worker = build_model_worker(draft, sized, SINGLE, pool.table)
        logger.info("draft model %s: %s", draft_path, draft_config.architecture)
        return cls(worker, CacheManager(draft.cache, worker.storage.n_slots, pool), vocab_size)

    def propose(self, seq: Sequence, k: int) -> list[int]:
        """The draft's ``k`` most likely next tokens after ``seq``'s, one at a time (empty when its
        cache has no room). Only the tokens past the confirmed ones are read (a sequence's tokens
        never change), so a step's cost does not grow with the sequence."""
        held = self._held.get(seq.seq_id)
        if held is None:
            held = _DraftKV(KVHandle())
            if not self.cache.alloc(held.kv, [], use_prefix_cache=False):  # no prefix cache: no tokens needed
                return []
            self._held[seq.seq_id] = held
        n = seq.n_tokens
        start = min(held.confirmed, n - 1)  # at least one token is left to compute: its logits are needed
        guesses = held.guesses if start == held.confirmed else []
        taken = seq.tokens(start, start + min(len(guesses), n - 1 - start))
        kept = start + _common_prefix(guesses, taken)
        self.cache.truncate(held.kv, kept)
        proposal: list[int] = []
        new = seq.tokens(kept, n)
        while len(proposal) < k:
            slots = self.cache.extend(held.kv, len(new))
            if slots is None:
                break
            proposal.append(self._next_token(held.kv, new, slots))
            new = proposal[-1:]
        held.confirmed = min(n, held.kv.n_kv)
        held.guesses = proposal[: held.kv.n_kv - held.confirmed]
        return proposal

    def retain(self, seq_ids: set[int]) -> None:
        """Give back the draft KV of every sequence but ``seq_ids``."""
        for seq_id in [s for s in self._held if s not in seq_ids]:
            self.cache.free(self._held.pop(seq_id).kv, [], cache_pages=False)

    def _next_token(self, kv: KVHandle, new: list[int], slots: torch.Tensor) -> int:
        """The draft's most likely token after computing ``new`` (the last ``len(new)`` positions of
        ``kv``). Up to :data:`MAX_DECODE_ROWS` new tokens are one-token requests on the sequence's row
        (token ``i`` seeing the positions up to its own), so the step is a decode step and runs the
        decode path's kernels, as the target's verification does; more are one prefill chunk."""
        device = self.worker.device
        start, n, row = kv.n_kv - len(new), kv.n_kv, kv.row
        assert row is not None
        decode = len(new) <= MAX_DECODE_ROWS
        no_slots = torch.empty(0, dtype=torch.int64, device=device)
        step = ForwardStep(
            is_decode=decode,
            input_ids=torch.tensor(new, device=device),
            positions=torch.arange(start, n, device=device),
            out_cache_loc=slots.to(device, torch.int64),
            rows=[row] * len(new) if decode else [row],
            seq_lens=list(range(start + 1, n + 1)) if decode else [n],
            prefix_lens=list(range(start, n)) if decode else [start],
            logits_indices=None if decode else torch.tensor([len(new) - 1], device=device),
            fork_src=no_slots,
            fork_dst=no_slots,
            table_writes=TableWrites.empty(device),
        )
        logits = self.worker.execute(step)
        return int(logits[-1, : self.vocab_size].argmax())


def _common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of ``a`` and ``b``."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return min(len(a), len(b))
