"""A tensor-parallel worker (ranks 1..N-1): its shards of the model, its KV storage for its heads,
and a loop that runs rank 0's steps.

The worker holds no scheduler, request table or sampler: each step's inputs come from rank 0
(``step.py``), it rebuilds the step's attention view over its own storage and runs the same eager
forward as rank 0, taking part in every collective of it; rank 0 alone uses the logits. It ends on
rank 0's shutdown message, or when a collective fails or times out (rank 0 died or hung), so a
worker never outlives its engine for longer than the collective timeout.

A worker process ends with ``os._exit`` once it has left the group, skipping the interpreter's
finalization: gloo's work threads may still be dropping a finished collective's last tensor
reference, which takes the GIL, and a thread that needs the GIL while the interpreter finalizes
aborts the whole process (``std::terminate``; seen at exit under load).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from typing import NoReturn

import torch

from tokenmill.cache.sizing import kv_cache_slots
from tokenmill.cache.storage import KVStorage
from tokenmill.cache.view_builder import make_decode_view, make_prefill_view
from tokenmill.config import EngineConfig
from tokenmill.distributed import group, step, weights
from tokenmill.model.causal_lm import CausalLM
from tokenmill.model.loader import load_model
from tokenmill.model.parallel import TensorParallel
from tokenmill.model.registry import load_model_config

logger = logging.getLogger("tokenmill.distributed")


def build_rank(config: EngineConfig, tp: TensorParallel, device: torch.device) -> tuple[CausalLM, torch.dtype]:
    """This rank's shards of the model, with its attention backend; ``(model, kv dtype)``."""
    path = config.model_path()
    dtype = config.resolved_dtype(load_model_config(path).checkpoint_dtype)
    model = load_model(path, dtype, device, tp)
    model.backend = model.make_backend(config, dtype)
    return model, config.resolved_kv_dtype(dtype)


def local_kv_slots(config: EngineConfig, model: CausalLM, kv_dtype: torch.dtype, device: torch.device) -> int:
    """KV slots that fit this rank's heads (the ranks then agree on the smallest)."""
    mc = model.config
    return kv_cache_slots(config, mc.num_layers, model.local_heads()[1], mc.head_dim, kv_dtype, device)


class Worker:
    """One worker rank's model and KV storage."""

    def __init__(
        self, config: EngineConfig, model: CausalLM, kv_dtype: torch.dtype, device: torch.device, n_slots: int
    ) -> None:
        self.config = config
        self.model = model
        mc = model.config
        n_kv_heads = self.model.local_heads()[1]
        self.storage = KVStorage(mc.num_layers, n_slots, n_kv_heads, mc.head_dim, kv_dtype, device)

    def run_step(self, inputs: step.StepInputs) -> None:
        """Rank 0's forward of this step on this rank's shards (then its fork copies)."""
        rows = list(range(len(inputs.seq_lens)))
        if inputs.is_decode:
            view = make_decode_view(self.storage, inputs.table, rows, inputs.seq_lens, inputs.out_cache_loc)
        else:
            extend = [n - p for n, p in zip(inputs.seq_lens, inputs.prefix_lens)]
            view = make_prefill_view(self.storage, inputs.table, rows, inputs.prefix_lens, extend, inputs.out_cache_loc)
        self.model(inputs.input_ids, inputs.positions, view, inputs.logits_indices)
        if inputs.fork_src.numel():
            self.storage.copy_slots(inputs.fork_src, inputs.fork_dst)


def worker_main(rank: int, size: int, port: int, config: EngineConfig) -> None:
    """Entry point of a spawned worker process: join rank 0's group, build, serve steps until told to stop."""
    logging.basicConfig(level=logging.WARNING)
    store = torch.distributed.TCPStore("127.0.0.1", port, size, is_master=False)
    run(config, rank, size, group.rank_device(config.resolved_device(), rank), size, store)
    exit_process()


def launched_worker_main(config: EngineConfig) -> NoReturn:
    """Entry point of a worker that ``torchrun`` started (a rank above 0; rank 0 runs the engine):
    join the group through torchrun's environment, build, serve steps until rank 0 tells it to stop
    or is gone, then exit the process (status 0). SIGINT and SIGTERM are ignored: rank 0 receives
    them too (a Ctrl-C in torchrun's terminal, or torchrun stopping), drains its server and then
    stops the workers."""
    place = group.launched_place()
    if place is None or place.rank == 0:
        raise RuntimeError("a torchrun-launched worker needs torchrun's environment and a rank above 0")
    group.check_launched_size(place, config.tensor_parallel_size)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    device = group.rank_device(config.resolved_device(), place.local_rank)
    run(config, place.rank, place.size, device, place.local_size)
    exit_process()


def exit_process() -> NoReturn:
    """End this worker process with status 0 without finalizing the interpreter (module docstring),
    its logs and output flushed first."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run(
    config: EngineConfig,
    rank: int,
    size: int,
    device: torch.device,
    local_size: int,
    store: torch.distributed.Store | None = None,
) -> None:
    """Join the group as ``rank`` (through ``store``, or torchrun's environment when None), build this
    rank, serve steps until told to stop, leave. ``local_size``: the ranks sharing this machine's CPUs."""
    if device.type == "cpu":
        torch.set_num_threads(group.cpu_threads_per_rank(local_size))
    timeout = config.distributed_timeout_s
    tp = group.join(rank, size, device, timeout, store)
    try:
        serve(config, tp, device, timeout)
    except Exception:  # rank 0 is gone or hung (its side reports it); nothing to answer here
        logger.exception("tensor-parallel worker %d stopped", rank)
    finally:
        group.leave()


def serve(config: EngineConfig, tp: TensorParallel, device: torch.device, timeout: float) -> None:
    """Build this rank, agree on the KV size with the others, run messages until shutdown."""
    model, kv_dtype = build_rank(config, tp, device)
    n_slots = agree_on_slots(local_kv_slots(config, model, kv_dtype, device), device, timeout)
    worker = Worker(config, model, kv_dtype, device, n_slots)
    while True:
        kind, inputs = step.receive(device)
        if kind == step.Kind.SHUTDOWN:
            return
        if kind == step.Kind.STEP:
            assert inputs is not None
            worker.run_step(inputs)
        elif kind == step.Kind.WEIGHTS:
            weights.receive(model, device)


def agree_on_slots(n_slots: int, device: torch.device, timeout: float) -> int:
    """The smallest KV slot count over the ranks (every rank's storage must hold the same slots): the
    last step of the start-up, after which every collective fails after ``timeout`` seconds."""
    count = torch.tensor([n_slots], dtype=torch.int64, device=device)
    torch.distributed.all_reduce(count, op=torch.distributed.ReduceOp.MIN)
    group.start_collective_timeout(timeout)
    return int(count.item())
