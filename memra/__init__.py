"""memra: a Python inference engine for sparse Mixture-of-Experts language models.

Offline API::

    from memra import LLM, SamplingParams
    llm = LLM("smollm2-135m")
    out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8))
    print(out[0].outputs[0].text)
"""

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "RequestOutput", "__version__"]


def __getattr__(name: str):
    # Imported lazily so that `memra --help` and light submodules do not pay for torch at import.
    if name in ("LLM", "RequestOutput"):
        from .engine import llm

        return getattr(llm, name)
    if name == "SamplingParams":
        from .engine.sampling import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'memra' has no attribute {name!r}")
