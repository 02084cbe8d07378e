"""ModelOptions: which checkpoint, in which dtype, on which device, quantized how."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from tokenmill import hub
from tokenmill.config.dtypes import DTYPES, check_dtype_name
from tokenmill.config.options import option
from tokenmill.default_model import default_model
from tokenmill.gguf_checkpoint import checkpoint_folder
from tokenmill.hardware import native_bf16


@dataclass(frozen=True)
class ModelOptions:
    """The model group of :class:`~tokenmill.config.EngineConfig`."""

    model: str | None = option(
        None,
        "A Hugging Face checkpoint folder, a GGUF file (or a folder holding one), or a Hugging Face id "
        "(org/name: from its cache, else downloaded); None: the default model (SmolLM2-135M-Instruct, or "
        "$TOKENMILL_DEFAULT_MODEL).",
        section="model",
    )
    revision: str | None = option(
        None,
        "The revision (branch, tag or commit) of a model given by Hugging Face id; None: its default branch.",
        section="model",
    )
    tokenizer: str | None = option(
        None,
        "A Hugging Face tokenizer folder to use instead of the model's own (e.g. a GGUF file's).",
        section="model",
    )
    dtype: str = option(
        "auto",
        '"auto" (CPU: bf16 with native bf16 hardware, else fp32; GPU: the checkpoint\'s dtype), "float32",'
        ' "bfloat16" or "float16".',
        section="model",
    )
    device: str = option("auto", '"auto" (cuda if available, else cpu), or any torch device string.', section="model")
    seed: int = option(0, "Seed of the engine's default random generator (requests without a seed).", section="model")
    skip_tokenizer_init: bool = option(
        False,
        "Run without a tokenizer: prompts must be token ids, outputs carry token ids and no text.",
        section="model",
    )
    quantization: str | None = option(
        None,
        'Keep the linear projections of the decoder layers quantized in memory: "int8" (symmetric), '
        '"int4" (asymmetric, scale and min per group); None keeps the checkpoint\'s precision. '
        "MoE experts too; an untied LM head is kept int8; embeddings (a tied head) and MoE routers "
        "stay unquantized. A quantized model refuses "
        "weight updates. A pre-quantized checkpoint (AWQ, GPTQ, compressed-tensors) loads quantized as "
        "published: leave this None for it.",
        section="model",
    )
    quantization_group_size: int | None = option(
        None,
        "Values of a row sharing one quantization scale: 32, 64 or 128; None: int8 one per output "
        "channel, int4 32 (as llama.cpp's Q4_0 / Q4_1).",
        section="model",
    )
    weight_cache: bool = option(
        True,
        "Keep weights repacked at load (a GGUF file's, a pre-quantized or an at-load quantized "
        "checkpoint's) on disk under the cache directory ($TOKENMILL_CACHE_DIR/repacked), so that later "
        "starts of the same model read them instead of repacking; a copy of the weights per model.",
        section="model",
    )
    quantized_activations: str = option(
        "int16",
        "How products with a quantized weight in the CPU kernels' panels layout (int8 activations x "
        'packed weight) quantize their inputs, per block of a row: "int16" (two int8 passes, the value '
        'and its rounding residual: about 15 bits of the block\'s range) or "int8" (one pass, as '
        "llama.cpp does: half the integer work, coarser logits). Other products ignore it.",
        section="model",
    )

    def __post_init__(self) -> None:
        if self.quantization not in (None, "int8", "int4"):
            raise ValueError(f'quantization must be None, "int8" or "int4", got {self.quantization!r}')
        if self.quantized_activations not in ("int16", "int8"):
            raise ValueError(f'quantized_activations must be "int16" or "int8", got {self.quantized_activations!r}')
        if self.quantization_group_size not in (None, 32, 64, 128):
            raise ValueError(f"quantization_group_size must be None, 32, 64 or 128, got {self.quantization_group_size}")
        check_dtype_name("dtype", self.dtype, DTYPES)

    def model_path(self) -> Path:
        """The checkpoint folder the engine reads (a GGUF file's converted folder, see
        ``gguf_checkpoint.py``; a Hugging Face id's snapshot, see ``hub.py``), converting a GGUF file
        on its first use. Raises HubError for an id that cannot be had."""
        model = self.model or str(default_model())
        return checkpoint_folder(hub.resolve(model, self.revision) if hub.is_repo_id(model) else model)

    def model_name(self) -> str:
        """The model's name as the user gave it: a Hugging Face id as it is, a GGUF file's stem, else
        the folder's name."""
        model = self.model or str(default_model())
        if hub.is_repo_id(model):
            return model
        path = Path(model)
        return path.stem if path.suffix == ".gguf" else path.name

    def resolved_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def resolved_dtype(self, checkpoint_dtype: torch.dtype | None) -> torch.dtype:
        """ "auto": on CPU bf16 where the CPU multiplies bf16 natively (AMX or AVX512-BF16), else fp32
        (emulated bf16 is far slower); on GPU the checkpoint's dtype."""
        if self.dtype != "auto":
            return DTYPES[self.dtype]
        if self.resolved_device().type == "cpu":
            return torch.bfloat16 if native_bf16() else torch.float32
        return checkpoint_dtype or torch.bfloat16
