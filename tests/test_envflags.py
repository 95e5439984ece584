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
