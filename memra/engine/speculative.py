"""Speculative decoding: proposers, and where the engine asks them.

Each step, a decoding request may carry up to K draft tokens (``Request.spec_tokens``) from the
engine's proposer. The scheduler then gives it 1 + K query tokens (its last token and the
drafts; the token budget counts them), the model scores them in the step's ordinary mixed
batch, and the engine verifies them in order with :meth:`memra.engine.sampling.Sampler.speculate`
(greedy: the longest prefix equal to the target's argmax, plus the bonus token; temperature > 0:
speculative sampling, lossless): accepted drafts and the final token become output, the
rejected drafts' KV slots are rolled back (``num_computed_tokens`` set past the last accepted
one, blocks past the sequence end released), and nothing unverified reaches the prefix cache.

After every step the engine calls :meth:`Proposer.draft` once for the whole batch. Three
proposers (all draft greedily: their q is one-hot, which speculative sampling accepts with
probability p(draft), so the output distribution is the target's whatever the drafter does):

- ``ngram`` (:class:`NgramProposer`): prompt lookup, as vLLM's ``ngram`` method: the longest
  suffix of the sequence (``max_n`` down to ``min_n`` tokens) that occurred earlier, and the
  tokens that followed its latest earlier occurrence. No model, no state.
- ``draft`` (:class:`DraftModelProposer`): a smaller model with the same vocabulary, with its own
  paged KV cache (its own block pool, no prefix caching). It catches up lazily: each round it
  runs over the verified tokens it has not seen (the whole prompt the first time), then drafts
  k - 1 more tokens one position at a time; draft KV of drafts that were accepted stays valid.
- ``mtp`` (:class:`MTPProposer`): Step-3.5's MTP layers, chained as STEP35.md "MTP" says, each with
  its own KV cache in a paged cache of its own (sliding window included). See its docstring.
"""

from __future__ import annotations

from typing import Protocol

import torch

from .block_manager import KVCacheManager, KVGroupSpec, layer_groups
from .kv_cache import PagedBatch, PagedKVCache, SeqChunk, kv_storage_dtype

__all__ = ["DraftModelProposer", "MTPProposer", "NgramProposer", "Proposer", "SPECULATIVE_METHODS",
           "make_proposer"]

SPECULATIVE_METHODS = ("ngram", "draft", "mtp")


class Proposer(Protocol):
    """Drafts tokens for the running requests of an engine.

    ``needs_hidden``: the engine passes the target's pre-final-norm hidden rows of every request
    computed in the step (MTP heads consume them) (graphed decode steps return them too).
    """

    needs_hidden: bool

    def draft(self, running: list, room: dict[int, int], hidden: dict[int, tuple[int, torch.Tensor]]
              ) -> dict[int, list[int]]:
        """Drafts for the next step.

        Args:
            running: the scheduler's running requests after this step's verification.
            room: ``id(request)`` -> most drafts wanted (requests not listed want none this step).
            hidden: ``id(request)`` -> (first position p, pre-norm hidden rows [n, D] of positions
                p .. p + n - 1 computed this step); empty unless ``needs_hidden``. Rows past the
                request's verified tokens (rejected drafts) are included and must be ignored.
        Returns:
            ``id(request)`` -> up to ``room`` draft tokens.
        """
        ...

    def release(self, alive: set[int]) -> None:
        """Drop the state (and KV blocks) of every request whose id is not in ``alive``."""
        ...


class NgramProposer:
    """Prompt lookup (module docstring). Args: min_n, max_n: suffix lengths tried, longest first.

    Raises: ValueError unless 1 <= min_n <= max_n."""

    needs_hidden = False

    def __init__(self, min_n: int = 1, max_n: int = 4):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"ngram proposer: need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n, self.max_n = min_n, max_n

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to ``k`` tokens that followed the latest earlier occurrence of the longest matching suffix."""
        L = len(tokens)
        for n in range(min(self.max_n, L - 1), self.min_n - 1, -1):
            pattern = tokens[L - n:]
            for i in range(L - n - 1, -1, -1):  # latest earlier occurrence first
                if tokens[i:i + n] == pattern:
                    return tokens[i + n:i + n + k]
        return []

    def draft(self, running, room, hidden):
        return {id(r): self.propose(r.all_token_ids, room[id(r)]) for r in running if room.get(id(r), 0) > 0}

    def release(self, alive: set[int]) -> None:
        pass


class _Seq:
    """A request's sequence in a proposer's own KV cache (what :class:`KVCacheManager` manages):
    block tables, and ``num_computed_tokens`` = the first cache position still to (re)compute."""

    __slots__ = ("block_tables", "block_hashes", "num_computed_tokens", "prompt_logprobs")

    def __init__(self):
        self.block_tables: list[list[int]] = []
        self.block_hashes: list[bytes] = []
        self.num_computed_tokens = 0
        self.prompt_logprobs = None

    @property
    def num_tokens(self) -> int:
        return self.num_computed_tokens


class _OwnCache:
    """A proposer's paged KV cache: groups, block pool (no prefix caching) and storage.

    Args:
        groups: KV-cache groups of the drafting layers (their attention indices).
        num_blocks: blocks per group.
        block_size, dtype, device: as the engine's cache.
        scratch: the storage gets one more block per group, never allocated (block index
            ``num_blocks[g]``), where padded rows write their K/V.
    """

    def __init__(self, groups: list[KVGroupSpec], num_blocks: list[int], block_size: int, dtype: torch.dtype,
                 device: torch.device, scratch: bool = False):
        self.manager = KVCacheManager(groups, num_blocks, block_size, enable_prefix_caching=False)
        self.storage = PagedKVCache(groups, [n + int(scratch) for n in num_blocks], block_size, dtype, device=device)
        self.device = device

    @staticmethod
    def size(groups: list[KVGroupSpec], block_size: int, max_num_seqs: int, max_len: int, chunk: int) -> list[int]:
        """Blocks per group so that ``max_num_seqs`` sequences of ``max_len`` positions, extended
        ``chunk`` positions per round, never run out (sliding groups hold only their window)."""
        return [max_num_seqs * g.max_blocks_per_seq(max_len, block_size, chunk) + 1 for g in groups]

    def batch(self, chunks: list[SeqChunk]) -> PagedBatch:
        return PagedBatch(self.storage, chunks, use_kernels=self.device.type == "cuda")


class DraftModelProposer:
    """Drafts with a smaller model of the same vocabulary (module docstring, ``draft``).

    Args:
        model: the draft :class:`~memra.models.base.CausalLM` (on the engine's device).
        vocab_size: the target's vocabulary size (draft tokens must index it).
        block_size, max_num_seqs, max_model_len, max_num_batched_tokens, k, device: the engine's
            settings; the draft cache is sized so that every running sequence fits at full length,
            but at most ``main_blocks`` (the engine's own cache) plus room for the drafts. A request
            that finds no free draft block gets no drafts that step.

    Raises: ValueError if the draft's vocabulary is larger than the target's.
    """

    needs_hidden = False

    def __init__(self, model, vocab_size: int, *, block_size: int, max_num_seqs: int, max_model_len: int,
                 max_num_batched_tokens: int, k: int, device: torch.device, main_blocks: int | None = None):
        if model.config.vocab_size > vocab_size:
            raise ValueError(f"draft model: its vocabulary ({model.config.vocab_size} tokens) is larger than the "
                             f"target's ({vocab_size}): the models must share one vocabulary")
        self.model, self.device = model, device
        groups = layer_groups(model.config.layers)
        chunk = max_model_len  # a first catch-up runs over the whole prompt
        blocks = _OwnCache.size(groups, block_size, max_num_seqs, max_model_len + k, chunk)
        if main_blocks is not None:  # hold what the engine's cache holds, plus every sequence's drafts
            blocks = [min(b, main_blocks + max_num_seqs * (-(-k // block_size) + 1)) for b in blocks]
        self.cache = _OwnCache(groups, blocks, block_size, kv_storage_dtype(model.dtype, device), device)
        self.seqs: dict[int, tuple[_Seq, int, list[int]]] = {}  # id -> (seq, first draft position, drafts)

    @torch.inference_mode()
    def draft(self, running, room, hidden):
        out: dict[int, list[int]] = {}
        live = []  # (req, seq, tokens)
        mgr = self.cache.manager
        for req in running:
            k = room.get(id(req), 0)
            if k <= 0:
                continue
            toks = req.all_token_ids
            seq, at, prev = self.seqs.get(id(req), (None, 0, []))
            if seq is None:
                seq = _Seq()
            else:  # the draft KV of drafts that were then accepted is still valid
                ok = 0
                while ok < len(prev) and at + ok < len(toks) and toks[at + ok] == prev[ok]:
                    ok += 1
                seq.num_computed_tokens = min(seq.num_computed_tokens, at + ok, len(toks) - 1)
                mgr.trim(seq)
            # catch-up rows: the verified tokens not in the draft cache, then k - 1 drafted ones
            if not mgr.allocate(seq, len(toks) - seq.num_computed_tokens + k - 1):
                self._drop(id(req), seq)
                continue
            self.seqs[id(req)] = (seq, len(toks), [])
            live.append((req, seq, k))
        if not live:
            return out
        # round 0: catch up (ends at the last verified token: its logits give draft 1)
        chunks, ids, pos = [], [], []
        for req, seq, _ in live:
            toks = req.all_token_ids
            s = seq.num_computed_tokens
            chunks.append(SeqChunk(s, len(toks) - s, seq.block_tables))
            ids.extend(toks[s:])
            pos.extend(range(s, len(toks)))
        last = torch.tensor(list(_ends(chunks)), device=self.device)
        hid = self.model(torch.tensor(ids, device=self.device), torch.tensor(pos, device=self.device),
                         self.cache.batch(chunks))
        nxt = self.model.logits(hid[last]).argmax(dim=-1).tolist()
        for (req, seq, _), t in zip(live, nxt):
            seq.num_computed_tokens = req.num_tokens
            out[id(req)] = [t]
        # rounds 1 .. k-1: one position per still-drafting request
        for i in range(1, max(k for _, _, k in live)):
            step = [(req, seq) for req, seq, k in live if k > i]
            chunks = [SeqChunk(req.num_tokens + i - 1, 1, seq.block_tables) for req, seq in step]
            ids = [out[id(req)][-1] for req, _ in step]
            pos = [c.start for c in chunks]
            hid = self.model(torch.tensor(ids, device=self.device), torch.tensor(pos, device=self.device),
                             self.cache.batch(chunks))
            for (req, _), t in zip(step, self.model.logits(hid).argmax(dim=-1).tolist()):
                out[id(req)].append(t)
        for req, seq, k in live:
            self.seqs[id(req)] = (seq, req.num_tokens, out[id(req)][:k - 1])  # inputs of the draft KV rows
        return out

    def _drop(self, rid: int, seq: _Seq) -> None:
        self.cache.manager.free(seq)
        self.seqs.pop(rid, None)

    def release(self, alive: set[int]) -> None:
        for rid in [r for r in self.seqs if r not in alive]:
            self._drop(rid, self.seqs[rid][0])


def _ends(chunks: list[SeqChunk]):
    """Row index of each chunk's last token in the concatenated step."""
    off = 0
    for c in chunks:
        off += c.num_new
        yield off - 1


def _to_device(rows: list[list[int]], device: torch.device, dtype=torch.int64) -> list[torch.Tensor]:
    """Host integer lists -> device tensors through one (pinned, non-blocking) copy: no host sync."""
    flat = torch.tensor([v for r in rows for v in r], dtype=dtype)
    if device.type == "cuda":
        flat = flat.pin_memory().to(device, non_blocking=True)
    return list(torch.split(flat, [len(r) for r in rows]))


class _MTPState:
    """One request's MTP state (:class:`MTPProposer`): cache positions are ``position - base``;
    ``done[j]``: positions < done[j] hold verified K/V in MTP layer j; ``carry[j]``: layer j's output
    z at position done[j] - 1 (layer j + 1's input there), or None."""

    __slots__ = ("seq", "base", "done", "carry")

    def __init__(self, base: int, n: int):
        self.seq, self.base = _Seq(), base
        self.done = [base] * n
        self.carry: list[torch.Tensor | None] = [None] * n


class _Segment:
    """MTP layer j's rows of one request in one round: positions s .. end - 1 (the verified ones end at
    ``limit``), the input row of each (an index into the layer's input pool), its token (a literal id,
    or -1 - r for the r-th draft of the round's token pool) and whether its last row drafts."""

    __slots__ = ("i", "s", "limit", "end", "drafting", "src", "tokens")

    def __init__(self, i: int, s: int, limit: int, end: int, drafting: bool):
        self.i, self.s, self.limit, self.end, self.drafting = i, s, limit, end, drafting
        self.src: list[int] = []
        self.tokens: list[int] = []


class _MTPGraphs:
    """MTP layers over padded rows, one CUDA graph per (layer j, request bucket) on a GPU.

    Layer j gives every request R_j = K + 1 + j rows (the most it runs in steady state: the r <= K + 1
    verified tokens of the step plus the j positions that depend on drafts), right-aligned, so the
    drafting row of request slot b is row b * R_j + R_j - 1 and the head runs on a fixed view. Padding
    rows have context length 0 (the decode attention writes zeros for them) and write their K/V to a
    scratch block; each row attends as a decode row (:class:`~memra.engine.cuda_graph.DecodeKV`: all
    rows' K/V are written before any row attends, row r sees cache positions <= its own). Inputs are
    static buffers filled by device-side gathers; the outputs are z [b * R_j, D], head logits fp32
    [b, V] and their argmax int64 [b]. All graphs share one memory pool, captured layer by layer: a
    graph's outputs stay valid while only graphs captured after it replay (later layers of the same
    round), so a round may keep views of them (tokens, recorded logits) until its end; the next
    round's first replay may overwrite them. On the CPU the same layout runs eagerly (tests).

    Args:
        model: the Step-3.5 model; cache: the proposer's paged storage (one scratch block per group
            past those its manager owns, at ``scratch_slots``); k: MTP layers used; max_reqs: most
            requests per graph; max_blocks: block-table width.
    """

    def __init__(self, model, cache: PagedKVCache, k: int, max_reqs: int, max_blocks: int, scratch_slots: list[int]):
        from .cuda_graph import MAX_GRAPH_BATCH, default_buckets

        self.model, self.cache, self.k = model, cache, k
        dev = cache.k[cache.groups[0].layers[0]].device
        self.device, self.block_size, self.max_blocks = dev, cache.block_size, max_blocks
        self.rows = [k + 1 + j for j in range(k)]
        # at most MAX_GRAPH_BATCH rows (the decode kernels' widest input) in the widest layer
        max_reqs = max(1, min(max_reqs, MAX_GRAPH_BATCH // self.rows[-1]))
        self.buckets = default_buckets(max_reqs)
        n = self.buckets[-1] * self.rows[-1]
        D = model.config.hidden_size
        self.scratch = scratch_slots
        self.h = torch.zeros(n, D, dtype=model.dtype, device=dev)
        self.ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.pos = torch.zeros(n, dtype=torch.int64, device=dev)
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=dev)
        self.tables = [torch.full((n, max_blocks), -1, dtype=torch.int32, device=dev) for _ in cache.groups]
        self.slots = [torch.full((n,), s, dtype=torch.int64, device=dev) for s in scratch_slots]
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self.capture_seconds = 0.0

    def _forward(self, j: int, b: int):
        from .cuda_graph import DecodeKV

        R, m = self.rows[j], b * self.rows[j]
        kv = DecodeKV(self.cache, [t[:m] for t in self.tables], self.seq_lens[:m], [s[:m] for s in self.slots])
        z = self.model.mtp_forward(j, self.h[:m], self.ids[:m], self.pos[:m], kv)
        lg = self.model.mtp[j].logits(z.view(b, R, -1)[:, -1].contiguous())
        return z, lg, lg.argmax(dim=-1)

    @torch.inference_mode()
    def capture(self) -> None:
        """Warm up and capture every (layer, bucket), layer by layer (the order rounds replay them)."""
        import time

        t0 = time.perf_counter()
        pool = None
        for j in range(self.k):
            for b in reversed(self.buckets):
                for _ in range(2):
                    self._forward(j, b)
                torch.cuda.synchronize(self.device)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=pool):
                    out = self._forward(j, b)
                pool = g.pool()
                self.graphs[(j, b)], self.outputs[(j, b)] = g, out
        torch.cuda.synchronize(self.device)
        self.capture_seconds = time.perf_counter() - t0

    def fits(self, j: int, segs: list[_Segment], tables: list[list[list[int]]]) -> bool:
        """Whether layer j's segments fit the padded layout (else the round runs eagerly)."""
        return (len(segs) <= self.buckets[-1] and all(sg.end - sg.s <= self.rows[j] for sg in segs)
                and all(len(t) <= self.max_blocks for ts in tables for t in ts))

    def run(self, j: int, segs: list[_Segment], states: list, src: torch.Tensor, token_pool: torch.Tensor | None):
        """Layer j over ``segs`` (inputs gathered from ``src`` rows and ``token_pool`` drafts).
        Returns (z, row of each segment's first position in z, head logits [>= len(segs), V], their
        argmax)."""
        b = next(x for x in self.buckets if x >= len(segs))
        R, bs = self.rows[j], self.block_size
        m = b * R
        hsrc, ids, refs_at, refs, pos, lens = [0] * m, [0] * m, [], [], [0] * m, [0] * m
        slots = [[s] * m for s in self.scratch]
        width = self.max_blocks
        tables = [torch.full((m, width), -1, dtype=torch.int32) for _ in self.cache.groups]
        first = []
        for k, sg in enumerate(segs):
            st = states[sg.i]
            c = sg.end - sg.s
            r0 = k * R + R - c
            first.append(r0)
            for q in range(c):
                r, p = r0 + q, sg.s + q
                hsrc[r] = sg.src[q]
                t = sg.tokens[q]
                if t >= 0:
                    ids[r] = t
                else:
                    refs_at.append(r)
                    refs.append(-1 - t)
                pos[r] = p
                cp = p - st.base
                lens[r] = cp + 1
                for g, tbl in enumerate(st.seq.block_tables):
                    slots[g][r] = tbl[cp // bs] * bs + cp % bs
            for g, tbl in enumerate(st.seq.block_tables):
                tables[g][r0:r0 + c, :len(tbl)] = torch.tensor(tbl, dtype=torch.int32)
        dev = self.device
        hsrc_d, ids_d, at_d, refs_d, pos_d, *slots_d = _to_device([hsrc, ids, refs_at, refs, pos] + slots, dev)
        lens_d, = _to_device([lens], dev, torch.int32)
        tabs = torch.stack(tables)
        tabs_d = tabs.pin_memory().to(dev, non_blocking=True) if dev.type == "cuda" else tabs
        if src.dtype == self.h.dtype:
            torch.index_select(src, 0, hsrc_d, out=self.h[:m])
        else:
            self.h[:m].copy_(src[hsrc_d])
        self.ids[:m].copy_(ids_d)
        if refs:
            self.ids[at_d] = token_pool[refs_d]
        self.pos[:m].copy_(pos_d)
        self.seq_lens[:m].copy_(lens_d)
        for g in range(len(tables)):
            self.slots[g][:m].copy_(slots_d[g])
            self.tables[g][:m].copy_(tabs_d[g])
        if dev.type == "cuda":
            self.graphs[(j, b)].replay()
            z, lg, tok = self.outputs[(j, b)]
        else:
            z, lg, tok = self._forward(j, b)
        return z, first, lg, tok


class MTPProposer:
    """Drafts with Step-3.5's chained MTP layers (STEP35.md "MTP"), each with a paged KV cache.

    MTP layer j at position p takes z_{j-1}[p] (for j = 0 the target's pre-final-norm hidden state
    h[p]) and the embedding of token p + 1 + j, and its head predicts token p + 2 + j. So, with N
    verified tokens, layer 0 at position N - 2 drafts token N, and layer j at N - 2 (fed the drafts
    before it) drafts token N + j: exactly :meth:`Step35ForCausalLM.draft` over the whole sequence,
    but incremental. Layer j's K/V at position p is *verified* when token p + 1 + j is (p <= N - 2 - j)
    and z_{j-1}[p] is; each round every layer runs over its positions from its first unverified one
    (``done[j]``) to N - 2: the verified ones advance ``done[j]``, the last j are recomputed next round
    (they depend on drafts). Layer j's first row may need z_{j-1} at one position computed in an
    earlier round (``carry``). The target's hidden rows of each step are consumed in that step
    (``needs_hidden``); a request whose rows stop arriving (drafting stepped aside, preemption) is
    dropped and restarts from the next rows it gets: its MTP layers then see the sequence from that
    position on (a prefix-cache hit likewise starts them at the first recomputed token). Drafts
    are only ever hints: verification keeps the output exact.

    A round is planned on the host first (which rows each layer runs does not depend on the drafts'
    values); the drafts stay on the device (a layer's draft-dependent tokens are gathered there) and
    cross to the host once per round. With ``graphs``, a layer whose rows fit the padded layout of
    :class:`_MTPGraphs` (every steady-state round: up to K + 1 + j rows per request) replays a CUDA
    graph; a layer where some request has more rows (a prompt's chunk) runs eagerly over
    :class:`PagedBatch` for all of them (that path also copies its attention metadata with host syncs).

    Args:
        model: a :class:`~memra.models.step3p5.Step35ForCausalLM` with at least ``k`` MTP layers.
        k: MTP layers used (= most drafts per step).
        block_size, max_num_seqs, max_model_len, max_num_batched_tokens, device: the engine's settings
            (the MTP cache is sized so that every running sequence's window fits).
        record: if a list, each round appends {id(request): (base, fp32 logits [k', vocab])} (tests).
        graphs: run steady-state rounds over padded rows (default: on a CUDA device), captured as
            CUDA graphs on a GPU (eager on the CPU, for tests); ``max_graph_reqs`` requests at most
            (default ``max_num_seqs``; capped so that the widest layer has at most
            :data:`~memra.engine.cuda_graph.MAX_GRAPH_BATCH` rows: 10 requests at K = 3).

    Raises: ValueError if the model has fewer than ``k`` MTP layers.
    """

    needs_hidden = True

    def __init__(self, model, k: int, *, block_size: int, max_num_seqs: int, max_model_len: int,
                 max_num_batched_tokens: int, device: torch.device, record: list | None = None,
                 graphs: bool | None = None, max_graph_reqs: int | None = None):
        n = len(getattr(model, "mtp", ()))
        if n < k:
            raise ValueError(f"speculative_method='mtp' with num_speculative_tokens={k}: this model has {n} MTP "
                             f"layer(s) (num_nextn_predict_layers); use at most {n}" if n else
                             "speculative_method='mtp': this model has no MTP layers (num_nextn_predict_layers = 0)")
        device = torch.device(device)
        self.model, self.k, self.record, self.device = model, k, record, device
        groups = layer_groups(model.config.mtp_layers[:k])
        blocks = _OwnCache.size(groups, block_size, max_num_seqs, max_model_len, max_num_batched_tokens + k + 1)
        graphs = device.type == "cuda" if graphs is None else graphs
        self.cache = _OwnCache(groups, blocks, block_size, kv_storage_dtype(model.dtype, self.device), self.device,
                               scratch=graphs)
        self.states: dict[int, _MTPState] = {}
        self.graphs = None
        if graphs:
            self.graphs = _MTPGraphs(model, self.cache.storage, k, min(max_num_seqs, max_graph_reqs or max_num_seqs),
                                     -(-max_model_len // block_size) + 1, [b * block_size for b in blocks])
            if device.type == "cuda":
                self.graphs.capture()
        self.num_graph_layers = self.num_eager_layers = 0

    def _plan(self, j: int, work: list, prev: list, toks: list[list[int]], Ns: list[int], drafts_at: list[dict]):
        """Layer j's segments (class docstring); ``prev[i]``: (p0, row of p0 in the input pool, rows,
        the carried row's pool index or None) for work item i."""
        segs = []
        for i, (_, st, _, kd) in enumerate(work):
            N, s = Ns[i], st.done[j]
            p0, o, zlen, carried = prev[i]
            limit = p0 + zlen if j == 0 else max(s, min(st.done[j - 1], N - 1 - j))
            end = max(limit, N - 1) if j < kd else limit
            if end <= s:
                continue
            assert (s == p0 or (s == p0 - 1 and carried is not None)) and p0 + zlen >= end, (j, s, p0, zlen, end)
            sg = _Segment(i, s, limit, end, j < kd)
            for p in range(s, end):
                sg.src.append(carried if p < p0 else o + p - p0)
                t = p + 1 + j
                sg.tokens.append(toks[i][t] if t < N else -1 - drafts_at[i][t - N])
            segs.append(sg)
        return segs

    @torch.inference_mode()
    def draft(self, running, room, hidden):
        K, mgr = self.k, self.cache.manager
        work = []  # (req, state, h rows [N-1-done0, D], drafts wanted)
        for req in running:
            h = hidden.get(id(req))
            st = self.states.get(id(req))
            if h is None:
                continue  # not computed this step (a prefill waiting for budget): state stays valid
            first, rows = h
            N = req.num_tokens
            rows = rows[:max(0, N - 1 - first)]  # verified positions first .. N - 2
            if rows.shape[0] == 0:
                continue
            if st is None or st.done[0] != first:
                if st is not None:
                    mgr.free(st.seq)
                st = self.states[id(req)] = _MTPState(first, K)
            st.seq.num_computed_tokens = min(st.done) - st.base
            if not mgr.allocate(st.seq, N - 1 - min(st.done)):
                self._drop(id(req))
                continue
            work.append((req, st, rows, min(room.get(id(req), 0), K)))
        out: dict[int, list[int]] = {id(req): [] for req, *_ in work}
        if not work:
            return out
        toks = [req.all_token_ids for req, *_ in work]
        Ns = [req.num_tokens for req, *_ in work]
        states = [st for _, st, _, _ in work]
        # layer 0's input pool: the target's verified hidden rows of every request
        pool = torch.cat([rows for _, _, rows, _ in work]) if len(work) > 1 else work[0][2]
        prev, o = [], 0
        for _, st, rows, _ in work:
            prev.append((st.done[0], o, rows.shape[0], None))
            o += rows.shape[0]
        drafts_at: list[dict[int, int]] = [{} for _ in work]  # work item -> draft d -> index in the token pool
        token_parts: list[torch.Tensor] = []  # each drafting layer's tokens (device), concatenated
        n_tok = 0
        heads: list[tuple[int, int]] = []  # (work item, index in the token pool), in draft order
        rec: dict[int, list[torch.Tensor]] = {}
        for j in range(K):
            segs = self._plan(j, work, prev, toks, Ns, drafts_at)
            nxt = [(st.done[j], 0, 0, None) for st in states]  # a request whose layer j does not run
            carried = [(i, st.carry[j]) for i, st in enumerate(states) if st.carry[j] is not None]
            if not segs:
                prev = self._next_pool(nxt, carried, None, [])
                pool = prev.pop()
                continue
            token_pool = torch.cat(token_parts) if token_parts else None
            g = self.graphs
            if g is not None and g.fits(j, segs, [states[sg.i].seq.block_tables for sg in segs]):
                z, first, lg, tok = g.run(j, segs, states, pool, token_pool)
                self.num_graph_layers += 1
            else:
                z, first, lg, tok = self._run_eager(j, segs, states, pool, token_pool)
                self.num_eager_layers += 1
            # carries (layer j's output at limit - 1) gathered in one copy; drafts stay on the device
            upd = [(k, sg) for k, sg in enumerate(segs) if sg.limit > sg.s]
            if upd:
                rows_c = z[_to_device([[first[k] + sg.limit - 1 - sg.s for k, sg in upd]], z.device)[0]]
                for (_, sg), c in zip(upd, rows_c):
                    states[sg.i].carry[j] = c
            for k, sg in enumerate(segs):
                nxt[sg.i] = (sg.s, first[k], sg.end - sg.s, None)
                states[sg.i].done[j] = sg.limit
                if sg.drafting:
                    drafts_at[sg.i][j] = n_tok + k
                    heads.append((sg.i, n_tok + k))
                    if self.record is not None:
                        rec.setdefault(sg.i, []).append(lg[k])
            token_parts.append(tok[:len(segs)])
            n_tok += len(segs)
            prev = self._next_pool(nxt, carried, z, [sg.i for sg in segs])
            pool = prev.pop()
        if heads:  # the round's only host synchronisation when every layer replayed a graph
            values = torch.cat(token_parts).tolist()
            for i, t in heads:
                out[id(work[i][0])].append(values[t])
        if self.record is not None:
            self.record.append({id(work[i][0]): (states[i].base, torch.stack(v).float().cpu())
                                for i, v in rec.items()})
        return out

    @staticmethod
    def _next_pool(nxt: list, carried: list, z: torch.Tensor | None, ran: list[int]) -> list:
        """Layer j + 1's inputs: its pool is layer j's output z followed by the carried rows (layer j's
        output at done[j] - 1 from an earlier round); returns ``prev`` entries with the pool last."""
        ran_set = set(ran)
        parts = [z] if z is not None else []
        base = z.shape[0] if z is not None else 0
        out = []
        idx = {i: base + n for n, (i, _) in enumerate(carried)}
        for i, (p0, o, zlen, _) in enumerate(nxt):
            out.append((p0, o if i in ran_set else 0, zlen if i in ran_set else 0, idx.get(i)))
        parts += [c[None] for _, c in carried]
        out.append(torch.cat(parts) if len(parts) > 1 else (parts[0] if parts else None))
        return out

    def _run_eager(self, j: int, segs: list[_Segment], states: list, src: torch.Tensor,
                   token_pool: torch.Tensor | None):
        """Layer j over ``segs`` packed one after another, attended through :class:`PagedBatch`."""
        dev = self.device
        chunks, hsrc, ids, refs_at, refs, pos, first, last = [], [], [], [], [], [], [], []
        for sg in segs:
            st = states[sg.i]
            first.append(len(hsrc))
            chunks.append(SeqChunk(sg.s - st.base, sg.end - sg.s, st.seq.block_tables))
            for q, t in enumerate(sg.tokens):
                if t < 0:
                    refs_at.append(len(ids))
                    refs.append(-1 - t)
                ids.append(max(t, 0))
                pos.append(sg.s + q)
            hsrc.extend(sg.src)
            last.append(len(hsrc) - 1)
        hsrc_d, ids_d, at_d, refs_d, pos_d, last_d = _to_device([hsrc, ids, refs_at, refs, pos, last], dev)
        if refs:
            ids_d[at_d] = token_pool[refs_d]
        z = self.model.mtp_forward(j, src[hsrc_d], ids_d, pos_d, kv=self.cache.batch(chunks))
        lg = self.model.mtp[j].logits(z[last_d])
        return z, first, lg, lg.argmax(dim=-1)

    def _drop(self, rid: int) -> None:
        st = self.states.pop(rid, None)
        if st is not None:
            self.cache.manager.free(st.seq)

    def release(self, alive: set[int]) -> None:
        for rid in [r for r in self.states if r not in alive]:
            self._drop(rid)


def proposer_cache_share(method: str, memory: int, groups: list[KVGroupSpec], model, draft, dtype: torch.dtype,
                         k: int, block_size: int, max_num_seqs: int, max_model_len: int,
                         max_num_batched_tokens: int) -> int:
    """Bytes of a KV budget ``memory`` left to the engine's own cache once the proposer's is set aside.

    ``mtp``: its window-bounded cache (:class:`MTPProposer` sizing) comes off the top. ``draft``: the
    budget is split in proportion to the bytes per token of the two models' caches (the draft cache
    holds about as many tokens as the engine's). Raises ValueError if nothing is left."""
    def per_token(gs: list[KVGroupSpec]) -> int:
        return sum(g.block_bytes(block_size, dtype) for g in gs if g.window is None) // block_size

    if method == "mtp":
        gs = layer_groups(model.config.mtp_layers[:k])
        blocks = _OwnCache.size(gs, block_size, max_num_seqs, max_model_len, max_num_batched_tokens + k + 1)
        left = memory - sum(g.block_bytes(block_size, dtype) * b for g, b in zip(gs, blocks))
    else:
        mine, theirs = per_token(groups), per_token(layer_groups(draft.config.layers))
        left = memory * mine // max(1, mine + theirs) if mine and theirs else memory // 2
    if left <= 0:
        raise ValueError(f"the KV-cache budget of {memory / 2**20:.0f} MiB leaves nothing for the model once the "
                         f"{method} proposer's cache is set aside: give more (--kv-cache-memory)")
    return left


def make_proposer(method: str, *, model=None, draft_model=None, k: int = 3, device: torch.device | str = "cpu",
                  block_size: int = 16, max_num_seqs: int = 64, max_model_len: int = 2048,
                  max_num_batched_tokens: int = 512, main_blocks: int | None = None, graphs: bool | None = None,
                  max_graph_reqs: int | None = None) -> Proposer:
    """The proposer of ``method`` for an engine: ``model`` is the target, ``draft_model`` a loaded
    draft model (``draft``), the rest the engine's settings (``main_blocks``: blocks of the engine's
    full-attention group, which bounds the draft model's cache; ``graphs``, ``max_graph_reqs``: MTP
    drafting in CUDA graphs, :class:`MTPProposer`).

    Raises: ValueError for an unknown method, a missing draft model, or a target without MTP layers."""
    if method == "ngram":
        return NgramProposer()
    if method not in SPECULATIVE_METHODS:
        raise ValueError(f"unknown speculative method {method!r} (supported: {', '.join(SPECULATIVE_METHODS)})")
    sizes = dict(block_size=block_size, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                 max_num_batched_tokens=max_num_batched_tokens, device=torch.device(device))
    if method == "mtp":
        return MTPProposer(model, k, graphs=graphs, max_graph_reqs=max_graph_reqs, **sizes)
    if draft_model is None:
        raise ValueError("speculative_method='draft' needs a draft model (speculative_model / --draft-model)")
    return DraftModelProposer(draft_model, model.config.vocab_size, k=k, main_blocks=main_blocks, **sizes)
