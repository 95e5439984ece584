"""Speculative decoding: proposers, and where the engine asks them.

Each step, a decoding request may carry up to K draft tokens (``Request.spec_tokens``) from the
engine's proposer. The scheduler then gives it 1 + K query tokens (its last token and the
drafts; the token budget counts them), the model scores them in the step's ordinary mixed
batch, and the engine verifies them in order with :meth:`memra.engine.sampling.Sampler.speculate`
(greedy: the longest prefix equal to the target's argmax, plus the bonus token; temperature > 0:
speculative sampling, lossless): accepted drafts and the final token become output, the
rejected drafts' KV slots are rolled back (``num_computed_tokens`` set past the last accepted
one, blocks past the sequence end released), and nothing unverified reaches the prefix cache.

Proposers (:class:`Proposer`): ``ngram`` here, prompt lookup as vLLM's ``ngram`` method: the
longest suffix of the sequence (``max_n`` down to ``min_n`` tokens) that occurred earlier, and
the tokens that followed its latest earlier occurrence. Deterministic: its q is one-hot.
"""

from __future__ import annotations

from typing import Protocol

__all__ = ["NgramProposer", "Proposer", "SPECULATIVE_METHODS", "make_proposer"]


class Proposer(Protocol):
    """Drafts tokens for one sequence."""

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens likely to follow ``tokens`` (prompt + output so far); may be empty."""
        ...


class NgramProposer:
    """Prompt lookup (module docstring). Args: min_n, max_n: suffix lengths tried, longest first.

    Raises: ValueError unless 1 <= min_n <= max_n."""

    def __init__(self, min_n: int = 1, max_n: int = 4):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"ngram proposer: need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n

    def propose(self, tokens: list[int], k: int) -> list[int]:
        L = len(tokens)
        for n in range(min(self.max_n, L - 1), self.min_n - 1, -1):
            pattern = tokens[L - n:]
            for i in range(L - n - 1, -1, -1):  # latest earlier occurrence first
                if tokens[i:i + n] == pattern:
                    return tokens[i + n:i + n + k]
        return []


SPECULATIVE_METHODS = ("ngram",)


def make_proposer(method: str) -> Proposer:
    """The proposer of ``method``. Raises ValueError for an unknown one."""
    if method == "ngram":
        return NgramProposer()
    raise ValueError(f"unknown speculative method {method!r} (supported: {', '.join(SPECULATIVE_METHODS)})")
