"""ModelWorker: one rank's model, attention backend, KV storage (cache layer 1), its view of the
request-to-token table (layer 2) and the views it binds (layer 3), executing plain-data steps.

Every rank builds its worker with :func:`build_model_worker` and runs each step through
:meth:`ModelWorker.execute`; tp=1 is the same code without a broadcast. Rank 0's worker shares
the cache manager's table; another rank's worker holds a replica, brought up to date by each
step's ``table_writes`` before the step's view is bound, so every rank binds the same view over
its own storage.

The worker is the one place that picks a step's execution path: a decode step replays a CUDA graph
when one is available and fits, else runs the C++ decode forward when the backend and the model both
support it and it fits, else runs the model eagerly, as every other step does (an encoder's steps
always: whole inputs, with their token type ids). A step with LoRA rows (``lora_slots``) runs
eagerly with the step's adapter batch bound to the model's adapter slots (``lora``, built with
``enable_lora``) for that one forward. The paths compute the same logits. With tensor parallelism
only the eager path exists (the model has no C++ decode weights then, and no graphs are built),
every rank taking part in its collectives.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

from tokenmill.cache.sizing import kv_cache_slots
from tokenmill.cache.storage import KVStorage
from tokenmill.cache.view_binder import ViewBinder
from tokenmill.config import EngineConfig, Resolved
from tokenmill.kernels.lora import LoRABatch
from tokenmill.model.decode_forward import CpuDecodeForward
from tokenmill.model.loader import load_model
from tokenmill.model.lora import LoRASlots, ModuleDelta
from tokenmill.model.parallel import TensorParallel
from tokenmill.model.quantization import quantization_scheme, quantize_model, set_activation_passes
from tokenmill.model.registry import Model
from tokenmill.model.repacked_cache import load_repacked
from tokenmill.model.weights import WeightError
from tokenmill.worker.cuda_graphs import CudaGraphDecodeRunner, make_cuda_graph_runner
from tokenmill.worker.forward_step import ForwardStep
from tokenmill.worker.weight_update import (
    StagedTensor,
    WeightsUpdate,
    apply_update,
    receive_whole,
    send_whole,
    stage_update,
)

logger = logging.getLogger("tokenmill.worker")


class ModelWorker:
    """One rank's forward machinery. Engine (or worker-loop) thread only."""

    def __init__(
        self,
        model: Model,
        storage: KVStorage,
        table: torch.Tensor,
        graphs: CudaGraphDecodeRunner | None = None,
        lora: LoRASlots | None = None,
    ) -> None:
        if model.backend is None and not model.is_encoder:
            raise ValueError("the model's attention backend must be set before building its worker")
        self.model = model
        self.storage = storage
        self.table = table  # [max_rows, max_context_len] int32: rank 0's own table, or a replica
        self.device = storage.k_buffer.device
        self.views = ViewBinder(storage, table)
        self.graphs = graphs  # CUDA-graph replay of pure decode steps (GPU only)
        self.lora = lora  # the model's LoRA adapter slots (enable_lora), else None
        self.cpu_decode = (  # None: unsupported
            None if model.backend is None else CpuDecodeForward.build(model, model.backend, storage.k_buffer.dtype)
        )
        self.last_forward_time = 0.0  # seconds inside the model call of the last step (CPU: exact)
        self.last_hidden: torch.Tensor | None = None  # the last step's ``hidden_indices`` rows (see execute)
        self._staged: list[StagedTensor] | None = None  # a weight update between stage and commit

    def execute(self, step: ForwardStep) -> torch.Tensor:
        """Logits of the step's ``logits_indices`` rows (every row when None; a CUDA graph's until
        the next step), after storing the step's keys and values and copying its forked slots.
        A step with ``hidden_indices`` runs eagerly and leaves those rows' final-normed hidden
        states in ``last_hidden`` (None otherwise); a step with ``lora_slots`` runs eagerly with its
        rows' adapters."""
        writes = step.table_writes
        if len(writes):
            self.table[writes.rows, writes.positions] = writes.slots.to(torch.int32)
        if step.is_decode:
            view = self.views.decode(step.rows, step.seq_lens, step.out_cache_loc)
        else:
            view = self.views.prefill(step.rows, step.prefix_lens, step.extend_lens, step.out_cache_loc)
        start = time.perf_counter()
        batch = len(step.rows)
        self.last_hidden = None
        lora_batch = None if step.lora_slots is None else LoRABatch.from_row_slots(step.lora_slots)
        if lora_batch is not None:
            assert self.lora is not None, "a step with LoRA rows needs the model's adapter slots"
            with self.lora.bound(lora_batch):
                out = self.model(step.input_ids, step.positions, view, step.logits_indices, None, step.hidden_indices)
            logits, self.last_hidden = out if step.hidden_indices is not None else (out, None)
        elif self.model.is_encoder:
            out = self.model(
                step.input_ids,
                step.positions,
                view,
                step.logits_indices,
                None,
                step.hidden_indices,
                step.token_type_ids,
            )
            logits, self.last_hidden = out if step.hidden_indices is not None else (out, None)
        elif step.hidden_indices is not None:
            logits, self.last_hidden = self.model(
                step.input_ids, step.positions, view, step.logits_indices, hidden_indices=step.hidden_indices
            )
        elif step.is_decode and self.graphs is not None and self.graphs.can_run(batch):
            logits = self.graphs.run(step.input_ids, step.positions, view)
        elif step.is_decode and self.cpu_decode is not None and self.cpu_decode.can_run(batch):
            logits = self.cpu_decode(step.input_ids, step.positions, view)
        else:
            logits = self.model(step.input_ids, step.positions, view, step.logits_indices)
        if step.fork_src.numel():
            self.storage.copy_slots(step.fork_src, step.fork_dst)
        if logits.is_cuda:
            torch.cuda.synchronize(logits.device)
        self.last_forward_time = time.perf_counter() - start
        return logits

    # ------------------------------------------------------------------ calls (every rank, between steps)
    def stage_weights(self, update: WeightsUpdate) -> str | None:
        """Stage this rank's part of ``update`` until :meth:`commit_weights`; this rank's refusal, or
        None. The rank that read the update staged its part already (``update.staged``) and sends the
        whole tensors to the others (tensor parallelism), which receive and stage theirs."""
        self._staged = update.staged
        if self._staged is not None:
            if update.whole:
                send_whole(update.whole, self.device)
            return None
        received = receive_whole(update.manifest, self.device)
        try:
            self._staged = stage_update(self.model, received)
        except Exception as exc:  # noqa: BLE001 - any failure to stage is this rank's refusal
            for _ in received:  # the rest of the broadcast, staged by nobody
                pass
            return str(exc) if isinstance(exc, WeightError) else f"{type(exc).__name__}: {exc}"
        return None

    def commit_weights(self, apply: bool) -> None:
        """Copy the staged update in (``apply``) or drop it; either way nothing stays staged."""
        staged, self._staged = self._staged, None
        if apply and staged is not None:
            apply_update(staged)

    def load_lora_slot(self, slot: int, deltas: list[ModuleDelta]) -> None:
        """Put this rank's part of an adapter's matrices into LoRA slot ``slot`` (no deltas: empty it)."""
        assert self.lora is not None, "LoRA slot loads need enable_lora"
        self.lora.load(slot, deltas)


def build_model_worker(
    config: EngineConfig,
    resolved: Resolved,
    tp: TensorParallel,
    table: torch.Tensor | None = None,
    agree_on_slots: Callable[[int], int] | None = None,
) -> ModelWorker:
    """This rank's worker on ``resolved.device``: its shards of the model and attention backend, KV
    storage for its heads (``agree_on_slots`` turns this rank's slot count into the one every rank
    uses), and ``table`` (rank 0's request-to-token table; None: a zeroed replica of the same shape)."""
    dtype, device = resolved.dtype, resolved.device
    scheme = quantization_scheme(config.checkpoint)
    if torch.device(device).type == "cpu" and tp.size == 1:
        model = load_repacked(resolved.model_path, dtype, scheme, config.weight_cache)
    else:
        model = load_model(resolved.model_path, dtype, device, tp)
        if scheme is not None:
            quantize_model(model, scheme)
    if config.quantized_activations == "int8":
        n_projections = set_activation_passes(model, 1)
        if n_projections:
            logger.info("quantized_activations int8: %d quantized projections take one int8 pass", n_projections)
        else:
            logger.warning("quantized_activations int8 changes nothing: no projection of this model is quantized")
    if not model.is_encoder:
        model.backend = model.make_backend(config, dtype)
        model.make_blocked_copies()
    dtype_name = str(dtype).removeprefix("torch.") + (" (auto)" if config.dtype == "auto" else "")
    attention = "bidirectional (no KV cache)" if model.backend is None else model.backend.name
    logger.info("%s on %s in %s, attention %s", model.config.architecture, device, dtype_name, attention)
    kv_dtype = resolved.kv_dtype
    n_layers, n_kv_heads, head_dim = model.kv_cache_shape()  # this rank's heads (all of them at tp=1)
    n_slots = kv_cache_slots(config.cache, n_layers, n_kv_heads, head_dim, kv_dtype, device)
    if agree_on_slots is not None:
        n_slots = agree_on_slots(n_slots)
    storage = KVStorage(n_layers, n_slots, n_kv_heads, head_dim, kv_dtype, device)
    if table is None:
        shape = (config.max_running_requests, resolved.max_context_len)
        table = torch.zeros(shape, dtype=torch.int32, device=device)
    graphs = make_cuda_graph_runner(model, storage, table, config.runtime) if tp.size == 1 else None
    lora = LoRASlots(model, config.max_loras, config.max_lora_rank) if config.enable_lora else None
    return ModelWorker(model, storage, table, graphs, lora)
