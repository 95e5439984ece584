"""Where an engine start's time goes, function by function (issue 14: "load <= 2x llama.cpp's").

`memra bench file` times the start-up phases (imports, weights, KV-cache profile, CUDA graphs);
this says what inside them takes the time. Each start runs in a fresh process: the imports timed
one by one (torch, its CUDA initialisation, Triton, memra's engine), then ``LLM(path)`` under
cProfile. With ``--starts 2`` the second start reuses the first's Triton cache (a warm start);
each start's table is printed and everything goes to ``--json-out``:
``starts[i] = {imports_s: {...}, ready_s, startup_s (the engine's phases), top_cumulative,
top_self: [[function, calls, seconds], ...]}``.

Usage (GPU machine): python benchmarks/startup_profile.py FILE.gguf --starts 2 --json-out $OUT/startup.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time


def _child(path: str, max_model_len: int, top: int, device: str) -> dict:
    t0 = time.perf_counter()
    imports = {}

    def timed(name, fn):
        t = time.perf_counter()
        fn()
        imports[name] = time.perf_counter() - t

    timed("torch", lambda: __import__("torch"))
    import torch

    timed("torch.cuda init", lambda: torch.cuda.init() if torch.cuda.is_available() else None)
    timed("triton", lambda: __import__("triton"))
    timed("memra.engine", lambda: __import__("memra.engine.engine"))
    import cProfile
    import pstats

    from memra import LLM

    prof = cProfile.Profile()
    t = time.perf_counter()
    prof.enable()
    llm = LLM(path, max_model_len=max_model_len, device=device)
    prof.disable()
    init_s = time.perf_counter() - t
    st = pstats.Stats(prof)

    def rows(key: str) -> list:
        st.sort_stats(key)
        out = []
        for func in st.fcn_list[:top]:  # (file, line, name) in sorted order
            cc, nc, tt, ct, _ = st.stats[func]
            out.append([f"{os.path.relpath(func[0]) if func[0].startswith('/') else func[0]}:{func[1]}({func[2]})",
                        nc, round(ct if key == "cumulative" else tt, 4)])
        return out

    return {"imports_s": imports, "engine_s": init_s, "ready_s": time.perf_counter() - t0,
            "startup_s": llm.engine.startup_seconds, "memory": llm.engine.memory_report,
            "top_cumulative": rows("cumulative"), "top_self": rows("tottime")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("path")
    p.add_argument("--starts", type=int, default=2, help="starts in fresh processes; the first with an empty Triton cache")
    p.add_argument("--max-model-len", type=int, default=4096 + 128)
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--json-out", default=None)
    p.add_argument("--device", default=None,
                   help="the engine's device (default: cuda when a GPU is visible, else cpu; LLM's own default is the CPU)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        print(json.dumps(_child(a.path, a.max_model_len, a.top, a.device)), flush=True)
        return
    if not os.path.isfile(a.path):
        raise SystemExit(f"startup_profile: {a.path} is not a file")
    if a.device is None:
        import torch

        a.device = "cuda" if torch.cuda.is_available() else "cpu"
    starts = []
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, TRITON_CACHE_DIR=cache)
        for i in range(a.starts):
            r = subprocess.run([sys.executable, __file__, a.path, "--child", "--max-model-len", str(a.max_model_len),
                                "--top", str(a.top), "--device", a.device], capture_output=True, text=True, env=env)
            if r.returncode != 0:
                raise SystemExit(f"startup_profile: start {i} failed ({r.returncode}):\n{r.stderr[-3000:]}")
            s = json.loads(r.stdout.strip().splitlines()[-1])
            starts.append(s)
            print(f"start {i} ({'cold' if i == 0 else 'warm'} Triton cache): ready {s['ready_s']:.1f} s; imports "
                  + ", ".join(f"{k} {v:.2f}" for k, v in s["imports_s"].items())
                  + "; phases " + ", ".join(f"{k} {v:.2f}" for k, v in s["startup_s"].items()))
            print("  cumulative s   calls  function")
            for name, n, sec in s["top_cumulative"][:25]:
                print(f"  {sec:12.3f} {n:7d}  {name[-110:]}")
            print("  self s         calls  function")
            for name, n, sec in s["top_self"][:15]:
                print(f"  {sec:12.3f} {n:7d}  {name[-110:]}")
    if a.json_out:
        with open(a.json_out, "w") as f:
            json.dump({"bench": "startup_profile", "path": a.path, "starts": starts}, f, indent=1)
        print(f"JSON written to {a.json_out}")


if __name__ == "__main__":
    main()
