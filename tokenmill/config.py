"""EngineConfig: every tunable of the engine and every constant, in one place.

Sizes that depend on the model or the device (number of KV slots, dtype, device) are resolved
once at engine start by :meth:`EngineConfig.resolved_device` / :meth:`resolved_dtype` and the
cache manager's sizing; everything else is read as is.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tokenmill import hub
from tokenmill.default_model import default_model
from tokenmill.gguf_checkpoint import checkpoint_folder
from tokenmill.hardware import native_bf16
from tokenmill.request import RequestLimits
from tokenmill.speculative_config import SpeculativeConfig

ATTENTION_BACKENDS = ("torch", "cpu", "triton")
"""Backends ``attention_backend`` may name besides "auto" (see ``attention/factory.py``)."""

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
KV_DTYPES: dict[str, torch.dtype] = {
    **DTYPES,
    "int8": torch.int8,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
"""KV cache dtypes: the model dtypes, int8 (symmetric, one fp32 scale per token and KV head) and fp8
(e4m3fn or e5m2, one fixed scale 1 per layer: ``cache/kv_fp8.py``; "fp8" is e4m3, as in vLLM)."""


def option(default: Any, help: str, section: str, metavar: str | None = None, comma_separated: bool = False) -> Any:
    """A documented dataclass field; the command line derives one flag from each (``cli.add_options``).

    Its metadata holds ``help`` (what the option does), ``section`` (the group ``--help`` lists it
    under) and, where they differ from the defaults, the flag's ``metavar`` (else the type's name) and
    ``comma_separated`` (a tuple option whose words are also split at commas).
    """
    metadata: dict[str, Any] = {"help": help, "section": section}
    if metavar is not None:
        metadata["metavar"] = metavar
    if comma_separated:
        metadata["comma_separated"] = True
    return field(default=default, metadata=metadata)


@dataclass
class EngineConfig:
    """Engine settings. All fields can be passed as keyword arguments to ``LLM(...)``; each is an
    :func:`option`, its help and section in the field's metadata."""

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
        "channel, int4 the largest of 128, 64, 32 that divides each layer's input width.",
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
    cpu_threads: int = option(
        0,
        "Threads of the engine's parallel ops on CPU. 0: adapt them to the CPUs this process may use "
        "(affinity, cgroup quota) less the load beside the engine (other processes, the server's own "
        "threads), measured every half second; a number fixes them.",
        section="model",
    )

    cpu_keep_freed_memory: bool = option(
        True,
        "On CPU (Linux, glibc): keep the memory the process frees for reuse (malloc thresholds), so a "
        "step's large temporaries come back without page faults; the resident size stays at its peak. "
        "The setting is the whole process's.",
        section="model",
    )

    kv_cache_dtype: str = option(
        "auto",
        '"auto" (the model\'s dtype), "float32", "bfloat16", "float16" (CPU backends: fp32 or bf16), '
        '"int8" (each token\'s keys and values per KV head as int8 with an fp32 scale: about half of '
        'bf16\'s bytes), "fp8_e4m3" (alias "fp8") or "fp8_e5m2" (one byte a value, a fixed scale of 1: '
        "values beyond the format's range saturate); int8 and fp8 on the torch and cpu backends only.",
        section="KV cache",
    )
    page_size: int = option(
        1,
        "Slots per KV page (power of two, 1..256). 1 = token-level allocation.",
        section="KV cache",
    )
    num_kv_slots: int | None = option(
        None,
        "Exact number of KV slots; overrides the memory budget below when set.",
        section="KV cache",
    )
    kv_cache_memory: int | None = option(
        None,
        "KV cache budget in bytes; when None, ``kv_cache_memory_fraction`` of free memory is used.",
        section="KV cache",
    )
    kv_cache_memory_fraction: float | None = option(
        None,
        "Fraction of free memory (after weights) for the KV cache; None = 0.85 on GPU, 0.1 on CPU.",
        section="KV cache",
    )
    max_kv_slots: int = option(
        262_144,
        "Upper bound on slots derived from a memory budget (keeps CPU allocations sane).",
        section="KV cache",
    )
    enable_prefix_caching: bool = option(
        True,
        "Share full KV pages between requests with identical prefixes (radix cache).",
        section="KV cache",
    )
    kv_cache_disk_dir: str | None = option(
        None,
        "Directory of the KV cache's disk tier: prefixes the prefix cache computed are also written "
        "there in the background (blocks of 64 tokens) and read back instead of recomputed, also after "
        "a restart with the same model and settings. One server per directory (locked). None: no tier.",
        section="KV cache",
    )
    kv_cache_disk_bytes: int = option(
        4 * 1024**3,
        "Bytes the disk tier's files may take (least recently used blocks are deleted past it).",
        section="KV cache",
    )
    kv_cache_host_bytes: int = option(
        0,
        "Bytes of this process's memory for a host tier of the KV cache: prefixes the prefix cache "
        "computed are also kept there (blocks of 64 tokens, least recently used dropped past it) and "
        "copied back instead of recomputed; in front of the disk tier when both are set (write-through). "
        "Meant for GPU KV caches (CPU memory beside device memory). 0: no host tier.",
        section="KV cache",
    )

    max_running_requests: int = option(
        128,
        "Rows in the request-to-token table: the most requests running at once.",
        section="Batching",
    )
    max_context_len: int | None = option(
        None,
        "Longest prompt + output; None means the model's limit.",
        section="Batching",
    )
    max_num_batched_tokens: int = option(
        2048,
        "Per-step token budget: prefill chunks plus decode tokens in one forward.",
        section="Batching",
    )
    max_waiting_requests: int = option(
        4096,
        "Bound on the waiting queue; new requests beyond it are refused.",
        section="Batching",
    )

    attention_backend: str = option(
        "auto",
        '"auto" (triton on CUDA; "cpu" for fp32 on CPU when its C++ kernels build; else torch), "torch", '
        '"cpu" or "triton"; explicit choices are strict.',
        section="Attention",
    )
    prefill_q_tile: int = option(16, "Query rows per tile of the ragged prefill kernel.", section="Attention")
    max_decode_splits: int = option(
        16,
        "Cap on the number of KV splits per request in the split-KV decode kernel.",
        section="Attention",
    )
    decode_split_min_tokens: int = option(
        256,
        "A decode split covers at least this many context tokens.",
        section="Attention",
    )

    tensor_parallel_size: int = option(
        1,
        "Processes the model is split over (``tokenmill.distributed``): this one (rank 0: scheduler, "
        "cache bookkeeping, sampling) and ``tensor_parallel_size - 1`` workers it spawns (gloo on CPU, "
        "NCCL on GPU: one GPU each). 1 runs everything in this process.",
        section="Tensor parallelism",
    )
    distributed_timeout_s: float = option(
        60.0,
        "Seconds any collective of the tensor-parallel group may take before it fails (a worker that "
        "hangs or dies then fails the engine instead of blocking it; idle workers get heartbeats). "
        "Starting the ranks and loading their shards may take up to 600 s (or this, if longer).",
        section="Tensor parallelism",
    )

    cuda_graphs: bool = option(
        True,
        "Capture steady-state decode steps in CUDA graphs (GPU only).",
        section="CUDA graphs",
    )
    cuda_graph_max_batch: int = option(64, "Largest decode batch captured in a CUDA graph.", section="CUDA graphs")

    # checked by SamplingParams.validate for every request, API and server alike
    max_n: int = option(16, "Most completions per request.", section="Request caps")
    max_tokens_cap: int | None = option(
        None,
        "Most output tokens per request; a request without max_tokens gets this (or less, to fit).",
        section="Request caps",
    )
    max_top_logprobs: int = option(
        20,
        "Most alternatives per token in logprobs / prompt_logprobs.",
        section="Request caps",
    )
    max_stop_strings: int = option(16, "Most stop strings per request.", section="Request caps")
    max_stop_chars: int = option(
        2048,
        "Most characters in all of a request's stop strings together (bounds the stop-string matching "
        "state and the streaming hold-back, which is shorter than the longest stop string).",
        section="Request caps",
    )
    max_stop_token_ids: int = option(
        64,
        "Most entries in a request's ``stop_token_ids`` (checked as a set built once per sequence).",
        section="Request caps",
    )
    max_structured_output_chars: int = option(
        32_768,
        "Most characters in a request's ``structured_outputs`` spec (a schema counts as its compact JSON "
        "text; choices as their total length): bounds the grammar compile time and memory.",
        section="Request caps",
    )
    structured_output_compile_timeout: float = option(
        10.0,
        "Seconds a request's grammar may take to compile at intake before the request is refused "
        '(ParameterError "structured_outputs"). A compile cannot be interrupted: an overrunning one '
        "finishes in the background, and its result goes to the compile cache.",
        section="Request caps",
    )
    structured_output_cache_bytes: int = option(
        64 * 2**20,
        "Memory for compiled grammars kept for reuse (least recently used dropped first).",
        section="Request caps",
    )
    speculative_config: dict[str, Any] | None = option(
        None,
        'Speculative decoding, vLLM\'s keys: {"method": "ngram", "num_speculative_tokens": 5, '
        '"prompt_lookup_max": 5, "prompt_lookup_min": 3} (prompt lookup; those bounds are the defaults) or '
        '{"method": "draft_model", "model": PATH, "num_speculative_tokens": 4} (a smaller model with the same '
        'vocabulary); "disable_by_batch_size": speculate only up to this many decoding sequences (default: '
        "measured). None: off.",
        section="Speculative decoding",
        metavar="JSON",
    )
    enable_lora: bool = option(
        False,
        "Serve LoRA adapters (PEFT folders) on top of the model, chosen per request (vLLM's flag).",
        section="LoRA",
    )
    max_loras: int = option(
        1,
        "Adapters resident at once: a step's requests may use up to this many different adapters; "
        "others wait until a slot frees up (least recently used adapters leave first).",
        section="LoRA",
    )
    max_lora_rank: int = option(
        16,
        "Highest adapter rank accepted; every slot holds matrices of this rank (memory and work grow with it).",
        section="LoRA",
    )
    lora_modules: tuple[str, ...] = option(
        (),
        "Adapters loaded at start, each NAME=PATH (a PEFT adapter folder); requests name them "
        "(the API's model field, LoRARequest in Python). Needs enable_lora.",
        section="LoRA",
        metavar="NAME=PATH",
    )
    runner: str = option(
        "auto",
        '"generate" (completions, chat), "pooling" (embeddings, scores, reranking) or "auto": pooling for '
        "an encoder (BERT, XLM-RoBERTa), a *ForSequenceClassification checkpoint, a folder with "
        "sentence-transformers files (modules.json) or a set classifier_from_token; else generate. "
        "An engine serves its runner's requests only.",
        section="Pooling",
    )
    classifier_from_token: tuple[str, ...] = option(
        (),
        "A decoder as a reranker (the Qwen3-Reranker recipe): the two tokens NO,YES whose logits after "
        "the scoring prompt give a score (softmax over the pair: P(YES)); also read from config.json's "
        "classifier_from_token. Empty: scores come from the model's classification head.",
        section="Pooling",
        metavar="NO,YES",
        comma_separated=True,
    )
    score_template: str | None = option(
        None,
        'A decoder reranker\'s scoring prompt, with "{query}" and "{document}" (and optionally '
        '"{instruction}") in it, or "qwen3-reranker" for Qwen3-Reranker\'s own; None: the model\'s '
        'default ("qwen3-reranker" with classifier_from_token set).',
        section="Pooling",
    )
    max_score_documents: int = option(
        1000,
        "Most documents one score or rerank call may carry.",
        section="Pooling",
    )
    tokenizer_threads: int = option(
        4,
        "Threads that tokenize off the event loop (AsyncEngine and the HTTP server); more concurrent "
        "tokenizations wait for one of them instead of taking other worker threads.",
        section="Request caps",
    )

    def __post_init__(self) -> None:
        if self.runner not in ("auto", "generate", "pooling"):
            raise ValueError(f'runner must be "auto", "generate" or "pooling", got {self.runner!r}')
        tokens = self.classifier_from_token
        self.classifier_from_token = tuple(tokens.split(",") if isinstance(tokens, str) else tokens)
        if self.classifier_from_token and len(self.classifier_from_token) != 2:
            raise ValueError(f"classifier_from_token must name two tokens (NO,YES), got {self.classifier_from_token}")
        if self.max_score_documents < 1:
            raise ValueError(f"max_score_documents must be >= 1, got {self.max_score_documents}")
        if self.quantization not in (None, "int8", "int4"):
            raise ValueError(f'quantization must be None, "int8" or "int4", got {self.quantization!r}')
        if self.quantized_activations not in ("int16", "int8"):
            raise ValueError(f'quantized_activations must be "int16" or "int8", got {self.quantized_activations!r}')
        if self.quantization_group_size not in (None, 32, 64, 128):
            raise ValueError(f"quantization_group_size must be None, 32, 64 or 128, got {self.quantization_group_size}")
        if self.page_size < 1 or self.page_size > 256 or self.page_size & (self.page_size - 1):
            raise ValueError(f"page_size must be a power of two in [1, 256], got {self.page_size}")
        for name, table in (("dtype", DTYPES), ("kv_cache_dtype", KV_DTYPES)):
            if getattr(self, name) != "auto" and getattr(self, name) not in table:
                raise ValueError(f"{name} must be 'auto' or one of {sorted(table)}, got {getattr(self, name)!r}")
        if self.attention_backend != "auto" and self.attention_backend not in ATTENTION_BACKENDS:
            choices = ", ".join(repr(name) for name in ("auto", *ATTENTION_BACKENDS))
            raise ValueError(f"attention_backend must be one of {choices}, got {self.attention_backend!r}")
        if self.kv_cache_memory_fraction is not None and not 0.0 < self.kv_cache_memory_fraction <= 1.0:
            raise ValueError("kv_cache_memory_fraction must be in (0, 1]")
        for name in (
            "max_running_requests",
            "max_num_batched_tokens",
            "prefill_q_tile",
            "max_decode_splits",
            "cuda_graph_max_batch",
            "decode_split_min_tokens",
            "max_n",
            "tokenizer_threads",
            "tensor_parallel_size",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        caps = (
            "max_top_logprobs",
            "max_stop_strings",
            "max_stop_chars",
            "max_stop_token_ids",
            "max_structured_output_chars",
        )
        for name, low in (("max_tokens_cap", 1), *((cap, 0) for cap in caps)):
            value = getattr(self, name)
            if value is not None and value < low:
                raise ValueError(f"{name} must be >= {low}, got {value}")
        if not self.structured_output_compile_timeout > 0:
            raise ValueError(
                f"structured_output_compile_timeout must be > 0, got {self.structured_output_compile_timeout}"
            )
        if self.structured_output_cache_bytes < 0:
            raise ValueError(f"structured_output_cache_bytes must be >= 0, got {self.structured_output_cache_bytes}")
        if self.cpu_threads < 0:
            raise ValueError(f"cpu_threads must be >= 0 (0: adaptive), got {self.cpu_threads}")
        if not self.distributed_timeout_s > 0:
            raise ValueError(f"distributed_timeout_s must be > 0, got {self.distributed_timeout_s}")
        speculative = self.speculative()  # raises on a bad setting
        if speculative is not None and speculative.model is not None and self.tensor_parallel_size > 1:
            raise ValueError("speculative_config: a draft model is not supported with tensor parallelism")
        if self.kv_cache_disk_dir is not None:
            if not self.enable_prefix_caching:
                raise ValueError("kv_cache_disk_dir needs enable_prefix_caching (the disk tier holds cached prefixes)")
            if self.tensor_parallel_size > 1:
                raise ValueError("kv_cache_disk_dir is not supported with tensor parallelism yet")
            if self.kv_cache_disk_bytes < 1:
                raise ValueError(f"kv_cache_disk_bytes must be >= 1, got {self.kv_cache_disk_bytes}")
        if self.kv_cache_host_bytes < 0:
            raise ValueError(f"kv_cache_host_bytes must be >= 0 (0: no host tier), got {self.kv_cache_host_bytes}")
        if self.kv_cache_host_bytes > 0:
            if not self.enable_prefix_caching:
                raise ValueError("kv_cache_host_bytes needs enable_prefix_caching (the host tier holds prefixes)")
            if self.tensor_parallel_size > 1:
                raise ValueError("kv_cache_host_bytes is not supported with tensor parallelism yet")
        if isinstance(self.lora_modules, dict):  # {name: path} from Python
            self.lora_modules = tuple(f"{name}={path}" for name, path in self.lora_modules.items())
        self.lora_modules = tuple(self.lora_modules)
        self.lora_adapters()  # raises on a bad entry
        if self.enable_lora:
            if self.max_loras < 1 or not 1 <= self.max_lora_rank <= 512:
                raise ValueError(
                    f"max_loras must be >= 1 and max_lora_rank in [1, 512], got {self.max_loras}, {self.max_lora_rank}"
                )
        elif self.lora_modules:
            raise ValueError("lora_modules needs enable_lora")
        if self.num_kv_slots is not None and self.num_kv_slots < self.page_size:
            raise ValueError(f"num_kv_slots must be >= page_size ({self.page_size}), got {self.num_kv_slots}")

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """Build from keyword arguments, naming any unknown one in the error."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"unknown engine option(s): {', '.join(unknown)}")
        return cls(**kwargs)

    def speculative(self) -> SpeculativeConfig | None:
        """``speculative_config`` validated (raises ValueError naming the bad key), or None when off."""
        return None if self.speculative_config is None else SpeculativeConfig.from_dict(self.speculative_config)

    def lora_adapters(self) -> dict[str, str]:
        """``lora_modules`` as name -> path (ValueError for an entry that is not NAME=PATH, or a name
        given twice)."""
        adapters: dict[str, str] = {}
        for entry in self.lora_modules:
            name, sep, path = str(entry).partition("=")
            if not sep or not name.strip() or not path.strip():
                raise ValueError(f"lora_modules entries must be NAME=PATH, got {entry!r}")
            if name.strip() in adapters:
                raise ValueError(f"lora_modules names {name.strip()!r} twice")
            adapters[name.strip()] = path.strip()
        return adapters

    def request_limits(self, vocab_size: int) -> RequestLimits:
        """The caps above, for a model with ``vocab_size`` tokens."""
        return RequestLimits(
            vocab_size,
            max_n=self.max_n,
            max_tokens_cap=self.max_tokens_cap,
            max_top_logprobs=self.max_top_logprobs,
            max_stop_strings=self.max_stop_strings,
            max_stop_chars=self.max_stop_chars,
            max_stop_token_ids=self.max_stop_token_ids,
            max_structured_output_chars=self.max_structured_output_chars,
        )

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

    def resolved_kv_dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        """The KV cache's dtype: the model's for "auto"."""
        return model_dtype if self.kv_cache_dtype == "auto" else KV_DTYPES[self.kv_cache_dtype]

    def resolved_dtype(self, checkpoint_dtype: torch.dtype | None) -> torch.dtype:
        """ "auto": on CPU bf16 where the CPU multiplies bf16 natively (AMX or AVX512-BF16), else fp32
        (emulated bf16 is far slower); on GPU the checkpoint's dtype."""
        if self.dtype != "auto":
            return DTYPES[self.dtype]
        if self.resolved_device().type == "cpu":
            return torch.bfloat16 if native_bf16() else torch.float32
        return checkpoint_dtype or torch.bfloat16
