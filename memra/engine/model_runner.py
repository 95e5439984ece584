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
from .sampling import sample_rows

__all__ = ["ModelRunner", "StepLogits"]


class StepLogits:
    """Logits of one step, fp32, on the host.

    Attributes:
        sample: request -> logits [vocab] to sample its next token from.
        greedy: request -> (token, its logit) already chosen on the GPU (greedy requests
            without penalties or logprobs: only the token id crosses to the host).
        prompt: request -> (first prompt position p, logits [n, vocab]) predicting prompt
            tokens p+1 .. p+n (prompt logprobs).
        verify: request -> logits [1 + k, vocab] of a decode with k drafts: row j after the
            last token and the first j drafts.
        hidden: (only when asked) request -> (first position p, pre-final-norm hidden rows
            [n, hidden] of the n tokens computed this step, on the model's device).
    """

    def __init__(self):
        self.hidden: dict[int, tuple[int, torch.Tensor]] = {}
        self.verify: dict[int, torch.Tensor] = {}
        self.sample: dict[int, torch.Tensor] = {}
        self.greedy: dict[int, tuple[int, float]] = {}
        self.prompt: dict[int, tuple[int, torch.Tensor]] = {}


def _gpu_greedy(req: Request) -> bool:
    """Whether the argmax on the device is the request's whole sampling step (a grammar's mask is
    applied on the device first, :meth:`ModelRunner._sample_rows`)."""
    p = req.params
    return (p.greedy and p.repetition_penalty == 1.0 and not p.presence_penalty and not p.frequency_penalty
            and p.logprobs is None and not p.logit_bias and p.min_tokens == 0)


class ModelRunner:
    """Executes scheduled steps of ``model`` over the paged cache ``cache``.

    ``graphs`` (GPU only): a captured :class:`~memra.engine.cuda_graph.CudaGraphRunner`
    that runs decode-only steps of up to its largest bucket; other steps run eagerly.
    """

    def __init__(self, model, cache: PagedKVCache, graphs=None):
        self.model, self.cache, self.graphs = model, cache, graphs
        self.device = cache.k[cache.groups[0].layers[0]].device
        self.num_graph_steps = self.num_eager_steps = 0

    def _sample_rows(self, out: StepLogits, reqs: list[Request], logits: torch.Tensor) -> None:
        """Sampling rows ``logits`` [len(reqs), vocab] (any device) into ``out``: greedy rows are
        reduced on the device, random draws shaped only by temperature / top-k / top-p / min-p
        are drawn there in one batch (``Sampler.batchable``), the rest (penalties, logit_bias,
        logprobs) are copied to the host for the request's sampler. ``out.greedy`` holds the
        tokens chosen on the device, (token, logit) per request."""
        if logits.device.type == "cpu":
            for r, req in enumerate(reqs):
                out.sample[id(req)] = logits[r]
            return
        constrained = [r for r, req in enumerate(reqs) if req.sampler.matcher is not None]
        if constrained:  # grammar masks: computed per sequence on the host, applied in one device op
            idx = torch.tensor(constrained, device=logits.device)
            allowed = torch.stack([reqs[r].sampler.grammar_mask() for r in constrained]).to(logits.device)
            logits = logits.clone()
            logits[idx] = logits[idx].masked_fill(~allowed, float("-inf"))
        fast = [r for r, req in enumerate(reqs) if _gpu_greedy(req)]
        if fast:
            idx = torch.tensor(fast, device=logits.device)
            top, tok = logits[idx].max(dim=-1)
            for r, t, v in zip(fast, tok.tolist(), top.tolist()):
                out.greedy[id(reqs[r])] = (t, v)
        drawn = [r for r in range(len(reqs)) if id(reqs[r]) not in out.greedy and reqs[r].sampler.batchable()]
        if drawn:  # random draws, batched on the device (memra/engine/sampling.py sample_rows)
            idx = torch.tensor(drawn, device=logits.device)
            for r, tv in zip(drawn, sample_rows(logits[idx], [reqs[r].sampler for r in drawn])):
                out.greedy[id(reqs[r])] = tv
        rest = [r for r in range(len(reqs)) if id(reqs[r]) not in out.greedy]
        if rest:
            host = logits[torch.tensor(rest, device=logits.device)].float().cpu()
            for j, r in enumerate(rest):
                out.sample[id(reqs[r])] = host[j]

    @torch.inference_mode()
    def execute(self, items: list[tuple[Request, int]], hidden: bool = False) -> StepLogits:
        """Compute ``n`` new tokens of each ``(request, n)``; K/V go into the cache. ``hidden``: also
        return every request's pre-norm hidden rows (MTP drafting). Decode-only steps, verify steps
        included, replay a CUDA graph when their query rows fit its largest batch.

        Does not advance ``num_computed_tokens`` (the engine does, after sampling).
        """
        g = self.graphs
        if (g is not None and sum(n for _, n in items) <= g.max_batch
                and all(n == 1 + len(req.spec_tokens) and req.num_computed_tokens + 1 == req.num_tokens
                        for req, n in items)):
            # decodes, with or without drafts: one graph row per query token (a verify step's rows
            # share their sequence's block table). Such rows never need prompt-logprob rows:
            # those end at len(prompt) - 1 <= the first row's position.
            self.num_graph_steps += 1
            ids, pos, tables = [], [], []
            for req, n in items:
                s = req.num_computed_tokens
                ids.extend([req.all_token_ids[s]] + req.spec_tokens)
                pos.extend(range(s, s + n))
                tables.extend([req.block_tables] * n)
            logits = g.run(ids, pos, tables)
            out = StepLogits()
            if hidden:
                pre, off = g.hidden(), 0
                for req, n in items:
                    out.hidden[id(req)] = (req.num_computed_tokens, pre[off:off + n])
                    off += n
            plain, rows, off, verify = [], [], 0, []
            for req, n in items:
                if n == 1:
                    plain.append(req)
                    rows.append(off)
                else:
                    verify.append((req, off, n))
                off += n
            if verify:  # every verify row to the host in one copy
                host = logits[torch.cat([torch.arange(o, o + n) for _, o, n in verify]).to(logits.device)].cpu()
                r = 0
                for req, _, n in verify:
                    out.verify[id(req)] = host[r:r + n]
                    r += n
            if plain:
                self._sample_rows(out, plain, logits[torch.tensor(rows, device=logits.device)] if verify else logits)
            return out
        self.num_eager_steps += 1
        ids, pos, chunks = [], [], []
        for req, n in items:
            s = req.num_computed_tokens
            ids.extend((req.all_token_ids + req.spec_tokens)[s:s + n])  # drafts follow a decode's last token
            pos.extend(range(s, s + n))
            chunks.append(SeqChunk(s, n, req.block_tables))
        # the attention backend of a mixed step: the paged Triton kernels when the cache is on a GPU
        kv = PagedBatch(self.cache, chunks, use_kernels=self.device.type == "cuda")
        out = StepLogits()
        args = (torch.tensor(ids, device=self.device), torch.tensor(pos, device=self.device), kv)
        hid = self.model(*args, both=True) if hidden else self.model(*args)
        if hidden:
            hid, pre = hid
            off = 0
            for req, n in items:
                out.hidden[id(req)] = (req.num_computed_tokens, pre[off:off + n])
                off += n
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
            if req.spec_tokens and s + 1 == req.num_tokens:  # verify: every row
                rows.extend(range(off, off + n))
                owners.append(("verify", req, 0, n))
            elif s + n == req.num_tokens:
                rows.append(off + n - 1)
                owners.append(("sample", req, 0, 1))
            off += n
        if rows:
            logits = self.model.logits(hid[torch.tensor(rows, device=self.device)]).float()
            r, sampled_rows, sample_reqs = 0, [], []
            for kind, req, first, k in owners:
                if kind == "prompt":
                    out.prompt[id(req)] = (first, logits[r:r + k].cpu())
                elif kind == "verify":
                    out.verify[id(req)] = logits[r:r + k].cpu()
                else:
                    sampled_rows.append(r)
                    sample_reqs.append(req)
                r += k
            if sampled_rows:
                self._sample_rows(out, sample_reqs, logits[torch.tensor(sampled_rows, device=logits.device)])
        return out
