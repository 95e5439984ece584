"""The engine: requests in, one batched model step at a time, events out.

One :meth:`LLMEngine.step` = schedule (scheduler.py) -> run the model once over every
scheduled prefill chunk and decode token (model_runner.py) -> sample the requests that
reached the end of their tokens -> detokenize, check stop conditions -> finish requests
and release their KV blocks. The offline :class:`~memra.engine.llm.LLM` and the HTTP
server (through async_engine.py) both drive this loop.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..hub import resolve_model
from ..io.tokenizer import Tokenizer
from ..kernels.batch_invariant import batch_invariant
from ..models import load_model
from .block_manager import KVCacheManager, kv_groups, plan_kv_blocks
from .kv_cache import PagedBatch, PagedKVCache, SeqChunk, kv_storage_dtype
from .model_runner import ModelRunner
from .output import OutputProcessor
from .request import CompletionDelta, Request, RequestEvent, RequestStatus
from .sampling import Sampler, SamplingParams

__all__ = ["EngineConfig", "LLMEngine", "EngineStats", "PromptTooLongError", "DTYPES"]

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
DEFAULT_KV_CACHE_MEMORY = 2 << 30  # bytes, CPU default (vLLM's CPU backend defaults to 4 GiB)


class PromptTooLongError(ValueError):
    """Prompt tokens plus max_tokens exceed the model's context length."""


@dataclass
class EngineConfig:
    """How to build an :class:`LLMEngine`.

    Attributes:
        model: model key (``memra.hub.MODELS``), GGUF path or HF directory.
        dtype: compute and KV-cache dtype (``"float32"`` or ``"bfloat16"``).
        max_model_len: longest sequence (prompt + output) accepted; default the model's context.
        max_num_seqs: most requests running (decoding or prefilling) at once.
        max_num_batched_tokens: most tokens computed per step; prompts longer than this are
            prefilled in chunks.
        block_size: tokens per KV-cache block.
        kv_cache_blocks: blocks per full-attention group; or
        kv_cache_memory: bytes for the whole KV cache (default 2 GiB when neither is given).
        enable_prefix_caching: reuse cached blocks of identical prompt prefixes.
        device: ``"cpu"`` or a CUDA device (``"cuda"``, ``"cuda:1"``). On a GPU the weights keep
            their checkpoint format (:meth:`~memra.models.base.CausalLM.to_gpu`), decode
            steps replay CUDA graphs, and the KV cache takes ``gpu_memory_utilization`` of the
            device's memory minus weights, activations and graphs (unless sized explicitly).
        gpu_memory_utilization: fraction of the GPU's memory memra may use in all (0 < f <= 1).
        enforce_eager: GPU: run every step eagerly (no CUDA graphs).
        attention_weights: GPU: ``"auto"`` keeps the attention projections as loaded; ``"fp8"``
            requantizes bf16 ones to FP8 block 128x128 at load (half the bytes a decode step reads
            for them; :meth:`~memra.models.base.CausalLM.quantize_attention`).
        speculative_method: ``"ngram"`` (prompt lookup), ``"draft"`` (a draft model) or ``"mtp"``
            (the model's MTP layers) to speculate (memra/engine/speculative.py), None not to.
        num_speculative_tokens: most draft tokens per request per step (1..8; for ``mtp`` at most
            the model's MTP layer count).
        speculative_model: the draft model of ``"draft"`` (model key, GGUF path or HF directory):
            same vocabulary as the target, loaded on the same device in the same dtype.
        speculative_max_batch: drafting steps aside while more requests than this are running
            (verification then costs more than it saves).
        tensor_parallel_size: ranks the model is sharded over (memra/parallel: attention heads,
            MLPs, vocabulary). Rank 0 is this process (scheduler, block manager, server); the others
            are spawned workers, or torchrun's ranks. CPU: collectives over gloo. CUDA: rank r on
            cuda:r (torchrun: cuda:$LOCAL_RANK), collectives over NCCL, each shard's weights dense
            in the compute dtype, steps eager (no CUDA graphs).
        enable_expert_parallel: routed experts split by expert over the ranks (EP) instead of along
            their intermediate dimension.
        deterministic: at tensor_parallel_size 1, run the canonical-order parallel path on one rank
            (bit-identical to TP 2 and 4; memra/parallel docstring). TP > 1 always runs it.
        parallel_timeout_s: timeout of every collective (a dead rank fails the run after this).
    """

    model: str = "smollm2-135m"
    dtype: str | None = None  # default: float32 on the CPU, bfloat16 on a GPU
    max_model_len: int | None = None
    max_num_seqs: int | None = None  # default: 64 on the CPU, 256 on a GPU
    max_num_batched_tokens: int | None = None  # default: 512 on the CPU, 4096 on a GPU
    block_size: int = 16
    kv_cache_blocks: int | None = None
    kv_cache_memory: int | None = None
    enable_prefix_caching: bool = True
    device: str = "cpu"
    gpu_memory_utilization: float = 0.9
    enforce_eager: bool = False
    attention_weights: str = "auto"
    speculative_method: str | None = None
    num_speculative_tokens: int = 3
    speculative_max_batch: int = 8
    speculative_model: str | None = None
    tensor_parallel_size: int = 1
    enable_expert_parallel: bool = False
    deterministic: bool = False
    parallel_timeout_s: float = 120.0

    @property
    def parallel(self) -> bool:
        """Whether the model runs through memra/parallel (TP > 1, EP, or the canonical one-rank path)."""
        return self.tensor_parallel_size > 1 or self.enable_expert_parallel or self.deterministic

    def __post_init__(self):
        try:
            dev = torch.device(self.device)
        except (RuntimeError, TypeError) as e:
            raise ValueError(f"device={self.device!r} is not a device (expected 'cpu' or 'cuda[:N]')") from e
        if dev.type not in ("cpu", "cuda"):
            raise ValueError(f"device={self.device!r}: supported devices are 'cpu' and 'cuda[:N]'")
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device={self.device!r}: this torch build sees no CUDA GPU")
        if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device={self.device!r}: only {torch.cuda.device_count()} CUDA device(s) visible")
        if dev.type == "cpu" and dev.index not in (None, 0):
            raise ValueError(f"device={self.device!r}: the CPU device takes no index")
        self.device = str(dev)
        if self.speculative_method is not None:
            from .speculative import SPECULATIVE_METHODS

            if self.speculative_method not in SPECULATIVE_METHODS:
                raise ValueError(f"speculative_method={self.speculative_method!r}: supported: "
                                 f"{', '.join(SPECULATIVE_METHODS)}")
            if not (isinstance(self.num_speculative_tokens, int) and 1 <= self.num_speculative_tokens <= 8):
                raise ValueError(f"num_speculative_tokens={self.num_speculative_tokens!r} must be in 1..8")
            if not (isinstance(self.speculative_max_batch, int) and self.speculative_max_batch >= 1):
                raise ValueError(f"speculative_max_batch={self.speculative_max_batch!r} must be >= 1")
            if (self.speculative_method == "draft") != (self.speculative_model is not None):
                raise ValueError("speculative_model (--draft-model) is needed with speculative_method='draft', and "
                                 f"only with it (got method {self.speculative_method!r}, model "
                                 f"{self.speculative_model!r})")
        elif self.speculative_model is not None:
            raise ValueError("speculative_model is set but speculative_method is not: add speculative_method='draft'")
        if self.attention_weights not in ("auto", "fp8"):
            raise ValueError(f"attention_weights={self.attention_weights!r}: supported are 'auto' and 'fp8'")
        if self.attention_weights == "fp8" and dev.type != "cuda":
            raise ValueError("attention_weights='fp8' needs a GPU (the FP8 decode kernels); on the CPU use 'auto'")
        if not isinstance(self.enforce_eager, bool):
            raise ValueError(f"enforce_eager={self.enforce_eager!r} must be True or False")
        if self.dtype is None:
            self.dtype = "float32" if dev.type == "cpu" else "bfloat16"
        if dev.type == "cuda" and DTYPES.get(self.dtype) != torch.bfloat16 and not (
                self.parallel and DTYPES.get(self.dtype) == torch.float32):
            raise ValueError(f"dtype={self.dtype!r} on a GPU: the GPU kernels compute in bfloat16 (float32 too on the "
                             "parallel path: deterministic / tensor_parallel_size / enable_expert_parallel)")
        if not (isinstance(self.gpu_memory_utilization, (int, float)) and not isinstance(self.gpu_memory_utilization, bool)
                and 0 < self.gpu_memory_utilization <= 1):
            raise ValueError(f"gpu_memory_utilization={self.gpu_memory_utilization!r} must be in (0, 1]")
        if self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r} (supported: {', '.join(DTYPES)})")
        # device-sized defaults: on the H200 a 4096-token prefill chunk ran 3x the tokens/s of a 512-token
        # one (flagship, issue 14); 256 running sequences as vLLM's GPU default. The CPU keeps 64 / 512.
        if self.max_num_seqs is None:
            self.max_num_seqs = 256 if dev.type == "cuda" else 64
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = 4096 if dev.type == "cuda" else 512
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}={v!r} must be an integer >= 1")
        if self.kv_cache_blocks is not None and self.kv_cache_memory is not None:
            raise ValueError("give at most one of kv_cache_blocks and kv_cache_memory")
        if not isinstance(self.tensor_parallel_size, int) or isinstance(self.tensor_parallel_size, bool) \
                or self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size={self.tensor_parallel_size!r} must be an integer >= 1")
        for name in ("enable_expert_parallel", "deterministic"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be True or False")
        if not (isinstance(self.parallel_timeout_s, (int, float)) and not isinstance(self.parallel_timeout_s, bool)
                and 0 < self.parallel_timeout_s < float("inf")):
            raise ValueError(f"parallel_timeout_s={self.parallel_timeout_s!r} must be a finite number of seconds > 0")
        if self.parallel:
            if dev.type == "cuda" and self.attention_weights != "auto":
                raise ValueError(f"attention_weights={self.attention_weights!r} with tensor parallelism: the GPU "
                                 "shards hold their weights dense in the compute dtype (use 'auto')")
            if self.speculative_method == "mtp":
                raise ValueError("speculative_method='mtp' with tensor parallelism is not supported yet (the MTP "
                                 "layers would need the vocabulary-parallel embedding and head on every rank)")
        if dev.type == "cuda" and batch_invariant() and self.parallel:  # refused rather than not invariant
            raise ValueError("MEMRA_BATCH_INVARIANT=1 with the parallel path (tensor_parallel_size / "
                             "enable_expert_parallel / deterministic) is not supported yet: its GPU shards "
                             "call cuBLAS, whose summation order follows the batch")


@dataclass
class EngineStats:
    """Counters and gauges of an engine (tokens unless said otherwise)."""

    num_running: int
    num_waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_prompt_tokens: int
    num_prompt_tokens_computed: int
    num_generation_tokens: int
    num_preemptions: int
    num_steps: int
    num_aborted: int = 0
    spec_draft_tokens: tuple[int, ...] = ()  # per draft position: drafts verified there
    spec_accepted_tokens: tuple[int, ...] = ()  # per draft position: drafts accepted there


def _load(model: str, dtype: torch.dtype, device: torch.device, progress: bool, phase=None):
    """(model, checkpoint, tokenizer) of a model key, GGUF path or HF directory; on a GPU each layer
    moves there as soon as it is built (the host never holds more than one layer's dequantized weights).
    ``phase(name)`` (optional) is called after the weights ("weights") and the tokenizer ("tokenizer").

    The tokenizer is built after the weights, not beside them on a thread: on the H100 host that
    measured a net loss (medians of 3 starts: weights phase +0.53 s against the tokenizer's 0.34 s;
    likely the tokenizer's Python holding the GIL that the loading thread needs between its reads;
    benchmarks/results/issue14/h100-startup-ab-12l-e5d58f3.json)."""
    local = Path(model).expanduser()
    path = local if local.is_dir() else resolve_model(str(model))
    m, ckpt = load_model(path, dtype, progress=progress, device=device if device.type == "cuda" else None)
    if phase is not None:
        phase("weights")
    tok = Tokenizer.from_hf_dir(path) if path.is_dir() else Tokenizer.from_gguf_metadata(ckpt.metadata)
    if phase is not None:
        phase("tokenizer")
    return m, ckpt, tok


def _check_same_vocab(target: Tokenizer, draft: Tokenizer, name: str) -> None:
    """Raises ValueError unless the draft tokenizer maps ids to the same text as the target's
    (checked on 256 ids spread over the draft's vocabulary; files without a vocabulary are not checked)."""
    if not (getattr(target, "has_vocab", True) and getattr(draft, "has_vocab", True)):
        return
    n = min(target.vocab_size, draft.vocab_size)
    for i in sorted({(j * 7919) % n for j in range(256)}):
        a, b = target.decode([i]), draft.decode([i])
        if a != b:
            raise ValueError(f"draft model {name!r}: token id {i} is {b!r} in its vocabulary but {a!r} in the "
                             "target's: the draft model must share the target's tokenizer")


class _Parent:
    """A user request and its ``n`` sequences."""

    __slots__ = ("request_id", "prompt_ids", "children", "prompt_logprobs_sent")

    def __init__(self, request_id: str, prompt_ids: list[int], children: list[Request]):
        self.request_id, self.prompt_ids, self.children = request_id, prompt_ids, children
        self.prompt_logprobs_sent = False


class LLMEngine:
    """A loaded model, its tokenizer, a paged KV cache and a scheduler.

    Args:
        config: :class:`EngineConfig`.
        progress: show a progress bar while loading weights.
        model, tokenizer: an already built model and tokenizer (tests); ``config.model`` is then unused.

    Raises:
        FileNotFoundError, CheckpointError, ConfigError, TokenizerError: the model cannot be loaded.
        ValueError: a config value out of range, or a KV cache too small for one max_model_len sequence.
    """

    def __init__(self, config: EngineConfig | None = None, *, progress: bool = False, model=None,
                 tokenizer: Tokenizer | None = None):
        self.parallel = None
        try:
            self._init(config, progress, model, tokenizer)
        except BaseException:  # a parallel run's workers and process group must not outlive a failed start
            if self.parallel is not None:
                self.parallel.close()
            from ..kernels.precompile import stop_workers

            stop_workers()  # nor the start-up compile processes
            raise

    def _init(self, config: EngineConfig | None, progress: bool, model, tokenizer: Tokenizer | None) -> None:
        cfg = config or EngineConfig()
        self.engine_config = cfg
        t0 = time.perf_counter()
        dtype = DTYPES[cfg.dtype]
        self.checkpoint = None
        device = torch.device(cfg.device)
        # a parallel run shards the CPU-loaded model, then moves each shard to its rank's device
        load_device = torch.device("cpu") if cfg.parallel else device
        #: seconds of each start-up phase, in order (``kv_cache_summary`` prints them)
        self.startup_seconds: dict[str, float] = {}
        self._phase_t = t0
        if model is None:
            if device.type == "cuda":  # Triton's cache-key salt, hashed while the weights are read
                from ..kernels.precompile import warm_triton_key

                warm_triton_key()
            model, self.checkpoint, tokenizer = _load(cfg.model, dtype, load_device, progress, self._phase)
            self.model_name = str(cfg.model)
        else:
            self.model_name = str(cfg.model)
            if load_device.type == "cuda" and getattr(model.lm_head, "kernel", None) != "gpu":
                model.to_gpu(device, dtype)
        if cfg.parallel:  # rank 0 of a TP / EP run (memra/engine/tensor_parallel.py): shard, start the workers
            from .tensor_parallel import start

            model = start(model, cfg.model, dtype, cfg.tensor_parallel_size, cfg.enable_expert_parallel,
                          cfg.parallel_timeout_s, threads=torch.get_num_threads(), device=device)
            self.parallel = model
        self.model, self.tokenizer = model, tokenizer
        self.config = model.config
        model.quantize_attention(cfg.attention_weights)
        #: the key of the start-up precompile's manifests (GPU, one process): :meth:`_precompile_key`
        self._start_key = self._precompile_key(device) if device.type == "cuda" and not cfg.parallel else None
        self._phase("weights")  # (read, repacked, sharded for a parallel run, attention quantized)
        self.eos_ids = sorted(set(tokenizer.eos_token_ids) | set(self.config.eos_token_ids))
        ctx = self.config.max_position_embeddings
        if cfg.max_model_len is not None and not (1 <= cfg.max_model_len <= ctx):
            raise ValueError(f"max_model_len={cfg.max_model_len} must be in [1, {ctx}] (the model's context length)")
        self.max_model_len = cfg.max_model_len or ctx
        groups = kv_groups(self.config)
        kv_dtype = kv_storage_dtype(model.dtype, device)
        draft = None
        if cfg.speculative_method == "draft":  # loaded first: on a GPU the KV budget counts its weights
            draft, _, draft_tok = _load(cfg.speculative_model, dtype, device, progress)
            _check_same_vocab(tokenizer, draft_tok, cfg.speculative_model)
            self._phase("draft model")
        memory = cfg.kv_cache_memory
        self.memory_report = ""
        self.precompile_reports = []  # memra.kernels.precompile: Triton kernels compiled in parallel at start
        if cfg.kv_cache_blocks is None and memory is None:
            memory = DEFAULT_KV_CACHE_MEMORY if device.type == "cpu" else self._gpu_kv_budget(groups, device)
            self._phase("KV-cache profile")
        if memory is not None and cfg.speculative_method in ("draft", "mtp"):
            # the proposer's own KV cache comes out of the same budget
            from .speculative import proposer_cache_share

            memory = proposer_cache_share(cfg.speculative_method, memory, groups, model, draft, kv_dtype,
                                          cfg.num_speculative_tokens, cfg.block_size, cfg.max_num_seqs,
                                          self.max_model_len, cfg.max_num_batched_tokens)
        blocks = plan_kv_blocks(groups, cfg.block_size, kv_dtype, num_blocks=cfg.kv_cache_blocks,
                                memory_bytes=memory, max_num_seqs=cfg.max_num_seqs,
                                max_num_batched_tokens=cfg.max_num_batched_tokens, max_model_len=self.max_model_len)
        self.kv = KVCacheManager(groups, blocks, cfg.block_size, cfg.enable_prefix_caching)
        # on a GPU each group gets one more block, never allocated: padded decode rows write there
        extra = 1 if device.type == "cuda" else 0
        self.cache = PagedKVCache(groups, [b + extra for b in blocks], cfg.block_size, kv_dtype, device=device)
        if self.parallel is not None:  # every rank holds the same blocks of its own KV heads
            self.parallel.announce_cache(groups, [b + extra for b in blocks], cfg.block_size, kv_dtype)
        from .scheduler import Scheduler

        self.scheduler = Scheduler(self.kv, cfg.max_num_seqs, cfg.max_num_batched_tokens)
        graphs = None
        if device.type == "cuda" and self.parallel is not None:  # each step is a message to the workers first
            self.memory_report += "; CUDA graphs: off (tensor parallel steps run eager)"
        elif device.type == "cuda" and not cfg.enforce_eager:
            from .cuda_graph import MAX_GRAPH_BATCH, CudaGraphRunner

            rows = cfg.max_num_seqs
            if cfg.speculative_method is not None:  # verify steps: 1 + K graph rows per sequence
                rows = max(rows, min(MAX_GRAPH_BATCH, min(cfg.max_num_seqs, cfg.speculative_max_batch)
                                     * (1 + cfg.num_speculative_tokens)))
            graphs = CudaGraphRunner(model, self.cache, rows, -(-self.max_model_len // cfg.block_size),
                                     scratch_blocks=blocks)
            key = self._start_key
            graphs.capture(manifest=key and f"{key}|CUDA graphs")
            self._phase("CUDA graphs")
            self.memory_report += (f"; CUDA graphs: {len(graphs.buckets)} batch sizes ({graphs.buckets[0]}.."
                                   f"{graphs.buckets[-1]}) in {graphs.capture_seconds:.1f} s, "
                                   f"{graphs.pool_bytes / 2**20:.0f} MiB")
        self.graphs = graphs
        if graphs is not None:
            self.precompile_reports.append(graphs.precompile)
        from ..kernels.precompile import describe, stop_workers

        self.memory_report += describe(self.precompile_reports)
        stop_workers()
        self.runner = ModelRunner(model, self.cache, graphs)
        self.proposer = None
        if cfg.speculative_method is not None:
            from .speculative import make_proposer

            self.proposer = make_proposer(
                cfg.speculative_method, model=model, draft_model=draft, k=cfg.num_speculative_tokens, device=device,
                block_size=cfg.block_size, max_num_seqs=cfg.max_num_seqs, max_model_len=self.max_model_len,
                max_num_batched_tokens=cfg.max_num_batched_tokens,
                main_blocks=max(blocks),  # (a full-attention group's count: sliding ones are capped below it)
                graphs=graphs is not None, max_graph_reqs=min(cfg.max_num_seqs, cfg.speculative_max_batch))
            g = getattr(self.proposer, "graphs", None)
            if g is not None and device.type == "cuda":
                self.memory_report += (f"; MTP drafting graphs: {len(g.graphs)} ({cfg.num_speculative_tokens} layers x "
                                       f"{g.buckets[0]}..{g.buckets[-1]} requests) in {g.capture_seconds:.1f} s")
            self._phase("proposer")
        self.spec_drafted = [0] * cfg.num_speculative_tokens  # per draft position: proposed, accepted
        self.spec_accepted = [0] * cfg.num_speculative_tokens
        self._parents: dict[str, _Parent] = {}
        self._num_prompt_tokens = self._num_prompt_computed = self._num_generated = self._num_steps = 0
        self._num_aborted = 0
        self._failures: list[tuple[str, Exception]] = []
        self._phase("other")
        self.load_seconds = self._phase_t - t0

    def _phase(self, name: str) -> None:
        """Closes the start-up phase ``name``: the seconds since the last one ended."""
        now = time.perf_counter()
        self.startup_seconds[name] = self.startup_seconds.get(name, 0.0) + now - self._phase_t
        self._phase_t = now

    def close(self) -> None:
        """Stops the worker ranks of a parallel run; on a GPU also releases the KV cache, the CUDA
        graphs and the model's memory, so that a closed engine (``with LLM(...)`` left) holds none
        while the next one sizes its KV cache (idempotent; the engine cannot step afterwards)."""
        if self.parallel is not None:
            self.parallel.close()
        if torch.device(self.engine_config.device).type == "cuda" and self.runner is not None:
            self.runner = self.graphs = self.proposer = self.cache = None
            self.model = None
            import gc

            gc.collect()
            torch.cuda.empty_cache()

    def _precompile_key(self, device: torch.device) -> str | None:
        """What decides which Triton kernels this engine's start launches (the key of the start-up
        precompile's manifest, memra/kernels/precompile.py): the model file(s) (path, size,
        modification time), the engine config, the weights' dtype, torch's version and the GPU
        (name, SMs, memory). None for a model passed in as an object (nothing names it), or when
        its files cannot be read any more."""
        if self.checkpoint is None or getattr(self.checkpoint, "path", None) is None:
            return None
        p = Path(self.checkpoint.path)
        try:
            files = [p] if p.is_file() else sorted(q for q in p.iterdir() if q.is_file())
            stats = [(str(q.resolve()), q.stat().st_size, q.stat().st_mtime_ns) for q in files]
        except OSError:  # gone or unreadable since the load: no manifest (the record pass runs)
            return None
        props = torch.cuda.get_device_properties(device)
        return repr((stats, self.engine_config, str(self.model.dtype), torch.__version__, props.name,
                     props.multi_processor_count, props.total_memory))

    def _gpu_kv_budget(self, groups, device: torch.device) -> int:
        """Bytes for the KV cache on a GPU: ``gpu_memory_utilization`` of the device's memory
        minus what is in use now (CUDA context, weights), the peak activations of one
        ``max_num_batched_tokens`` prefill step (measured by running one on a scratch cache)
        and a margin for the CUDA graphs' memory pool.

        Raises: ValueError if nothing is left for the KV cache (names the numbers)."""
        cfg = self.engine_config
        t = min(cfg.max_num_batched_tokens, self.max_model_len)
        scratch_blocks = -(-t // cfg.block_size) + 1

        def profile_step():
            cache = PagedKVCache(groups, [scratch_blocks] * len(groups), cfg.block_size, self.model.dtype,
                                 device=device)
            kv = PagedBatch(cache, [SeqChunk(0, t, [list(range(scratch_blocks - 1))] * len(groups))])
            with torch.inference_mode():
                hidden = self.model(torch.zeros(t, dtype=torch.int64, device=device),
                                    torch.arange(t, device=device), kv)
                self.model.logits(hidden[-1:])
            return cache, kv, hidden

        weights = torch.cuda.memory_allocated(device)  # before a step allocates its persistent workspaces
        if self.parallel is None:  # (a TP / EP rank 0 must not feed the workers' collectives garbage)
            from ..kernels.precompile import precompile

            # its kernels, compiled in parallel; the workers stay for the CUDA-graph capture's
            key = self._start_key
            self.precompile_reports.append(precompile([profile_step], device, keep_workers=True,
                                                      manifest=key and f"{key}|profile step of {t} tokens"))
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        cache, kv, hidden = profile_step()
        torch.cuda.synchronize(device)
        activations = torch.cuda.max_memory_allocated(device) - base
        del cache, kv, hidden
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(device)
        used = total - free
        graph_margin = 0 if cfg.enforce_eager else 512 << 20
        budget = int(cfg.gpu_memory_utilization * total) - used - activations - graph_margin
        self.memory_report = (f"GPU memory: {total / 2**30:.1f} GiB total, {used / 2**30:.2f} GiB in use after "
                              f"loading (weights {weights / 2**30:.2f} GiB, persistent workspaces "
                              f"{(base - weights) / 2**30:.2f} GiB), {activations / 2**30:.2f} GiB peak "
                              f"activations for a {t}-token step, {graph_margin >> 20} MiB kept for CUDA graphs; "
                              f"KV budget at gpu_memory_utilization={cfg.gpu_memory_utilization}: "
                              f"{max(budget, 0) / 2**30:.2f} GiB")
        if budget <= 0:
            raise ValueError(f"no GPU memory left for the KV cache: {self.memory_report}. Raise "
                             f"--gpu-memory-utilization, or lower --max-num-batched-tokens")
        return budget

    # ---------------------------------------------------------------- input
    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        """Token ids of a prompt given as text (special tokens parsed, bos per the model) or ids.

        Raises:
            ValueError: empty prompt, or a token id outside the vocabulary.
        """
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        self._check_ids(ids)
        return ids

    def _check_ids(self, ids: list[int]) -> None:
        if not ids:
            raise ValueError("prompt is empty: it must contain at least one token")
        V = self.config.vocab_size
        bad = [t for t in ids if not (isinstance(t, int) and 0 <= t < V)]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {V})")

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Check a request before it is queued.

        Raises:
            ValueError: empty prompt, token ids or stop_token_ids outside the vocabulary.
            PromptTooLongError: prompt + max_tokens > max_model_len.
            KVCapacityError: the sequence could never fit in the KV cache, even alone.
        """
        self._check_ids(prompt_ids)
        total = len(prompt_ids) + params.max_tokens
        if total > self.max_model_len:
            raise PromptTooLongError(
                f"prompt of {len(prompt_ids)} tokens plus max_tokens={params.max_tokens} is {total} tokens, "
                f"more than the context length {self.max_model_len}")
        if params.stop and getattr(self.tokenizer, "has_vocab", True) is False:
            raise ValueError("invalid sampling parameter stop: this model has no vocabulary (GGUF "
                             "tokenizer.ggml.model = 'none'), so its output has no text to match; use stop_token_ids")
        V = self.config.vocab_size
        bad = [t for t in params.stop_token_ids if t >= V]
        if bad:
            raise ValueError(f"invalid sampling parameter stop_token_ids: id {bad[0]} is outside the vocabulary [0, {V})")
        bad = [t for t in params.logit_bias if t >= V]
        if bad:
            raise ValueError(f"invalid sampling parameter logit_bias: token id {bad[0]} is outside the vocabulary "
                             f"[0, {V})")
        self.kv.check_fits(total, self.scheduler.max_num_batched_tokens)

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                    prompt_logprobs: int | None = None, arrival_time: float | None = None) -> None:
        """Queue a request (``params.n`` sequences sharing the prompt).

        Args:
            request_id: unique among unfinished requests.
            prompt_logprobs: also return the top-k logprobs of each prompt token (0..20).
        Raises:
            ValueError: duplicate id, bad prompt_logprobs, or anything :meth:`validate` raises.
        """
        if request_id in self._parents:
            raise ValueError(f"request id {request_id!r} is already in use")
        if prompt_logprobs is not None and not (isinstance(prompt_logprobs, int) and 0 <= prompt_logprobs <= 20):
            raise ValueError(f"invalid parameter prompt_logprobs={prompt_logprobs!r}: must be an integer in [0, 20]")
        self.validate(prompt_ids, params)
        V = self.config.vocab_size
        children = []
        for j in range(params.n):
            rid = request_id if params.n == 1 else f"{request_id}#{j}"
            end_ids = list(params.stop_token_ids) + ([] if params.ignore_eos else list(self.eos_ids))
            req = Request(rid, prompt_ids, params, Sampler(params, prompt_ids, V, seed_offset=j, end_ids=end_ids),
                          OutputProcessor(j, self.tokenizer, params, self.eos_ids, prompt_ids), index=j,
                          prompt_logprobs=prompt_logprobs if j == 0 else None, arrival_time=arrival_time)
            req.parent_id = request_id
            req.leader = children[0] if children else None
            children.append(req)
        self._parents[request_id] = _Parent(request_id, list(prompt_ids), children)
        self._num_prompt_tokens += len(prompt_ids)
        for req in children:
            self.scheduler.add(req)

    def abort_request(self, request_id: str) -> bool:
        """Stop a request and release everything it holds. Returns False if it is unknown or finished."""
        parent = self._parents.pop(request_id, None)
        if parent is None:
            return False
        for req in parent.children:
            if not req.status.finished:
                self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)
        self._num_aborted += 1
        return True

    def has_unfinished(self) -> bool:
        """Whether any request is still waiting or running."""
        return bool(self._parents)

    def request_ids(self) -> list[str]:
        """Ids of the unfinished requests."""
        return list(self._parents)

    # ----------------------------------------------------------------- step
    def step(self) -> list[RequestEvent]:
        """Run one engine step. Returns one event per user request with news this step.

        Raises: RuntimeError once the engine is closed (GPU: its memory is released)."""
        if self.runner is None:
            raise RuntimeError("the engine is closed: its GPU memory was released (close() / the with block)")
        batch = self.scheduler.schedule()
        if not batch.items:
            return []
        self._num_steps += 1
        p = self.proposer
        logits = self.runner.execute(batch.items, hidden=p is not None and p.needs_hidden and self._drafting())
        events: dict[str, RequestEvent] = {}
        for req, n in batch.items:
            if id(req) in logits.verify:  # a decode with drafts: verified, then rolled back
                if req.parent_id in self._parents:
                    self._deliver(events, req, self._verify, req, logits.verify[id(req)])
                continue
            start = req.num_computed_tokens
            self._num_prompt_computed += max(0, min(start + n, len(req.prompt_ids)) - start)
            req.num_computed_tokens += n
            self.kv.cache_computed(req)
            if id(req) in logits.prompt:
                self._collect_prompt_logprobs(req, *logits.prompt[id(req)])
            if (id(req) in logits.sample or id(req) in logits.greedy) and req.parent_id in self._parents:
                self._deliver(events, req, self._sample, req, logits.sample.get(id(req)), logits.greedy.get(id(req)))
        for rid, ev in events.items():
            parent = self._parents[rid]
            if all(c.status.finished for c in parent.children):
                ev.finished = True
                del self._parents[rid]
        self._propose(logits.hidden)
        return list(events.values())

    def _deliver(self, events: dict[str, RequestEvent], req: Request, fn, *args) -> None:
        """Append ``fn(*args)`` (the request's delta of this step) to its event; if it raises, this
        request fails and is aborted, the others go on."""
        try:
            delta = fn(*args)
        except Exception as e:  # noqa: BLE001 - this request fails, the others go on
            events.pop(req.parent_id, None)
            self.abort_request(req.parent_id)
            self._failures.append((req.parent_id, e))
            return
        self._event(events, req).deltas.append(delta)

    # ----------------------------------------------------------------- speculation
    def _drafting(self) -> bool:
        """Whether requests draft now: speculation on, and at most ``speculative_max_batch`` running."""
        return self.proposer is not None and len(self.scheduler.running) <= self.engine_config.speculative_max_batch

    def _propose(self, hidden: dict) -> None:
        """Give each decoding request its drafts for the next step (none while the batch is large, or
        where max_tokens / the context leave no room); ``hidden``: this step's pre-norm hidden rows
        (MTP). Constrained requests draft too: verification masks each position with the grammar
        state after the drafts accepted before it (a draft the grammar forbids has p = 0 and is
        rejected), and the matcher only ever consumes verified tokens, so nothing needs rolling back."""
        if self.proposer is None:
            return
        running = self.scheduler.running
        cfg = self.engine_config
        room: dict[int, int] = {}
        for req in running:
            req.spec_tokens = []
            if req.num_tokens - req.num_computed_tokens != 1:
                continue
            r = min(cfg.num_speculative_tokens, req.params.max_tokens - len(req.output_ids) - 1,
                    self.max_model_len - req.num_tokens)
            if r > 0:
                room[id(req)] = r
        self.proposer.release({id(r) for r in running})
        if not self._drafting():
            return
        drafts = self.proposer.draft(running, room, hidden)
        for req in running:
            req.spec_tokens = list(drafts.get(id(req), ()))[:room.get(id(req), 0)]

    def _verify(self, req: Request, rows: torch.Tensor) -> CompletionDelta:
        """Verify ``req``'s drafts against the target's logits ``rows`` [1 + k, vocab] (row j scored
        the position after the last token and the first j drafts): accept in order
        (:meth:`Sampler.speculate`), stop at the first rejection, the bonus token when all pass;
        stop conditions apply token by token as in plain decode. Then roll the KV back past the last
        accepted draft and register only verified blocks in the prefix cache."""
        drafts, req.spec_tokens = req.spec_tokens[:rows.shape[0] - 1], []
        req.num_computed_tokens += 1  # the last token's K/V are valid
        texts, tokens, lps = [], [], [] if req.params.logprobs is not None else None
        out = req.output
        for j in range(rows.shape[0]):
            if j < len(drafts):
                r, accepted = req.sampler.speculate(rows[j], drafts[j])
                self.spec_drafted[j] += 1
                self.spec_accepted[j] += int(accepted)
            else:
                r, accepted = req.sampler.sample(rows[j]), False
            self._num_generated += 1
            texts.append(req.processor.add(r))
            tokens.append(r.token)
            if lps is not None:
                lps.append((r.token, r.logprob, r.top or []))
            if out.finish_reason is not None or not accepted:
                break
            req.num_computed_tokens += 1  # the accepted draft's K/V (computed at its position) are valid
        delta = CompletionDelta(req.index, "".join(texts), tokens, lps, out.finish_reason, out.stop_reason)
        if out.finish_reason is not None:
            self.scheduler.finish(req, RequestStatus.FINISHED_STOPPED if out.finish_reason == "stop"
                                  else RequestStatus.FINISHED_LENGTH)
        else:
            self.kv.trim(req)
            self.kv.cache_computed(req)
        return delta

    def _sample(self, req: Request, logits: torch.Tensor | None,
                greedy: tuple[int, float] | None = None) -> CompletionDelta:
        """Sample the request's next token (from host ``logits``, or take the ``greedy``
        (token, logit) chosen on the GPU), detokenize, check stop conditions, finish it if done."""
        r = req.sampler.sample(logits) if greedy is None else req.sampler.take(*greedy)
        self._num_generated += 1
        text = req.processor.add(r)
        out = req.output
        delta = CompletionDelta(req.index, text, [r.token],
                                [(r.token, r.logprob, r.top or [])] if req.params.logprobs is not None else None,
                                out.finish_reason, out.stop_reason)
        if out.finish_reason is not None:
            self.scheduler.finish(req, RequestStatus.FINISHED_STOPPED if out.finish_reason == "stop"
                                  else RequestStatus.FINISHED_LENGTH)
        return delta

    def pop_failures(self) -> list[tuple[str, Exception]]:
        """Requests that failed in the last steps (already aborted), with the exception; clears the list."""
        out, self._failures = self._failures, []
        return out

    def _event(self, events: dict[str, RequestEvent], req: Request) -> RequestEvent:
        rid = req.parent_id
        parent = self._parents[rid]
        ev = events.get(rid)
        if ev is None:
            ev = events[rid] = RequestEvent(rid, parent.prompt_ids,
                                            num_cached_tokens=parent.children[0].num_cached_tokens)
            c0 = parent.children[0]
            if c0.collected_prompt_logprobs is not None and not parent.prompt_logprobs_sent:
                ev.prompt_logprobs = c0.collected_prompt_logprobs
                parent.prompt_logprobs_sent = True
        return ev

    @staticmethod
    def _collect_prompt_logprobs(req: Request, first: int, logits: torch.Tensor) -> None:
        lp = torch.log_softmax(logits, dim=-1)
        k = req.prompt_logprobs
        for r in range(lp.shape[0]):
            p = first + r
            if len(req.collected_prompt_logprobs) != p + 1:
                continue  # already collected (recomputed after preemption)
            tok = req.prompt_ids[p + 1]
            top = []
            if k:
                v, i = torch.topk(lp[r], k)
                top = list(zip(i.tolist(), v.tolist()))
            req.collected_prompt_logprobs.append((float(lp[r, tok]), top))

    # ---------------------------------------------------------------- stats
    def kv_cache_summary(self) -> str:
        """One line: the KV cache allocated (blocks and tokens per group, bytes, dtype)."""
        parts = []
        for g, pool in zip(self.kv.groups, self.kv.pools):
            span = "full attention" if g.window is None else f"window {g.window}"
            parts.append(f"{pool.num_blocks} blocks ({pool.num_blocks * self.kv.block_size} tokens) for "
                         f"{len(g.layers)} {span} layers")
        cfg = self.engine_config
        line = (f"KV cache: {self.cache.nbytes / 2**30:.2f} GiB {str(self.cache.dtype).removeprefix('torch.')}, "
                f"blocks of {self.kv.block_size} tokens: " + "; ".join(parts)
                + f"\nscheduler: up to {cfg.max_num_seqs} running sequences, {cfg.max_num_batched_tokens} tokens per "
                f"step (longer prompts are prefilled in chunks of that size)"
                + (f"; tensor parallel {cfg.tensor_parallel_size}" + (" + expert parallel" if cfg.enable_expert_parallel
                                                                      else "") if cfg.parallel else ""))
        phases = ", ".join(f"{k} {v:.1f} s" for k, v in self.startup_seconds.items() if k != "other" and v >= 0.05)
        line += f"\nstart-up: {self.load_seconds:.1f} s" + (f" ({phases})" if phases else "")
        return line + (f"\n{self.memory_report.lstrip('; ')}" if self.memory_report else "")

    def stats(self) -> EngineStats:
        """The engine's counters and gauges now."""
        s = self.scheduler
        return EngineStats(
            num_running=len(s.running), num_waiting=len(s.waiting), kv_blocks_used=self.kv.num_used_blocks,
            kv_blocks_total=self.kv.num_blocks, prefix_cache_queries=self.kv.prefix_queries,
            prefix_cache_hits=self.kv.prefix_hits, num_prompt_tokens=self._num_prompt_tokens,
            num_prompt_tokens_computed=self._num_prompt_computed, num_generation_tokens=self._num_generated,
            num_preemptions=s.num_preemptions, num_steps=self._num_steps, num_aborted=self._num_aborted,
            spec_draft_tokens=tuple(self.spec_drafted) if self.proposer else (),
            spec_accepted_tokens=tuple(self.spec_accepted) if self.proposer else ())
