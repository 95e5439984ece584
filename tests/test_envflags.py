"""memra.kernels.envflags: one strict reading of on/off environment switches."""

import pytest

from memra.kernels.envflags import env_flag


@pytest.mark.parametrize("default", [False, True])
def test_values_and_default(monkeypatch, default):
    monkeypatch.delenv("MEMRA_TEST_FLAG", raising=False)
    assert env_flag("MEMRA_TEST_FLAG", default) is default
    for raw, want in (("", default), ("  ", default), ("1", True), ("TRUE", True), (" on ", True), ("yes", True),
                      ("0", False), ("false", False), ("Off", False), ("no", False)):
        monkeypatch.setenv("MEMRA_TEST_FLAG", raw)
        assert env_flag("MEMRA_TEST_FLAG", default) is want, raw
    for bad in ("2", "enable", "o", "-1"):
        monkeypatch.setenv("MEMRA_TEST_FLAG", bad)
        with pytest.raises(ValueError, match=f"MEMRA_TEST_FLAG='{bad}': expected one of 1, true, on, yes"):
            env_flag("MEMRA_TEST_FLAG", default)


def test_pdl_switch_reads_the_same_way(monkeypatch):
    from memra.kernels.pdl import pdl_enabled, set_pdl

    set_pdl(None)
    monkeypatch.setenv("MEMRA_PDL", "sometimes")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="MEMRA_PDL='sometimes'"):
        pdl_enabled("cuda")
    # "off" must answer before any CUDA query (this machine may have no GPU: it would raise)
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setattr("torch.cuda.current_device", lambda: (_ for _ in ()).throw(AssertionError("queried")))
    monkeypatch.setenv("MEMRA_PDL", "off")
    assert not pdl_enabled("cuda")


def test_triton_interpreted_agrees_with_triton_and_every_caller(monkeypatch, tmp_path):
    """gemv, pdl and precompile ask one helper, which reads TRITON_INTERPRET as Triton does:
    ``true`` (which ``@triton.jit`` takes as on) used to be off for gemv's check."""
    import subprocess
    import sys

    from memra.kernels.envflags import triton_interpreted
    from memra.kernels.gemv import interpret_mode
    from memra.kernels.pdl import pdl_enabled
    from memra.kernels.precompile import precompile_enabled

    monkeypatch.setenv("MEMRA_PRECOMPILE", "1")
    monkeypatch.setenv("MEMRA_PDL", "1")
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)  # never reached while interpreted
    monkeypatch.setattr("torch.cuda.current_device", lambda: (_ for _ in ()).throw(AssertionError("queried")))
    for raw, on in (("1", True), ("true", True), ("ON", True), ("0", False), ("", False)):
        monkeypatch.setenv("TRITON_INTERPRET", raw)
        assert triton_interpreted() is on and interpret_mode() is on, raw
        if on:
            assert not pdl_enabled("cuda") and not precompile_enabled("cuda"), raw
    # and Triton itself, in a fresh process (its knob is read when a kernel is decorated)
    code = ("import triton, triton.language as tl\n@triton.jit\ndef k(x):\n    pass\n"
            "from triton.runtime.interpreter import InterpretedFunction\nprint(isinstance(k, InterpretedFunction))")
    script = tmp_path / "decorated.py"  # (@triton.jit needs its source in a file)
    script.write_text(code)
    for raw, on in (("true", True), ("0", False)):
        r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                           env={**__import__("os").environ, "TRITON_INTERPRET": raw})
        assert r.returncode == 0 and r.stdout.strip() == str(on), (raw, r.stdout, r.stderr)
