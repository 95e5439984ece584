"""Triton kernels compiled for sm_90 (Hopper) on any machine, no GPU needed: Triton's bundled
ptxas, ``cuobjdump`` and ``nvdisasm``. For screening kernels before spending GPU time (registers,
spills, whether Triton pipelined a loop, instructions per loop step); says nothing about speed.

Uses Triton internals (``ASTSource``, ``GPUTarget``, the tools under
``triton/backends/nvidia/bin``) as of Triton 3.6. Needs the kernels imported without
``TRITON_INTERPRET`` (the interpreter replaces the JIT functions).
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile


def compile_sm90(fn, ptrs: dict[str, str], ints: dict[str, int], const: dict, floats=(), **options):
    """Compiles the ``@triton.jit`` function ``fn`` for sm_90 with the specializations a real
    launch gets: every pointer 16-byte aligned, every int divisible by 16 marked so.

    Args:
        ptrs: argument name -> Triton pointer type (``"*bf16"``, ``"*u8"``, ...).
        ints: argument name -> its value (only its divisibility by 16 is used).
        const: constexpr name -> value; constexprs left out take their defaults.
        floats: names of fp32 scalar arguments.
        options: Triton compile options (``num_warps``, ``num_stages``, ...).

    Returns: the compiled kernel (``.asm["cubin"]``, ``.asm["ptx"]``, ``.metadata``).

    Raises: ValueError if ``fn`` is not a JIT function (interpreter) or an argument is none of
    the above and has no default; Triton's exception if the compile fails.
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if not hasattr(fn, "arg_names"):
        raise ValueError("compile_sm90: not a JIT function (imported under TRITON_INTERPRET=1?)")
    sig, attrs, const = {}, {}, dict(const)
    for idx, arg in enumerate(fn.arg_names):
        if arg in ptrs:
            sig[arg] = ptrs[arg]
            attrs[(idx,)] = [["tt.divisibility", 16]]
        elif arg in ints:
            sig[arg] = "i32"
            if ints[arg] % 16 == 0:
                attrs[(idx,)] = [["tt.divisibility", 16]]
        elif arg in floats:
            sig[arg] = "fp32"
        elif arg in const or fn.params[idx].is_constexpr and fn.params[idx].has_default:
            sig[arg] = "constexpr"
            const.setdefault(arg, fn.params[idx].default)
        else:
            raise ValueError(f"compile_sm90: argument {arg!r} of {fn.__name__} is not in ptrs, ints, floats or const")
    return triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32), options=options)


def _tool(kernel, *cmd: str) -> str:
    import triton

    bindir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(kernel.asm["cubin"])
    try:
        return subprocess.run([os.path.join(bindir, cmd[0]), *cmd[1:], f.name], capture_output=True, text=True,
                              check=True).stdout
    finally:
        os.unlink(f.name)


def resources(kernel) -> tuple[int, int]:
    """(registers per thread, bytes of local memory per thread: > 0 means spills) of a
    :func:`compile_sm90` kernel, from ``cuobjdump --dump-resource-usage``; (-1, -1) if its output
    names neither.

    Raises: subprocess.CalledProcessError if cuobjdump fails."""
    m = re.search(r"REG:(\d+) STACK:(\d+)", _tool(kernel, "cuobjdump", "--dump-resource-usage"))
    return (int(m.group(1)), int(m.group(2))) if m else (-1, -1)


def sass(kernel) -> str:
    """The SASS listing (``nvdisasm -c``) of a :func:`compile_sm90` kernel.

    Raises: subprocess.CalledProcessError if nvdisasm fails."""
    return _tool(kernel, "nvdisasm", "-c")


def loops(listing: str) -> list[dict]:
    """Every loop of a SASS listing (a label some later ``BRA`` goes back to: ``@P0 BRA``,
    ``BRA.U !UP0, ...``, ``BRA.DIV ...``), from the label to its last back branch, in the order of
    those branches: ``instructions`` (body size, the branch included), ``innermost`` (holds no
    other loop), ``ops`` (its 12 most frequent opcodes, predicates and modifiers stripped) and
    ``local`` (its LDL + STL: spilled registers read or written inside the loop).
    Branches to a register address (``BRX``, ``JMP``) are not followed."""
    instrs, labels = [], {}
    for line in listing.splitlines():
        m = re.match(r"\s*(\.L_x_\d+):", line)
        if m:
            labels[m.group(1)] = len(instrs)
            continue
        m = re.search(r"/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m:
            instrs.append(m.group(2).strip())
    ends: dict[int, int] = {}  # loop start -> its last back branch (a loop may branch back from several places)
    for i, ins in enumerate(instrs):
        m = re.search(r"\bBRA(?:\.\w+)*\s+(?:[^`(;,]*,\s*)?`?\(?(\.L_x_\d+)", ins)
        if m and m.group(1) in labels and labels[m.group(1)] < i:
            ends[labels[m.group(1)]] = i
    spans = sorted(ends.items(), key=lambda se: se[1])
    out = []
    for lo, hi in spans:
        ops: dict[str, int] = {}
        for b in instrs[lo:hi + 1]:
            op = re.sub(r"^@!?U?P\w+\s+", "", b).split()[0].split(".")[0]
            ops[op] = ops.get(op, 0) + 1
        inner = not any(lo <= a and b <= hi and (a, b) != (lo, hi) for a, b in spans)
        out.append({"instructions": hi + 1 - lo, "innermost": inner,
                    "ops": dict(sorted(ops.items(), key=lambda kv: -kv[1])[:12]),
                    "local": ops.get("LDL", 0) + ops.get("STL", 0)})
    return out


def blocks_per_sm(regs: int, num_warps: int, shared_bytes: int = 0) -> int:
    """Thread blocks of a kernel that fit one sm_90 SM at once (0: none), from the limits of
    compute capability 9.0 (the CUDA C++ Programming Guide's technical specifications per compute
    capability, and its occupancy calculator): 65536 registers, allocated per warp in units of 256; 64 warps; 32 blocks; 228 KiB
    of shared memory, of which each block reserves 1 KiB more than it asks for.

    Args: ``regs`` registers per thread (:func:`resources`), ``num_warps`` per block,
    ``shared_bytes`` the kernel's shared memory (``kernel.metadata.shared``).

    Raises: ValueError if ``regs`` is not in 1..255 or ``num_warps`` not in 1..32."""
    if not 1 <= regs <= 255 or not 1 <= num_warps <= 32:
        raise ValueError(f"blocks_per_sm: registers {regs} (1..255) or warps {num_warps} (1..32) out of range")
    per_warp = -(-regs * 32 // 256) * 256
    by_regs = 65536 // (per_warp * num_warps)
    by_shared = (228 * 1024) // (shared_bytes + 1024)
    return min(by_regs, 64 // num_warps, 32, by_shared)
