"""Runs the model over one scheduled step and returns the logits that are needed.

Builds the step's flat token batch (the scheduled requests' new tokens concatenated,
decodes first), positions and the :class:`~memra.engine.kv_cache.PagedBatch` the
attention layers read and write, runs the model once, and applies the LM head only to
the rows whose logits are used: the last row of each request that reaches the end of
its known tokens (to sample its next token), plus the prompt rows of requests that asked
for prompt logprobs.
"""

from __future__ import annotations

import torch

from .kv_cache import PagedBatch, PagedKVCache, SeqChunk
from .request import Request

__all__ = ["ModelRunner", "StepLogits"]


class StepLogits:
    """Logits of one step, fp32.

    Attributes:
        sample: request -> logits [vocab] to sample its next token from.
        prompt: request -> (first prompt position p, logits [n, vocab]) predicting prompt
            tokens p+1 .. p+n (prompt logprobs).
    """

    def __init__(self):
        self.sample: dict[int, torch.Tensor] = {}
        self.prompt: dict[int, tuple[int, torch.Tensor]] = {}


class ModelRunner:
    """Executes scheduled steps of ``model`` over the paged cache ``cache``."""

    def __init__(self, model, cache: PagedKVCache):
        self.model, self.cache = model, cache
        self.device = cache.k[cache.groups[0].layers[0]].device

    @torch.inference_mode()
    def execute(self, items: list[tuple[Request, int]]) -> StepLogits:
        """Compute ``n`` new tokens of each ``(request, n)``; K/V go into the cache.

        Does not advance ``num_computed_tokens`` (the engine does, after sampling).
        """
        ids, pos, chunks = [], [], []
        for req, n in items:
            s = req.num_computed_tokens
            ids.extend(req.all_token_ids[s:s + n])
            pos.extend(range(s, s + n))
            chunks.append(SeqChunk(s, n, req.block_tables))
        kv = PagedBatch(self.cache, chunks)
        hidden = self.model(torch.tensor(ids, device=self.device), torch.tensor(pos, device=self.device), kv)
        rows, owners = [], []
        off = 0
        for req, n in items:
            s = req.num_computed_tokens
            if req.collected_prompt_logprobs is not None:
                # rows at prompt positions p < len(prompt) - 1 predict prompt token p + 1
                first = max(s, len(req.collected_prompt_logprobs) - 1)
                last = min(s + n, len(req.prompt_ids) - 1)
                if first < last:
                    rows.extend(range(off + first - s, off + last - s))
                    owners.append(("prompt", req, first, last - first))
            if s + n == req.num_tokens:
                rows.append(off + n - 1)
                owners.append(("sample", req, 0, 1))
            off += n
        out = StepLogits()
        if rows:
            logits = self.model.logits(hidden[torch.tensor(rows, device=self.device)]).float().cpu()
            r = 0
            for kind, req, first, k in owners:
                if kind == "prompt":
                    out.prompt[id(req)] = (first, logits[r:r + k])
                else:
                    out.sample[id(req)] = logits[r]
                r += k
        return out
