"""On/off switches read from the environment, one rule for all of memra's
(``MEMRA_BATCH_INVARIANT``, ``MEMRA_PDL``, ``MEMRA_PRECOMPILE``): ``1``/``true``/``on``/``yes``
mean on, ``0``/``false``/``off``/``no`` off (any case, surrounding spaces ignored), unset or empty
the switch's default, and anything else is an error rather than a guess.

Also here: whether Triton runs kernels through its CPU interpreter, in Triton's own reading of
``TRITON_INTERPRET`` (one answer for every module that asks)."""

from __future__ import annotations

import os

__all__ = ["env_flag", "triton_interpreted"]

ON = ("1", "true", "on", "yes")
OFF = ("0", "false", "off", "no")


def env_flag(name: str, default: bool) -> bool:
    """The switch ``name`` from the environment (see the module docstring).

    Raises: ValueError: the variable holds another value; the message names it and the choices."""
    raw = os.environ.get(name)
    v = (raw or "").strip().lower()
    if not v:
        return default
    if v in ON:
        return True
    if v in OFF:
        return False
    raise ValueError(f"{name}={raw!r}: expected one of {', '.join(ON)} (on) or {', '.join(OFF)} (off)")


def triton_interpreted() -> bool:
    """True when Triton runs kernels through its CPU interpreter: ``TRITON_INTERPRET`` as Triton
    itself reads it (``triton.knobs.runtime.interpret``: 1/true/on/yes in any case), so memra's
    checks and Triton's ``@triton.jit`` never disagree on a value such as ``true``."""
    import triton.knobs

    return bool(triton.knobs.runtime.interpret)
