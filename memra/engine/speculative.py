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
    computed in the step (MTP heads consume them); the runner then skips CUDA graphs.
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
    """

    def __init__(self, groups: list[KVGroupSpec], num_blocks: list[int], block_size: int, dtype: torch.dtype,
                 device: torch.device):
        self.manager = KVCacheManager(groups, num_blocks, block_size, enable_prefix_caching=False)
        self.storage = PagedKVCache(groups, num_blocks, block_size, dtype, device=device)
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


class _MTPState:
    """One request's MTP state (:class:`MTPProposer`): cache positions are ``position - base``;
    ``done[j]``: positions < done[j] hold verified K/V in MTP layer j; ``carry[j]``: layer j's output
    z at position done[j] - 1 (layer j + 1's input there), or None."""

    __slots__ = ("seq", "base", "done", "carry")

    def __init__(self, base: int, n: int):
        self.seq, self.base = _Seq(), base
        self.done = [base] * n
        self.carry: list[torch.Tensor | None] = [None] * n


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

    Args:
        model: a :class:`~memra.models.step3p5.Step35ForCausalLM` with at least ``k`` MTP layers.
        k: MTP layers used (= most drafts per step).
        block_size, max_num_seqs, max_model_len, max_num_batched_tokens, device: the engine's settings
            (the MTP cache is sized so that every running sequence's window fits).
        record: if a list, each round appends {id(request): (base, fp32 logits [k', vocab])} (tests).

    Raises: ValueError if the model has fewer than ``k`` MTP layers.
    """

    needs_hidden = True

    def __init__(self, model, k: int, *, block_size: int, max_num_seqs: int, max_model_len: int,
                 max_num_batched_tokens: int, device: torch.device, record: list | None = None):
        n = len(getattr(model, "mtp", ()))
        if n < k:
            raise ValueError(f"speculative_method='mtp' with num_speculative_tokens={k}: this model has {n} MTP "
                             f"layer(s) (num_nextn_predict_layers); use at most {n}" if n else
                             "speculative_method='mtp': this model has no MTP layers (num_nextn_predict_layers = 0)")
        self.model, self.k, self.record, self.device = model, k, record, device
        groups = layer_groups(model.config.mtp_layers[:k])
        blocks = _OwnCache.size(groups, block_size, max_num_seqs, max_model_len, max_num_batched_tokens + k + 1)
        self.cache = _OwnCache(groups, blocks, block_size, kv_storage_dtype(model.dtype, self.device), self.device)
        self.states: dict[int, _MTPState] = {}

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
        out = {id(req): [] for req, *_ in work}
        toks = {id(req): list(req.all_token_ids) for req, *_ in work}  # verified tokens, then this round's drafts
        if not work:
            return out
        logits_rec: dict[int, list[torch.Tensor]] = {}
        # per request: this round's input of the current layer: (first position p0, rows at p0.., the
        # previous layer's output at p0 - 1 from an earlier round)
        prev = {id(req): (st.done[0], rows, None) for req, st, rows, _ in work}
        for j in range(K):
            chunks, hs, ids, pos, heads, updates = [], [], [], [], [], []
            nxt: dict[int, tuple[int, torch.Tensor, torch.Tensor | None]] = {}
            for req, st, _, kd in work:
                N = req.num_tokens
                s = st.done[j]
                p0, z, carried = prev[id(req)]  # z_{j-1} (or h) at positions p0 .. p0 + len(z) - 1
                nxt[id(req)] = (s, z[:0], st.carry[j])  # (replaced below if layer j runs)
                # verified positions end at `limit`; a drafting layer runs on to N - 2
                limit = p0 + z.shape[0] if j == 0 else max(s, min(st.done[j - 1], N - 1 - j))
                end = max(limit, N - 1) if j < kd else limit
                if end <= s:
                    continue
                if s < p0:  # the one earlier verified position: carried from an earlier round
                    z = torch.cat([carried[None], z])
                    p0 = s
                assert p0 == s and p0 + z.shape[0] >= end, (j, s, p0, z.shape, end)
                chunks.append(SeqChunk(s - st.base, end - s, st.seq.block_tables))
                hs.append(z[:end - s])
                ids.extend(toks[id(req)][s + 1 + j:end + 1 + j])
                pos.extend(range(s, end))
                updates.append((req, st, s, limit, end, j < kd))
            if not chunks:
                prev = nxt
                continue
            zs = self.model.mtp_forward(j, torch.cat(hs), torch.tensor(ids, device=self.device),
                                        torch.tensor(pos, device=self.device), kv=self.cache.batch(chunks))
            off = 0
            for (req, st, s, limit, _, drafting), c in zip(updates, chunks):
                z = zs[off:off + c.num_new]
                off += c.num_new
                nxt[id(req)] = (s, z, st.carry[j])
                if limit > s:
                    st.carry[j] = z[limit - 1 - s].clone()
                st.done[j] = limit
                if drafting:
                    heads.append((req, off - 1))
            if heads:
                lg = self.model.mtp[j].logits(zs[torch.tensor([r for _, r in heads], device=self.device)])
                for (req, _), t, row in zip(heads, lg.argmax(dim=-1).tolist(), lg):
                    out[id(req)].append(t)
                    toks[id(req)].append(t)
                    if self.record is not None:
                        logits_rec.setdefault(id(req), []).append(row.float().cpu())
            prev = nxt
        if self.record is not None:
            self.record.append({rid: (self.states[rid].base, torch.stack(v)) for rid, v in logits_rec.items()})
        return out

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
                  max_num_batched_tokens: int = 512, main_blocks: int | None = None) -> Proposer:
    """The proposer of ``method`` for an engine: ``model`` is the target, ``draft_model`` a loaded
    draft model (``draft``), the rest the engine's settings (``main_blocks``: blocks of the engine's
    full-attention group, which bounds the draft model's cache).

    Raises: ValueError for an unknown method, a missing draft model, or a target without MTP layers."""
    if method == "ngram":
        return NgramProposer()
    if method not in SPECULATIVE_METHODS:
        raise ValueError(f"unknown speculative method {method!r} (supported: {', '.join(SPECULATIVE_METHODS)})")
    sizes = dict(block_size=block_size, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                 max_num_batched_tokens=max_num_batched_tokens, device=torch.device(device))
    if method == "mtp":
        return MTPProposer(model, k, **sizes)
    if draft_model is None:
        raise ValueError("speculative_method='draft' needs a draft model (speculative_model / --draft-model)")
    return DraftModelProposer(draft_model, model.config.vocab_size, k=k, main_blocks=main_blocks, **sizes)
