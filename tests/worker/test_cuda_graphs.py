"""When a model worker gets a CUDA-graph runner: exactly when graphs are on, the KV storage lives on CUDA and
the attention backend is capturable (checked on CPU with stand-ins; no tensor is made on CUDA)."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
import torch

from tokenmill.config import EngineConfig
from tokenmill.worker import cuda_graphs


class RecordingRunner:
    """Stands in for CudaGraphDecodeRunner, whose buffers would be allocated on CUDA."""

    def __init__(self, model: object, storage: object, table: object, config: EngineConfig) -> None:
        self.args = (model, storage, table, config)


@pytest.mark.parametrize(
    ("enabled", "device", "backend"),
    list(itertools.product([True, False], ["cuda", "cpu", "meta"], ["capturable", "not capturable", None])),
)
def test_runner_exactly_when_enabled_on_cuda_with_a_capturable_backend(
    monkeypatch: pytest.MonkeyPatch, enabled: bool, device: str, backend: str | None
) -> None:
    monkeypatch.setattr(cuda_graphs, "CudaGraphDecodeRunner", RecordingRunner)
    capabilities = SimpleNamespace(cuda_graphs=backend == "capturable")
    attention = None if backend is None else SimpleNamespace(capabilities=capabilities)
    model = SimpleNamespace(backend=attention)
    storage = SimpleNamespace(k_buffer=SimpleNamespace(device=torch.device(device)))
    table = torch.zeros(2, 4, dtype=torch.int32)
    config = EngineConfig(cuda_graphs=enabled)
    runner = cuda_graphs.make_cuda_graph_runner(model, storage, table, config)
    if enabled and device == "cuda" and backend == "capturable":
        assert isinstance(runner, RecordingRunner) and runner.args == (model, storage, table, config)
    else:
        assert runner is None
