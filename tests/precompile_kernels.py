"""A small Triton kernel and its sm_90 specialization for tests/test_precompile.py, in its own
module so that the test module does not import Triton at collection (whoever imports Triton first
fixes its mode for the session: other test modules set ``TRITON_INTERPRET=1`` before they do)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _axpb_kernel(x_ptr, y_ptr, n, a, BLOCK: tl.constexpr, SQUARE: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    v = tl.load(x_ptr + i, mask=m)
    if SQUARE:
        v = v * v
    tl.store(y_ptr + i, v * a + 1.0, mask=m)


WHERE = f"{__name__}:_axpb_kernel"


def launch(x, y, square: bool, block: int = 128) -> None:
    """``y = (x or x*x) * 3 + 1`` on the GPU."""
    n = x.numel()
    _axpb_kernel[(triton.cdiv(n, block),)](x, y, n, 3.0, BLOCK=block, SQUARE=square)


def spec(square: bool, block: int = 128):
    """A specialization of ``_axpb_kernel`` for an sm_90 target in the jit hook's JSON, as the
    record pass sees it on an H100 / H200 (16-aligned pointers): (target, JSON, source, options)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler.compiler import make_backend
    from triton.runtime.jit import serialize_specialization_data

    target = GPUTarget("cuda", 90, 32)
    options = make_backend(target).parse_options({"num_warps": 4})
    signature = {"x_ptr": "*fp32", "y_ptr": "*fp32", "n": "i32", "a": "fp32", "BLOCK": "constexpr",
                 "SQUARE": "constexpr"}
    constants = {(4,): block, (5,): square}
    attrs = {(0,): [["tt.divisibility", 16]], (1,): [["tt.divisibility", 16]]}
    data = serialize_specialization_data("_axpb_kernel", signature, constants, attrs, options, "test")
    src = ASTSource(_axpb_kernel, signature, constants, attrs)  # raw values, as the jit binder passes them
    return target, data, src, options.__dict__


def task(square: bool) -> dict:
    """A compile task for memra's precompile workers."""
    target, data, _, _ = spec(square)
    return dict(where=WHERE, spec=data, target=[target.backend, target.arch, target.warp_size])


def compile_here(square: bool) -> list[bool]:
    """Compile ``spec(square)`` in this process; the compile listener's cache-hit flags."""
    from triton import knobs

    hits = []
    knobs.compilation.listener = lambda **kw: hits.append(kw["cache_hit"])
    target, _, src, options = spec(square)
    kernel = triton.compile(src, target=target, options=options)
    assert kernel.metadata.target.arch == 90
    return hits


def on_disk(square: bool) -> bool:
    """memra's own check: would ``triton.compile`` find ``spec(square)`` in the disk cache?"""
    from memra.kernels.precompile import _on_disk

    target, data, _, _ = spec(square)
    return _on_disk(_axpb_kernel, data, [target.backend, target.arch, target.warp_size])


def moe_keys(first: str, settle: bool) -> dict[str, str]:
    """The Triton cache keys of the MoE decode kernels in a process that hashed ``first`` before
    the others (as an engine launching it first does), then (``settle``) ran memra's
    :func:`~memra.kernels.precompile.settle_cache_keys`."""
    import memra.kernels._moe_triton as m
    from memra.kernels.precompile import settle_cache_keys

    names = ("_moe_gate_up_kernel", "_moe_down_kernel")
    _ = getattr(m, first).cache_key  # hashed first (Triton keeps the key)
    if settle:
        settle_cache_keys()
    return {n: getattr(m, n).cache_key for n in names}


def precompile_moe_decode_on_the_cpu(cache_dir: str, workers: int) -> dict:
    """memra's whole precompile (record, compile in ``workers`` processes, load) of the MoE decode
    kernels (two formats, 1-3 tokens, with and without the SwiGLU limit), on a machine without a
    GPU: a fake sm_90 driver (tests/fake_cuda_driver.py) and CPU tensors. Run it in a fresh
    process. Returns the report's fields and what a second call (a warm start) reported."""
    import dataclasses

    _fake_gpu(cache_dir)
    import memra.kernels._moe_triton as m
    from memra.kernels.precompile import precompile

    calls = _moe_calls()
    _ = m._moe_down_kernel.cache_key  # this process hashes down first; the workers in task order
    cold = dataclasses.asdict(precompile(calls, "cuda", workers=workers))
    from memra.kernels.precompile import _take_compiled

    _take_compiled()  # as a new process would be: nothing compiled in memory, all on disk
    warm = dataclasses.asdict(precompile(calls, "cuda", workers=workers))
    return {"cold": cold, "warm": warm}


def _fake_gpu(cache_dir: str) -> None:
    import os

    os.environ["TRITON_CACHE_DIR"] = cache_dir
    os.environ["MEMRA_PRECOMPILE"] = "1"
    import fake_cuda_driver

    fake_cuda_driver.install()


def _moe_calls() -> list:
    """MoE decode calls (two formats, 1-3 tokens, with and without the SwiGLU limit) on CPU tensors."""
    import torch
    from moe_banks import banks

    from memra.kernels.moe_decode import moe_decode

    g = torch.Generator().manual_seed(0)
    calls = []
    for fmt in ("nvfp4", "bf16"):
        gu, dn, _ = banks(fmt, 64, 128, 0, 8)
        for t in (1, 2, 3):
            x = torch.randn(t, 128, generator=g).to(torch.bfloat16)
            idx = torch.stack([torch.randperm(8, generator=g)[:3] for _ in range(t)])
            w = torch.rand(t, 3, generator=g)
            for lim in (None, 7.0):
                calls.append(lambda x=x, idx=idx, w=w, gu=gu, dn=dn, lim=lim: moe_decode(x, idx, w, gu, dn, lim))
    return calls


def precompile_with_a_manifest_on_the_cpu(cache_dir: str) -> dict:
    """precompile's manifest on a machine without a GPU (fake sm_90 driver, run in a fresh process):
    the reports of (1) a first call with key "k" (records, compiles, writes the manifest); (2) a
    call with "k" whose work raises if it runs at all (the manifest is used: no record pass);
    (3) the same with another key (no manifest: the record pass runs and meets the error); (4) a
    call with "k" after one of the manifest's kernels was deleted from the disk cache (the
    manifest is ignored: the real calls are recorded and the missing kernel compiled); and
    ``after_load`` / ``in_memory`` / ``late``: a manifest written while every kernel was compiled in
    this process already names them all, a call using it while they are in memory loads none, and
    one after they were taken out of memory loads all. Calls start with nothing compiled in memory,
    as a new process would, except where said."""
    import dataclasses
    import glob
    import os
    import shutil

    _fake_gpu(cache_dir)
    from memra.kernels.precompile import _take_compiled, precompile

    calls = _moe_calls()
    ran = []

    def must_not_run():
        ran.append(1)
        raise RuntimeError("the record pass ran")

    out = {"first": dataclasses.asdict(precompile(calls, "cuda", workers=1, manifest="k"))}
    _take_compiled()
    out["named"] = dataclasses.asdict(precompile([must_not_run], "cuda", workers=1, manifest="k"))
    out["ran_after_named"] = len(ran)
    _take_compiled()
    out["other_key"] = dataclasses.asdict(precompile([must_not_run], "cuda", workers=1, manifest="other"))
    out["ran_after_other_key"] = len(ran)
    # a manifest written by a call after the kernels were compiled in this process names them too
    _take_compiled()
    precompile(calls, "cuda", workers=1)  # (loads them all into memory)
    out["after_load"] = dataclasses.asdict(precompile(calls, "cuda", workers=1, manifest="late"))
    out["in_memory"] = dataclasses.asdict(precompile([must_not_run], "cuda", workers=1, manifest="late"))
    _take_compiled()
    out["late"] = dataclasses.asdict(precompile([must_not_run], "cuda", workers=1, manifest="late"))
    out["ran_after_late"] = len(ran)
    gone = sorted(glob.glob(os.path.join(cache_dir, "*", "_moe_down_kernel.json")))[0]
    shutil.rmtree(os.path.dirname(gone))
    _take_compiled()
    out["stale"] = dataclasses.asdict(precompile(calls, "cuda", workers=1, manifest="k"))
    return out


CHAIN = """
import triton
import triton.language as tl

SCALE = tl.constexpr(3)


@triton.jit
def a_kernel(x_ptr):
    tl.store(x_ptr, b_fn(tl.load(x_ptr)))


@triton.jit
def b_fn(v):
    return c_fn(v) + 1


@triton.jit
def c_fn(v):
    return v * SCALE
"""


def chain_keys(directory: str, order: list[str], settle: bool) -> dict:
    """Keys of a three-deep call chain ``a_kernel -> b_fn -> c_fn`` (only ``c_fn`` reads a global
    constexpr; the module :data:`CHAIN`, written to ``directory/chain_mod.py`` by the test) after
    hashing the functions in ``order``, then (``settle``) settle_cache_keys on that module; and
    the number of passes it took."""
    import sys

    sys.path.insert(0, directory)
    import chain_mod

    from memra.kernels.precompile import settle_cache_keys

    for name in order:
        _ = getattr(chain_mod, name).cache_key
    passes = settle_cache_keys(["chain_mod"]) if settle else 0
    return {"passes": passes, **{n: getattr(chain_mod, n).cache_key for n in ("a_kernel", "b_fn", "c_fn")}}
