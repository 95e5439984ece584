"""The command line, run as a user runs it (a subprocess of ``python -m memra``)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch


def memra(*args: str, input: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "memra", *args], capture_output=True, text=True, input=input,
                          timeout=600)


def test_generate_paris():
    r = memra("generate", "--model", "smollm2-135m", "--prompt", "The capital of France is", "--max-tokens", "8",
              "--temperature", "0")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout


def test_generate_stop_string_and_logprobs():
    r = memra("generate", "--prompt", "The capital of France is", "--max-tokens", "8", "--temperature", "0",
              "--stop", "Paris", "--logprobs", "2")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert "Paris" not in lines[0]
    assert len(lines) >= 2 and "\t" in lines[1]  # one row per generated token: token, logprob, alternatives


def test_generate_bad_input_is_a_clear_error():
    r = memra("generate", "--prompt", "x", "--temperature", "-1")
    assert r.returncode == 2 and "temperature" in r.stderr and "Traceback" not in r.stderr
    r = memra("generate", "--model", "no-such-model", "--prompt", "x")
    assert r.returncode == 2 and "no-such-model" in r.stderr and "known keys" in r.stderr


def test_inspect_json():
    r = memra("inspect", "smollm2-135m", "--json")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["arch"] == "llama"
    assert info["parameters"] == 134_515_008
    assert info["types"]["Q4_1"][0] > 0 and info["types"]["Q8_0"][0] == 1
    assert info["config"]["layers"] == 30 and info["config"]["hidden"] == 576


def test_chat_repl():
    r = memra("chat", "--temperature", "0", "--max-tokens", "12", input="What is the capital of France?\n/exit\n")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout


def test_stop_escapes():
    from memra.cli import _unescape

    assert _unescape(r"\n\n") == "\n\n"
    assert _unescape(r"a\tb\\n") == "a\tb\\n"
    assert _unescape("héllo\\") == "héllo\\"


def test_generate_into_closed_pipe_is_quiet():
    p1 = subprocess.Popen([sys.executable, "-m", "memra", "generate", "--prompt", "Count: 1, 2, 3,", "--max-tokens",
                           "40", "--ignore-eos", "--temperature", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p1.stdout.read(3)
    p1.stdout.close()
    err = p1.stderr.read().decode()
    assert p1.wait(timeout=600) == 0
    assert "Traceback" not in err


def test_every_help_page_renders(capsys):
    """--help of every (sub)command prints (argparse formats help strings: a bare % breaks it)."""
    import pytest

    from memra.cli import build_parser

    def walk(p, path):
        yield path
        for a in p._actions:
            if a.__class__.__name__ == "_SubParsersAction":
                for name, sub in a.choices.items():
                    yield from walk(sub, path + [name])

    paths = list(walk(build_parser(), []))
    assert ["bench", "moe-grouped"] in paths and ["serve"] in paths
    for path in paths:
        with pytest.raises(SystemExit) as e:
            build_parser().parse_args(path + ["--help"])
        assert e.value.code == 0, path
        assert "usage: memra" in capsys.readouterr().out


def _corrupt_step_dirs(tmp_path):
    """A valid tiny Step HF dir and three corrupt copies of it."""
    import json
    import shutil
    import struct

    from memra.io.synthetic import write_synthetic

    good = write_synthetic("tiny", "hf-bf16", 0, tmp_path / "good")
    out = {}
    d = tmp_path / "huge-header"
    shutil.copytree(good, d)
    (d / "model.safetensors").write_bytes(struct.pack("<Q", 2**62) + b"{}" + b"\0" * 64)
    out["header length past the file"] = d
    d = tmp_path / "overlap"
    shutil.copytree(good, d)
    header = {"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
              "b": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]}}
    h = json.dumps(header).encode()
    (d / "model.safetensors").write_bytes(struct.pack("<Q", len(h)) + h + b"\0" * 24)
    out["overlapping tensors"] = d
    d = tmp_path / "no-hidden"
    shutil.copytree(good, d)
    cfg = json.loads((d / "config.json").read_text())
    del cfg["hidden_size"]
    (d / "config.json").write_text(json.dumps(cfg))
    out["a missing config key"] = d
    return good, out


def test_inspect_validates_hf_dirs_like_loading(tmp_path, capsys):
    from memra.cli import main

    good, bad = _corrupt_step_dirs(tmp_path)
    assert main(["inspect", str(good)]) == 0
    assert "parameters in the safetensors files" in capsys.readouterr().out
    for what, d in bad.items():
        assert main(["inspect", str(d)]) == 2, what
        err = capsys.readouterr().err
        assert "error:" in err and str(d) in err, (what, err)
        if what == "a missing config key":
            assert "hidden_size" in err


def test_generate_prints_the_finish_reason_and_reads_stdin(tmp_path, capsys, monkeypatch):
    import io

    from memra.cli import main
    from memra.io.synthetic import write_synthetic

    path = write_synthetic("tiny", "gguf-q8_0", 0, tmp_path / "tiny.gguf")
    monkeypatch.setattr("sys.stdin", io.StringIO("hello there"))
    assert main(["generate", "--model", str(path), "--prompt", "-", "--max-tokens", "3", "--temperature", "0",
                 "--ignore-eos"]) == 0
    err = capsys.readouterr().err
    assert "[finished: length, max_tokens=3 reached after 3 tokens]" in err
    # a stop string that the greedy text contains ends it, and is named
    assert main(["generate", "--model", str(path), "--prompt", "hello", "--max-tokens", "8", "--temperature", "0",
                 "--ignore-eos"]) == 0
    text = capsys.readouterr().out.strip()
    assert len(text) >= 2
    assert main(["generate", "--model", str(path), "--prompt", "hello", "--max-tokens", "8", "--temperature", "0",
                 "--ignore-eos", "--stop", text[1]]) == 0
    assert f"[finished: stop, stop string {text[1]!r}" in capsys.readouterr().err


def test_convert_synth_cut_and_bench_file_smoke(tmp_path):
    """`memra convert synth --layers/--dense-layers/--mtp-layers --expert-codes random` writes the cut
    it names; `memra bench file --device cpu` (the bench's own smoke test: the GPU run is the real
    one) loads it in a child process and reports positive times and a TTFT per request."""
    from memra.io.gguf import read_gguf

    out = tmp_path / "cut.gguf"
    r = subprocess.run([sys.executable, "-m", "memra", "convert", "synth", "--geometry", "tiny", "--layers", "4",
                        "--dense-layers", "2", "--mtp-layers", "0", "--format", "gguf-nvfp4", "--expert-codes",
                        "random", "--out", str(out)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    ck = read_gguf(out)
    assert ck.metadata["step35.block_count"] == 4 and ck.metadata["step35.leading_dense_block_count"] == 2
    assert ck.infos["blk.3.ffn_gate_exps.weight"].qtype.name == "NVFP4" and "blk.1.ffn_gate_exps.weight" not in ck
    assert ck.metadata["step35.swiglu_clamp_exp"] == [0.0, 0.0, 1.0, 1.0]  # tiny's clamps stay on its last 2 layers
    for flags, msg in ((["--layers", "2"], "pass --dense-layers N with N <= 2"), (["--mtp-layers", "-1"], ">= 0"),
                       (["--layers", "0", "--dense-layers", "0"], "layers = 0 must be an integer >= 1")):
        bad = subprocess.run([sys.executable, "-m", "memra", "convert", "synth", *flags, "--format", "gguf-q8_0",
                              "--out", str(tmp_path / "bad.gguf")], capture_output=True, text=True)
        assert bad.returncode != 0 and msg in bad.stderr, (flags, bad.stderr)
    bad = subprocess.run([sys.executable, "-m", "memra", "convert", "synth", "--format", "gguf-q8_0", "--expert-codes",
                          "random", "--out", str(tmp_path / "x.gguf")], capture_output=True, text=True)
    assert bad.returncode != 0 and "random" in bad.stderr
    js = tmp_path / "f.json"
    r = subprocess.run([sys.executable, "-m", "memra", "bench", "file", str(out), "--device", "cpu", "--prompt", "16",
                        "--gen", "4", "--json-out", str(js)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    res = json.loads(js.read_text())
    m = res["memra"]
    assert len(m["ttft_s"]) == 3 and all(t > 0 for t in m["ttft_s"]) and m["decode_tok_s"] > 0
    assert 0 < m["weights_s"] < m["ready_s"] and res["ceilings"]["file_bytes"] == out.stat().st_size
    assert "TTFT first / second request" in r.stdout
    assert m["startup_s"]["weights"] > 0 and "start-up phases, warm start: import" in r.stdout
    assert "nan" not in r.stdout and "n/a" in r.stdout  # no copy-bandwidth ceiling on the CPU: said, not nan


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
@pytest.mark.parametrize("args", [["census"], ["decode"], ["prefill", "--no-ttft"], ["moe-grouped"],
                                  ["moe-grouped", "--tune"], ["file", __file__]], ids=lambda a: " ".join(a[:2]))
def test_every_gpu_bench_says_the_same_thing_without_a_gpu(args):
    """One message, status 1, no traceback, from every GPU bench on a machine without a GPU."""
    from memra.bench.common import no_cuda_message

    r = subprocess.run([sys.executable, "-m", "memra", "bench", *args], capture_output=True, text=True, timeout=300)
    command = "moe-grouped --tune" if "--tune" in args else args[0]
    assert r.returncode == 1, (r.returncode, r.stderr[-2000:])
    assert no_cuda_message(command) in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]
