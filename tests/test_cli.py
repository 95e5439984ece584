"""The command line, run as a user runs it (a subprocess of ``python -m memra``)."""

from __future__ import annotations

import json
import subprocess
import sys


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
