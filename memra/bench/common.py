"""The helpers that memra's GPU benches share (census, moe_census, moe_grouped, moe_tune, decode,
prefill): each bench imports them from here, never from another bench.

- timing: :func:`cuda_graph_us` (CUDA-graph replays, no host launch cost), :func:`eager_us` and
  :func:`median_ms` (eager calls, CUDA events, host launches included);
- ceilings measured in the run: :func:`copy_bandwidth` (device-to-device copy, bytes/s) and
  :func:`matmul_ceilings` (bf16 ``torch.mm`` and FP8 ``torch._scaled_mm``, FLOP/s);
- provenance and output: :func:`commit` (the checkout's git commit), :func:`write_json`;
- the flagship's routed-expert shape (:data:`FLAGSHIP`), the expert formats (:data:`FORMATS`),
  random expert banks and MoE inputs (:func:`random_bank`, :func:`random_moe`,
  :func:`random_routing`);
- routing generators and statistics: the production-shaped :func:`skewed_routing` (fitted by
  :func:`fit_skew`, constants :data:`SKEW_SPAN`, :data:`SKEW_GAMMA`), :func:`uniform_routing`,
  :func:`routing_weights`, :func:`routing_stats`, :func:`padded_rows`;
- MoE accounting: :func:`expert_nbytes`, :func:`projection_costs`; the comparison with a
  reference: :func:`rel_err`, :data:`CHECK_TOL`;
- :func:`phase_fns`: the per-phase closures of one model forward (decode and prefill benches).

Import cost: torch only. Triton, memra.kernels and memra.models are imported inside the
functions that need them; the GPU helpers need a CUDA device when called, not when imported.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from ..kernels.moe_decode import ExpertBank

__all__ = [
    "cuda_graph_us", "eager_us", "median_ms",
    "copy_bandwidth", "matmul_ceilings", "no_cuda_message", "require_cuda",
    "commit", "write_json",
    "FLAGSHIP", "FORMATS", "random_bank", "random_moe", "random_routing",
    "SKEW_SPAN", "SKEW_GAMMA", "SKEW_TARGET",
    "skewed_routing", "uniform_routing", "routing_weights", "padded_rows", "routing_stats", "fit_skew",
    "expert_nbytes", "projection_costs", "CHECK_TOL", "rel_err",
    "phase_fns",
]


# ---------------------------------------------------------------------------------------
# the GPU benches' one message when no GPU is visible


def no_cuda_message(command: str) -> str:
    """What ``memra bench <command>`` says when torch sees no CUDA GPU (every GPU bench says it
    the same way)."""
    return (f"memra bench {command}: needs a CUDA GPU, and torch {torch.__version__} sees none (a CPU "
            f"build of torch, no driver, or CUDA_VISIBLE_DEVICES hiding the GPUs)")


def require_cuda(command: str) -> None:
    """Raises: SystemExit (status 1, :func:`no_cuda_message`) when torch sees no CUDA GPU."""
    if not torch.cuda.is_available():
        raise SystemExit(no_cuda_message(command))


# ---------------------------------------------------------------------------------------
# timing (CUDA events; needs a CUDA device)


def cuda_graph_us(calls, reps: int, inner: int) -> float:
    """Median µs per call of a CUDA graph of ``inner`` back-to-back calls, replayed.

    ``calls``: zero-argument callables that launch GPU work on the current stream. Each is run
    once eagerly (warm-up: compilation, autotuning), the first two once more on a side stream
    (as capture requires), then ``inner`` calls cycling through them (``calls[j % len(calls)]``;
    rotating over several weight copies keeps the bytes touched past L2) are captured in one
    graph, replayed once, and replayed ``reps`` times, each replay between two CUDA events.
    Returns the median over the replays of (replay time / ``inner``), in µs. No host launch
    cost is included (unlike :func:`eager_us`): the time of the kernels as a graph runs them.
    """
    for c in calls:
        c()
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for c in calls[:2]:
            c()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(inner):
            calls[i % len(calls)]()
    g.replay()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    out = []
    for _ in range(reps):
        e0.record()
        g.replay()
        e1.record()
        e1.synchronize()
        out.append(e0.elapsed_time(e1) * 1000.0 / inner)
    del g
    return statistics.median(out)


def eager_us(fn, inner: int = 3, reps: int = 1, warm: int = 1) -> float:
    """µs per call of ``fn`` (a zero-argument callable that launches GPU work) run eagerly.

    ``warm`` warm-up calls and a synchronize, then ``reps`` samples, each one pair of CUDA
    events around ``inner`` back-to-back calls (sample = elapsed / ``inner``). Returns the
    median of the samples, in µs. Unlike :func:`cuda_graph_us` the host's launch cost is included,
    so it is meant for calls of a millisecond or more, where that cost is negligible. The
    defaults (one sample of 3 calls) give a quick estimate, e.g. to size a graph's ``inner``;
    :func:`median_ms` is the same with ``inner=1``, in ms.
    """
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ts = []
    for _ in range(reps):
        e0.record()
        for _ in range(inner):
            fn()
        e1.record()
        e1.synchronize()
        ts.append(e0.elapsed_time(e1) * 1000.0 / inner)
    return statistics.median(ts)


def median_ms(fn, reps: int = 20, warm: int = 3) -> float:
    """Median ms of single eager calls of ``fn`` (GPU work): ``warm`` warm-up calls, then ``reps``
    calls, each between its own pair of CUDA events (:func:`eager_us` with ``inner=1``, in ms).
    For whole steps, phases and graph replays (``median_ms(graph.replay)``)."""
    return eager_us(fn, inner=1, reps=reps, warm=warm) / 1000.0


# ---------------------------------------------------------------------------------------
# ceilings measured in the run (need a CUDA device)


def copy_bandwidth(nbytes: int = 2 << 30, reps: int = 20) -> float:
    """Device-to-device copy bandwidth in bytes/s (bytes read + bytes written): torch ``copy_``
    of an ``nbytes`` uint8 buffer, 3 warm-up copies, median of ``reps`` (:func:`median_ms`).
    The ceiling a streaming kernel can reach."""
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = median_ms(lambda dst=dst, src=src: dst.copy_(src), reps=reps, warm=3)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes / (ms / 1000.0)


def matmul_ceilings(m: int = 8192, reps: int = 10, inner: int = 5) -> dict:
    """bf16 ``torch.mm`` and FP8 ``torch._scaled_mm`` (E4M3 x E4M3 -> bf16) at m^3 on random
    data, timed in CUDA graphs (:func:`cuda_graph_us`): {m, bf16_us, bf16_flops_per_s,
    fp8_flops_per_s, fp8_scaling, fp8_error} (+ fp8_us), FLOP/s = 2 m^3 / time.
    FP8 uses row-wise fp32 scales ([m, 1] x [1, m]); if torch refuses them, one tensor-wise
    scale each (``fp8_scaling`` says which); if ``_scaled_mm`` fails altogether,
    fp8_flops_per_s is None and ``fp8_error`` says why."""
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(123)
    a = torch.randn(m, m, device=dev, generator=gen).to(torch.bfloat16)
    b = torch.randn(m, m, device=dev, generator=gen).to(torch.bfloat16)
    c = torch.empty(m, m, device=dev, dtype=torch.bfloat16)
    us = cuda_graph_us([lambda a=a, b=b, c=c: torch.mm(a, b, out=c)], reps, inner)
    out = dict(m=m, bf16_us=us, bf16_flops_per_s=2.0 * m ** 3 / (us * 1e-6), fp8_flops_per_s=None,
               fp8_scaling=None, fp8_error=None)
    if hasattr(torch, "_scaled_mm"):
        a8 = a.to(torch.float8_e4m3fn)
        b8 = b.to(torch.float8_e4m3fn).t()  # column-major, as cuBLASLt wants the second operand
        tries = (("row-wise", torch.full((m, 1), 1.0, device=dev), torch.full((1, m), 1.0, device=dev)),
                 ("tensor-wise", torch.ones((), device=dev), torch.ones((), device=dev)))
        errs = []
        for name, sa, sb in tries:
            try:
                us8 = cuda_graph_us([lambda sa=sa, sb=sb: torch._scaled_mm(a8, b8, sa, sb, out_dtype=torch.bfloat16)],
                                    reps, inner)
            except Exception as e:  # row-wise scaling is not in every build
                errs.append(f"{name}: {type(e).__name__}: {str(e)[:200]}")
                torch.cuda.synchronize()
                continue
            out.update(fp8_us=us8, fp8_flops_per_s=2.0 * m ** 3 / (us8 * 1e-6), fp8_scaling=name)
            break
        out["fp8_error"] = "; ".join(errs) or None
    else:
        out["fp8_error"] = "torch has no _scaled_mm"
    del a, b, c
    torch.cuda.empty_cache()
    return out


# ---------------------------------------------------------------------------------------
# provenance and output


def add_batch_invariant_arg(p) -> None:
    """``--batch-invariant on|off`` on a bench's parser (None: the environment's
    ``MEMRA_BATCH_INVARIANT``; memra/kernels/batch_invariant.py)."""
    p.add_argument("--batch-invariant", choices=["on", "off"], default=None,
                   help="batch-invariant mode (memra/kernels/batch_invariant.py): every kernel choice independent "
                        "of the step's shape; unset: MEMRA_BATCH_INVARIANT decides (1/true/on/yes: on; "
                        "0/false/off/no or unset: off)")


def apply_batch_invariant(a) -> bool:
    """Set the mode from ``a.batch_invariant`` (before any model or CUDA graph is built) and return
    whether it is on."""
    from ..kernels.batch_invariant import batch_invariant, set_batch_invariant

    if getattr(a, "batch_invariant", None) is not None:
        set_batch_invariant(a.batch_invariant == "on")
    return batch_invariant()


def commit() -> str:
    """The git commit the benches record: HEAD of the checkout, ``+dirty`` when anything under
    memra/ differs from it, ``unknown`` without git; the environment variable
    MEMRA_COMMIT overrides (the GPU machine's copy of the repository may carry a stale .git)."""
    if os.environ.get("MEMRA_COMMIT"):
        return os.environ["MEMRA_COMMIT"]
    try:
        r = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10,
                           cwd=Path(__file__).resolve().parents[2])
        dirty = subprocess.run(["git", "status", "--porcelain", "memra"],
                               capture_output=True, text=True, timeout=10,
                               cwd=Path(__file__).resolve().parents[2]).stdout.strip()
        return r.stdout.strip() + ("+dirty" if dirty else "") if r.returncode == 0 else "unknown"
    except Exception:
        return os.environ.get("MEMRA_COMMIT", "unknown")


def write_json(path: str, res: dict, label: str = "JSON written to") -> None:
    """Write a bench result as indented JSON at ``path`` (parent folders created) and say so:
    prints ``{label} {path}``."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(res, indent=1) + "\n")
    print(f"{label} {path}")


# ---------------------------------------------------------------------------------------
# the flagship's routed experts: shape, formats, random banks and routing

#: Step-3.5-Flash routed experts: e experts, top_k per token, hidden size d, expert intermediate i
FLAGSHIP = dict(e=288, top_k=8, d=4096, i=1280)
#: expert-bank formats (memra.kernels.moe_decode.ExpertBank) the MoE benches know
FORMATS = ("nvfp4", "fp8", "bf16", "q8_0")


def random_bank(fmt: str, e: int, n: int, k: int, device, gen: torch.Generator, interleave: int = 0,
                name: str = "") -> ExpertBank:
    """A random (never all-zero) :class:`~memra.kernels.moe_decode.ExpertBank` [e, n, k] made
    directly on ``device`` from ``gen`` (a generator on that device).

    nvfp4: random code bytes, UE4M3 scale bytes 0x30..0x3F (0.25..~0.94, no NaN code);
    fp8: E4M3 codes with exponents in a moderate range and random signs, fp32 block scales
    ~0.01; q8_0: int8 -127..127, fp16 scales ~0.01; bf16: N(0, 0.02) (generated per expert to
    bound the temporary). Raises: ValueError for another format."""
    from ..kernels.moe_decode import ExpertBank

    kw = dict(device=device, generator=gen)
    if fmt == "nvfp4":
        data = torch.randint(0, 256, (e, n, k // 2), dtype=torch.uint8, **kw)
        scale = torch.randint(0x30, 0x40, (e, n, k // 16), dtype=torch.uint8, **kw)
    elif fmt == "fp8":
        b = torch.randint(0x20, 0x50, (e, n, k), dtype=torch.uint8, **kw)
        b |= torch.randint(0, 2, (e, n, k), dtype=torch.uint8, **kw) << 7
        data = b.view(torch.float8_e4m3fn)
        scale = torch.rand(e, -(-n // 128), -(-k // 128), dtype=torch.float32, **kw) * 0.01 + 0.005
    elif fmt == "q8_0":
        data = torch.randint(-127, 128, (e, n, k), dtype=torch.int8, **kw)
        scale = (torch.rand(e, n, k // 32, **kw) * 0.01 + 0.002).to(torch.float16)
    elif fmt == "bf16":
        data = torch.empty(e, n, k, dtype=torch.bfloat16, device=device)
        for j in range(e):
            data[j] = torch.randn(n, k, dtype=torch.bfloat16, **kw) * 0.02
        scale = None
    else:
        raise ValueError(f"random_bank: unknown format {fmt!r}")
    return ExpertBank(fmt, e, n, k, data, scale, name, interleave)


def random_moe(fmt: str, device, seed: int = 0, e: int = 288, d: int = 4096, i: int = 1280):
    """(gate_up [e, 2i, d] interleaved, down [e, d, i], generator) random banks
    (:func:`random_bank`) at the given shape, from a generator on ``device`` seeded with ``seed``
    (returned, to draw the inputs from next)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    unit = 128 if fmt == "fp8" else 16
    gu = random_bank(fmt, e, 2 * i, d, device, gen, unit, "gate_up")
    dn = random_bank(fmt, e, d, i, device, gen, 0, "down")
    return gu, dn, gen


def expected_distinct(t: int, e: int, k: int) -> float:
    """Expected number of distinct experts among ``t`` tokens that each choose ``k`` distinct of
    ``e`` experts uniformly at random: ``e * (1 - (1 - k / e) ** t)`` (each expert is missed by a
    token with probability 1 - k/e, independently across tokens)."""
    return e * (1.0 - (1.0 - k / e) ** t)


def random_routing(t: int, e: int, top_k: int, device, gen: torch.Generator):
    """Uniform random routing on ``device``: (index int64 [t, top_k], distinct experts of
    0..e-1 per row; weight fp32 [t, top_k], > 0, rows summing to 2.5)."""
    index = torch.rand(t, e, device=device, generator=gen).argsort(dim=1)[:, :top_k].contiguous()
    weight = torch.rand(t, top_k, device=device, generator=gen) + 0.05
    return index, weight / weight.sum(dim=1, keepdim=True) * 2.5


# ---------------------------------------------------------------------------------------
# production-shaped routing (CPU, deterministic; the fit: memra.bench.moe_grouped's docstring)

# fitted by fit_skew() (memra.bench.moe_grouped's docstring): mean over seeds 0..7 at T = 4096,
# E = 288, k = 8: 284.0 active experts, hottest expert 934.0 rows (seed 0 alone: 284 and 918)
SKEW_SPAN = 6.4025
SKEW_GAMMA = 0.8054
SKEW_TARGET = dict(t=4096, active=284, max_rows=934)  # the original's [moe-sk-form] receipt


def _check_routing_args(fn: str, t: int, num_experts: int, top_k: int) -> None:
    for name, v in (("t", t), ("num_experts", num_experts), ("top_k", top_k)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{fn}: {name} = {v!r} must be an integer >= 1")
    if top_k > num_experts:
        raise ValueError(f"{fn}: top_k = {top_k} > num_experts = {num_experts} (a token's experts are distinct)")


def _draws(t: int, num_experts: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(rank -> expert permutation int64 [E], Gumbel noise fp64 [t, E]) from a CPU generator
    seeded with ``seed``: the only randomness of :func:`skewed_routing` / :func:`uniform_routing`."""
    gen = torch.Generator(device="cpu").manual_seed(int(seed))
    perm = torch.randperm(num_experts, generator=gen)
    u = torch.rand(t, num_experts, generator=gen, dtype=torch.float64).clamp_(min=1e-300)
    return perm, -torch.log(-torch.log(u))


def _skew_logits(num_experts: int, span: float, gamma: float) -> torch.Tensor:
    if num_experts == 1:
        return torch.zeros(1, dtype=torch.float64)
    r = torch.arange(num_experts, dtype=torch.float64) / (num_experts - 1)
    return -span * r.pow(gamma)


def skewed_routing(t: int, num_experts: int = 288, top_k: int = 8, seed: int = 0, span: float = SKEW_SPAN,
                   gamma: float = SKEW_GAMMA) -> torch.Tensor:
    """Deterministic production-shaped routing (memra.bench.moe_grouped's docstring): index int64
    [t, top_k] on the CPU, each row ``top_k`` distinct experts in 0..num_experts-1 drawn without
    replacement with probabilities proportional to ``exp(-span * (rank / (E - 1)) ** gamma)``
    (rank 0 the hottest; ranks mapped to expert ids by a seeded permutation). A pure function of
    its arguments. At the defaults and T = 4096: ~284 active experts, hottest ~934 rows.

    Raises: ValueError for t, num_experts, top_k < 1, top_k > num_experts, span < 0 or gamma <= 0.
    """
    _check_routing_args("skewed_routing", t, num_experts, top_k)
    if not (span >= 0 and math.isfinite(span)) or not (gamma > 0 and math.isfinite(gamma)):
        raise ValueError(f"skewed_routing: span = {span} must be >= 0 and gamma = {gamma} > 0")
    perm, gum = _draws(t, num_experts, seed)
    ranks = (_skew_logits(num_experts, span, gamma) + gum).topk(top_k, dim=1).indices
    return perm[ranks].contiguous()


def uniform_routing(t: int, num_experts: int = 288, top_k: int = 8, seed: int = 0) -> torch.Tensor:
    """index int64 [t, top_k] on the CPU: each row ``top_k`` distinct experts, uniformly at random
    (the sampler of :func:`skewed_routing` with equal popularities). Raises: ValueError as it."""
    return skewed_routing(t, num_experts, top_k, seed, span=0.0, gamma=1.0)


def routing_weights(t: int, top_k: int = 8, seed: int = 0) -> torch.Tensor:
    """fp32 [t, top_k] positive routing weights on the CPU (rows summing to 2.5, as
    :func:`random_routing`), from a generator seeded with ``seed + 1``."""
    gen = torch.Generator(device="cpu").manual_seed(int(seed) + 1)
    w = torch.rand(t, top_k, generator=gen) + 0.05
    return w / w.sum(dim=1, keepdim=True) * 2.5


def padded_rows(counts, block_m: int) -> int:
    """Rows the grouped GEMM processes: each expert's row count rounded up to a multiple of
    ``block_m`` (empty experts cost nothing). ``counts``: per-expert row counts (any iterable
    of ints or an integer tensor). Raises: ValueError for block_m < 1 or a negative count."""
    if block_m < 1:
        raise ValueError(f"padded_rows: block_m = {block_m} must be >= 1")
    c = [int(v) for v in (counts.tolist() if isinstance(counts, torch.Tensor) else counts)]
    if any(v < 0 for v in c):
        raise ValueError("padded_rows: negative row count")
    return sum(-(-v // block_m) * block_m for v in c)


def routing_stats(index: torch.Tensor, num_experts: int, block_m: int = 64) -> dict:
    """Load statistics of a routing index [T, k]: tokens, pairs, active experts, zero_experts,
    max_rows and mean_rows (per ACTIVE expert), padded_rows at ``block_m`` and
    ``padding_ratio`` = padded_rows / pairs, ``pad128`` (the same at 128-row tiles, the
    original's), ``top_rows`` (the 8 largest row counts) and ``distinct_rows`` (whether every
    token's experts are distinct). Raises: ValueError for an index not [T, k] or with values
    >= num_experts."""
    if index.dim() != 2:
        raise ValueError(f"routing_stats: index must be [T, k], got {tuple(index.shape)}")
    idx = index.detach().to("cpu", torch.int64)
    counts = torch.bincount(idx.reshape(-1), minlength=num_experts)
    if counts.numel() != num_experts:
        raise ValueError(f"routing_stats: index has values >= num_experts = {num_experts}")
    act = counts[counts > 0]
    pairs = idx.numel()
    pad = padded_rows(act, block_m)
    srt = idx.sort(dim=1).values
    distinct = bool((srt[:, 1:] != srt[:, :-1]).all()) if idx.shape[1] > 1 else True
    return dict(tokens=idx.shape[0], pairs=pairs, active=int(act.numel()), zero_experts=num_experts - int(act.numel()),
                max_rows=int(act.max()) if act.numel() else 0,
                mean_rows=float(act.float().mean()) if act.numel() else 0.0,
                block_m=block_m, padded_rows=pad, padding_ratio=pad / pairs if pairs else float("nan"),
                pad128=padded_rows(act, 128) / pairs if pairs else float("nan"),
                top_rows=sorted(act.tolist(), reverse=True)[:8], distinct_rows=distinct)


def fit_skew(t: int = 4096, num_experts: int = 288, top_k: int = 8, target_active: float = 284,
             target_max: float = 934, seeds=range(8), gamma_range=(0.5, 1.5), span_range=(2.0, 14.0),
             iters: tuple[int, int] = (14, 18)) -> dict:
    """Refits (SPAN, GAMMA) of :func:`skewed_routing` on the CPU, deterministically: with the
    random draws of ``seeds`` fixed (common random numbers), bisection on GAMMA (outer,
    ``iters[0]`` steps: a flatter head lowers the hottest expert) of the mean hottest-expert rows,
    where for each GAMMA a bisection on SPAN (inner, ``iters[1]`` steps: a larger span leaves
    more experts without rows) puts the mean active count at ``target_active``. ~1 minute at the
    defaults (which gave SKEW_SPAN, SKEW_GAMMA). Returns dict(span, gamma, active, max_rows) with
    the means achieved."""
    draws = [_draws(t, num_experts, s)[1] for s in seeds]

    def stats(span: float, gamma: float) -> tuple[float, float]:
        lw = _skew_logits(num_experts, span, gamma)
        a = m = 0.0
        for g in draws:
            c = torch.bincount((lw + g).topk(top_k, dim=1).indices.reshape(-1), minlength=num_experts)
            a += int((c > 0).sum())
            m += int(c.max())
        return a / len(draws), m / len(draws)

    def span_for(gamma: float) -> float:
        lo, hi = span_range
        for _ in range(iters[1]):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if stats(mid, gamma)[0] > target_active else (lo, mid)
        return (lo + hi) / 2

    glo, ghi = gamma_range
    for _ in range(iters[0]):
        g = (glo + ghi) / 2
        glo, ghi = (g, ghi) if stats(span_for(g), g)[1] > target_max else (glo, g)
    gamma = (glo + ghi) / 2
    span = span_for(gamma)
    a, m = stats(span, gamma)
    return dict(span=span, gamma=gamma, active=a, max_rows=m, t=t, seeds=list(seeds))


# ---------------------------------------------------------------------------------------
# MoE accounting and checks (pure)


def expert_nbytes(fmt: str, n: int, k: int) -> int:
    """Bytes of one expert's [n, k] weight as the kernels read it (codes + scales), as
    ExpertBank.expert_nbytes of :func:`random_bank`: bf16 2 n k; fp8 n k + 4 per 128x128
    block; nvfp4 n k / 2 + one UE4M3 byte per 16; q8_0 n k + 2 per 32.
    Raises: ValueError for a format not in :data:`FORMATS`."""
    if fmt == "bf16":
        return 2 * n * k
    if fmt == "fp8":
        return n * k + 4 * -(-n // 128) * -(-k // 128)
    if fmt == "nvfp4":
        return n * k // 2 + n * k // 16
    if fmt == "q8_0":
        return n * k + 2 * (n * k // 32)
    raise ValueError(f"expert_nbytes: unknown format {fmt!r}; expected one of {FORMATS}")


def projection_costs(fmt: str, t: int, pairs: int, active: int, d: int, i: int, fp8_act: bool) -> dict:
    """FLOPs and byte floors of the two grouped GEMMs of one MoE layer: ``t`` tokens, ``pairs``
    (token, expert) pairs, ``active`` experts with at least one row, hidden ``d``, expert
    intermediate ``i`` (memra.bench.moe_grouped's docstring).

    Returns {"gate_up": {flops, weight_bytes, act_bytes, bytes}, "down": {...}} with
    gate_up flops = 2 * pairs * 2i * d, down flops = 2 * pairs * d * i; weight bytes = active x
    :func:`expert_nbytes`; activation bytes: gate_up x [t, d] bf16 read + act [pairs, i]
    written, down act read + y [t, d] bf16 written; act in bf16, or for the fp8 recipe
    (``fp8_act`` with an fp8 bank) E4M3 codes + fp32 scales per 1x128 group.
    Raises: ValueError for an unknown format or sizes < 1 (active < 0).
    """
    if fmt not in FORMATS:
        raise ValueError(f"projection_costs: unknown format {fmt!r}; expected one of {FORMATS}")
    if min(t, pairs, d, i) < 1 or active < 0:
        raise ValueError(f"projection_costs: bad sizes t={t} pairs={pairs} active={active} d={d} i={i}")
    f8 = fp8_act and fmt == "fp8"
    act = pairs * i * (1 if f8 else 2) + (pairs * -(-i // 128) * 4 if f8 else 0)
    gu_w = active * expert_nbytes(fmt, 2 * i, d)
    dn_w = active * expert_nbytes(fmt, d, i)
    gu_a = t * d * 2 + act
    dn_a = act + t * d * 2
    return dict(gate_up=dict(flops=2.0 * pairs * 2 * i * d, weight_bytes=gu_w, act_bytes=gu_a, bytes=gu_w + gu_a),
                down=dict(flops=2.0 * pairs * d * i, weight_bytes=dn_w, act_bytes=dn_a, bytes=dn_w + dn_a))


CHECK_TOL = 1e-2  # max-abs relative error of the grouped MoE GEMM vs its reference (bf16 activations and output)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|, both in fp32 (the denominator floored at 1e-30): the relative
    error the MoE benches compare with :data:`CHECK_TOL`; ``b`` is the reference."""
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))


# ---------------------------------------------------------------------------------------
# model phases (decode and prefill benches)


def phase_fns(model, ids, pos, kv) -> tuple[dict, object, list[int]]:
    """One real unfused forward of ``ids`` at ``pos`` through ``kv`` (the inputs of every phase),
    then per phase a closure that runs that phase's modules over all layers on those inputs:
    {"attention", "router", "routed_experts", "shared_experts", "dense_mlp"}. Returns (closures,
    the last hidden states [T, D], distinct experts routed per MoE layer). Shared by
    ``memra bench decode`` and ``memra bench prefill``."""
    from ..layers.moe import MoE

    layers = model.layers
    with torch.inference_mode():
        x = model.embed(ids)
        ins_attn, ins_mlp, routes = [], [], []
        for layer, tab in zip(layers, model.rope_tables(pos, x.dtype)):
            ins_attn.append((x, tab))
            x = x + layer.attn(layer.attn_norm(x), *tab, kv)
            h = layer.ffn_norm(x)
            ins_mlp.append(h)
            routes.append(layer.mlp.route(h) if isinstance(layer.mlp, MoE) else None)
            x = x + layer.mlp(h)
    distinct = [int(r[0].unique().numel()) for r in routes if r is not None]

    def attention():
        for layer, (xi, (cos, sin)) in zip(layers, ins_attn):
            layer.attn(layer.attn_norm(xi), cos, sin, kv)

    def router():
        for layer, h in zip(layers, ins_mlp):
            if isinstance(layer.mlp, MoE):
                layer.mlp.route(h)

    def routed():
        for layer, h, r in zip(layers, ins_mlp, routes):
            if r is not None:
                layer.mlp.experts(h, *r)

    def shared():
        for layer, h in zip(layers, ins_mlp):
            if isinstance(layer.mlp, MoE) and layer.mlp.shared is not None:
                layer.mlp.shared(h)

    def dense():
        for layer, h in zip(layers, ins_mlp):
            if not isinstance(layer.mlp, MoE):
                layer.mlp(h)

    return (dict(attention=attention, router=router, routed_experts=routed, shared_experts=shared, dense_mlp=dense),
            x, distinct)
