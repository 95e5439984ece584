"""Programmatic dependent launch (memra/kernels/pdl.py): the contract every PDL kernel keeps
(wait before touching memory), the switch, and bit-identical decode steps with and without it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from memra.kernels import pdl

KERNELS = Path(__file__).resolve().parent.parent / "memra" / "kernels"


def _jit_functions(path: Path):
    tree = ast.parse(path.read_text())
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and any(
                ast.unparse(d).startswith(("triton.jit", "jit")) for d in node.decorator_list):
            yield node


def test_every_pdl_kernel_waits_before_anything_else():
    """A kernel that takes the PDL constexpr must begin with ``pdl_enter(PDL)``: a load or store
    before griddepcontrol.wait could read a predecessor's output before it is written. And every
    launch that passes ``pdl_args`` names a kernel that takes PDL (else Triton rejects the
    keyword only at run time on a GPU)."""
    with_pdl = set()  # (module, kernel)
    for path in sorted(KERNELS.glob("_*_triton.py")):
        for fn in _jit_functions(path):
            if fn.name == "pdl_enter" or "PDL" not in [a.arg for a in fn.args.args]:
                continue
            with_pdl.add((path.stem, fn.name))
            body = fn.body[1:] if isinstance(fn.body[0], ast.Expr) and isinstance(fn.body[0].value, ast.Constant) \
                else fn.body
            assert ast.unparse(body[0]) == "pdl_enter(PDL)", f"{path.name}:{fn.name} starts with {ast.unparse(body[0])}"
    assert len(with_pdl) >= 15, sorted(with_pdl)
    src = (KERNELS / "_pdl_triton.py").read_text()
    assert src.index("gdc_wait()") < src.index("gdc_launch_dependents()")  # wait, then trigger

    launched = set()  # (module the kernel is imported from, kernel); two modules hold same-named kernels
    for path in sorted(KERNELS.parent.rglob("*.py")):  # launch sites anywhere in memra, not only kernels/
        tree = ast.parse(path.read_text())
        source = {a.asname or a.name: (n.module or "").rsplit(".", 1)[-1] for n in ast.walk(tree)
                  if isinstance(n, ast.ImportFrom) for a in n.names}
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and any(isinstance(k.value, ast.Call) and ast.unparse(k.value.func) == "pdl_args"
                                                  for k in node.keywords if k.arg is None):
                f = node.func
                if isinstance(f, ast.Subscript):  # kernel[grid](...)
                    f = f.value
                name = ast.unparse(f)
                launched.add((source.get(name, "?"), name))
    kernels = {(m, n) for m, n in launched if n.startswith("_") and not n.endswith(")")}  # not factories: _kernel()
    assert all(m != "?" for m, _ in kernels), kernels
    assert kernels <= with_pdl, kernels - with_pdl
    assert len(launched) >= 15, sorted(launched)


def test_switch():
    """pdl_args: off on the CPU and under the interpreter; set_pdl(False) wins over the default."""
    assert pdl.pdl_args("cpu") == {"PDL": False}
    try:
        pdl.set_pdl(False)
        assert not pdl.pdl_enabled("cuda") and pdl.pdl_args("cuda:0") == {"PDL": False}
    finally:
        pdl.set_pdl(None)


@pytest.mark.gpu
def test_decode_step_is_bit_identical_with_and_without_pdl():
    """The tiny Step model's decode step (paged KV, shared-expert overlap, every Triton kernel of
    the step), captured in CUDA graphs at batch 1 and 4 with PDL and without: the logits must be
    equal bit for bit, over two steps with fresh inputs each."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("PDL needs sm_90+")
    from memra.engine.block_manager import kv_groups
    from memra.engine.cuda_graph import CudaGraphRunner
    from memra.engine.kv_cache import PagedKVCache
    from memra.io.synthetic import build_gpu_model

    model = build_gpu_model("tiny", 3, "cuda", "nvfp4")
    groups = kv_groups(model.config)
    bs, per_seq, max_b = 16, 8, 4
    cache = PagedKVCache(groups, [max_b * per_seq + 1] * len(groups), bs, torch.bfloat16, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(7)
    for t in cache.k + cache.v:
        if t is not None:
            t.copy_(torch.randn(t.shape, generator=gen, device="cuda").to(torch.bfloat16))
    tables = [[list(range(r * per_seq, (r + 1) * per_seq))] * len(groups) for r in range(max_b)]
    runners = {}
    try:
        for on in (True, False):
            pdl.set_pdl(on)
            r = CudaGraphRunner(model, cache, max_b, per_seq, scratch_blocks=[max_b * per_seq] * len(groups),
                                buckets=[1, 4])
            r.capture()
            runners[on] = r
    finally:
        pdl.set_pdl(None)
    host = torch.Generator().manual_seed(8)
    for b in (1, 4, 4):
        ids = torch.randint(3, model.config.vocab_size, (b,), generator=host).tolist()
        pos = torch.randint(20, per_seq * bs - 1, (b,), generator=host).tolist()
        got = {on: r.run(ids, pos, tables[:b]).clone() for on, r in runners.items()}
        assert torch.isfinite(got[True]).all()
        assert torch.equal(got[True], got[False]), (b, float((got[True] - got[False]).abs().max()))
