"""Sampling parameters and the token sampler.

Semantics follow the OpenAI API and vLLM, which users compare us with:
- repetition_penalty (CTRL, Keskar et al. 2019): for every token seen in the prompt or
  the output, a positive logit is divided by the penalty, a negative one multiplied;
- presence_penalty / frequency_penalty (OpenAI): subtract ``presence * [count > 0] +
  frequency * count`` over output tokens;
- temperature 0 means greedy (argmax after penalties);
- top_k, then top_p (nucleus, Holtzman et al. 2019), then min_p (tokens whose
  probability is below ``min_p * max_prob`` are dropped);
- logprobs are of the model's raw distribution (log-softmax of the logits, before
  penalties and temperature), as vLLM returns by default.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["SamplingParams", "Sampler", "SampleResult", "filtered_probs", "inverse_cdf", "sample_rows"]


@dataclass
class SamplingParams:
    """How to generate a completion.

    Attributes:
        n: completions per prompt (share one prefill).
        max_tokens: most tokens to generate (>= 1).
        temperature: >= 0; 0 is greedy.
        top_k: keep the k most likely tokens (0 or -1: off).
        top_p: nucleus mass in (0, 1].
        min_p: in [0, 1).
        repetition_penalty: > 0 (1 is off).
        presence_penalty, frequency_penalty: in [-2, 2].
        seed: seeds this request's generator (same seed, same tokens); None: random.
        stop: strings that end generation when they appear in the text; not included in it.
        stop_token_ids: token ids that end generation (in addition to the model's eos ids).
        ignore_eos: do not stop at eos ids.
        logprobs: return the top-n logprobs of each generated token (0..20) and the chosen one's.
        skip_special_tokens: omit special tokens from the text.
        min_tokens: generate at least this many tokens (<= max_tokens): until then the
            end-of-generation ids and ``stop_token_ids`` cannot be sampled and stop strings
            are not matched (vLLM's ``min_tokens``).
        logit_bias: token id -> bias in [-100, 100] added to that token's logit before
            penalties and sampling (OpenAI's ``logit_bias``; -100 effectively bans a token).
        structured: a compiled :class:`memra.engine.structured.Grammar` the output must follow
            (JSON schema, tool-call format, regex, ...): each step's logits are masked to the
            tokens it allows; None: free text. Not combinable with ``ignore_eos`` or ``min_tokens``
            (the grammar decides where the output ends).

    Raises:
        ValueError: on construction, naming the parameter that is out of range.
    """

    n: int = 1
    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    min_tokens: int = 0
    logit_bias: dict[int, float] = field(default_factory=dict)
    structured: Any = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop is None:  # as vLLM: no stop strings
            self.stop = []
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        for name in ("stop", "stop_token_ids"):
            if not isinstance(getattr(self, name), (list, tuple)):
                raise ValueError(f"invalid sampling parameter {name}={getattr(self, name)!r}: must be a list")
        checks = [
            ("n", isinstance(self.n, int) and self.n >= 1, "an integer >= 1"),
            ("max_tokens", isinstance(self.max_tokens, int) and self.max_tokens >= 1, "an integer >= 1"),
            ("temperature", _finite(self.temperature) and self.temperature >= 0, "a finite number >= 0"),
            ("top_k", isinstance(self.top_k, int) and self.top_k >= -1, "an integer >= -1 (0 or -1 disables it)"),
            ("top_p", _finite(self.top_p) and 0 < self.top_p <= 1, "in (0, 1]"),
            ("min_p", _finite(self.min_p) and 0 <= self.min_p < 1, "in [0, 1)"),
            ("repetition_penalty", _finite(self.repetition_penalty) and self.repetition_penalty > 0, "a number > 0"),
            ("presence_penalty", _finite(self.presence_penalty) and -2 <= self.presence_penalty <= 2, "in [-2, 2]"),
            ("frequency_penalty", _finite(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2,
             "in [-2, 2]"),
            ("seed", self.seed is None or isinstance(self.seed, int) and not isinstance(self.seed, bool),
             "an integer or null"),
            ("stop", all(isinstance(s, str) and s for s in self.stop), "a list of non-empty strings"),
            ("stop_token_ids", all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
             "a list of token ids >= 0"),
            ("logprobs", self.logprobs is None or isinstance(self.logprobs, int) and 0 <= self.logprobs <= 20,
             "an integer in [0, 20] or null"),
            ("min_tokens", isinstance(self.min_tokens, int) and not isinstance(self.min_tokens, bool)
             and 0 <= self.min_tokens <= (self.max_tokens if isinstance(self.max_tokens, int) else 0),
             "an integer in [0, max_tokens]"),
            ("logit_bias", isinstance(self.logit_bias, dict) and all(
                isinstance(k, int) and not isinstance(k, bool) and k >= 0 and _finite(v) and -100 <= v <= 100
                for k, v in self.logit_bias.items()), "a map of token ids >= 0 to numbers in [-100, 100]"),
        ]
        if self.structured is not None:
            checks += [
                ("structured", hasattr(self.structured, "matcher"), "a compiled grammar (memra.engine.structured)"),
                ("ignore_eos", not self.ignore_eos, "false with structured output (the grammar ends the output)"),
                ("min_tokens", self.min_tokens == 0, "0 with structured output (the grammar ends the output)"),
            ]
        for name, ok, want in checks:
            if not ok:
                raise ValueError(f"invalid sampling parameter {name}={getattr(self, name)!r}: must be {want}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@dataclass
class SampleResult:
    """One sampled token: its id, its logprob, and the top-n (id, logprob) alternatives."""

    token: int
    logprob: float | None = None
    top: list[tuple[int, float]] | None = None


class Sampler:
    """Samples one token at a time for one sequence.

    Args:
        params: the request's sampling parameters.
        prompt_ids: prompt token ids (for the repetition penalty).
        vocab_size: size of the logits' last dimension.
    """

    def __init__(self, params: SamplingParams, prompt_ids: list[int], vocab_size: int, seed_offset: int = 0,
                 end_ids: list[int] | None = None):
        """``end_ids``: the ids that end a completion (eos unless ignore_eos, stop_token_ids),
        kept from being sampled until ``params.min_tokens`` tokens exist.

        Raises: ValueError if a ``logit_bias`` or ``end_ids`` id is outside the vocabulary."""
        self.params = params
        for what, ids in (("logit_bias", list(params.logit_bias)), ("stop_token_ids / eos ids", end_ids or [])):
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(f"invalid sampling parameter {what}: token id {bad[0]} is outside the vocabulary "
                                 f"[0, {vocab_size})")
        self.bias = None
        if params.logit_bias:
            self.bias = torch.zeros(vocab_size, dtype=torch.float32)
            ids = torch.tensor(list(params.logit_bias), dtype=torch.long)
            self.bias[ids] = torch.tensor(list(params.logit_bias.values()), dtype=torch.float32)
        self.end_ids = torch.tensor(sorted(set(end_ids or [])), dtype=torch.long)
        self.generated = 0
        self.vocab_size = vocab_size
        self.generator = torch.Generator()
        if params.seed is not None:
            self.generator.manual_seed(params.seed + seed_offset)
        else:
            self.generator.seed()
        self.seen = torch.zeros(vocab_size, dtype=torch.bool)
        if prompt_ids:
            self.seen[torch.tensor([t for t in prompt_ids if 0 <= t < vocab_size], dtype=torch.long)] = True
        self.counts = torch.zeros(vocab_size, dtype=torch.float32)
        self.matcher = params.structured.matcher() if params.structured is not None else None
        self._mask_step = -1  # the step whose grammar mask was already applied (on the device)

    def grammar_mask(self) -> torch.Tensor:
        """bool [vocab_size]: what the grammar allows for the next token, for a caller that applies
        it to the logits itself (the GPU runner, batched); :meth:`sample` / :meth:`take` of this
        step then do not apply it again."""
        self._mask_step = self.generated
        return self.matcher.allowed()

    def take(self, token: int, logit: float) -> SampleResult:
        """Record ``token`` chosen on the device: the argmax (greedy, no penalties, no logprobs:
        the same choice :meth:`sample` makes), or drawn by :func:`sample_rows` with this step's
        :meth:`draw` (a :meth:`batchable` step: the same draw :meth:`sample` makes from the
        same logits); ``logit`` is its logit.

        Raises: ValueError if ``logit`` is not finite (no finite logit: cannot sample) or the
        token is outside the vocabulary."""
        if not math.isfinite(logit):
            raise ValueError(f"the model produced no finite logit (max {logit}): cannot sample")
        if not 0 <= token < self.vocab_size:
            raise ValueError(f"token {token} is outside the vocabulary [0, {self.vocab_size})")
        if self.matcher is not None:  # the device applied grammar_mask() before its argmax
            self.matcher.advance(token)
        self.counts[token] += 1
        self.generated += 1
        return SampleResult(token)

    def _distribution(self, logits: torch.Tensor) -> tuple[int | None, torch.Tensor | None]:
        """The next token's distribution after every sampling parameter, in the plain sampler's
        order: logit_bias, min_tokens, the grammar, penalties, then (temperature > 0) temperature,
        top-k, top-p, min-p. Returns (the argmax, None) when greedy, else (None, probs float64 [V],
        not renormalised after top-p / min-p)."""
        p = self.params
        x = logits  # every step below is out of place
        if self.bias is not None:
            x = x + self.bias
        if self.generated < p.min_tokens and self.end_ids.numel():
            x = x.index_fill(0, self.end_ids, float("-inf"))
        if self.matcher is not None and self._mask_step != self.generated:  # structured output
            x = x.masked_fill(~self.matcher.allowed(), float("-inf"))
        if p.repetition_penalty != 1.0:
            seen = self.seen | (self.counts > 0)
            x = torch.where(seen & (x > 0), x / p.repetition_penalty, torch.where(seen, x * p.repetition_penalty, x))
        if p.presence_penalty or p.frequency_penalty:
            x = x - p.presence_penalty * (self.counts > 0).float() - p.frequency_penalty * self.counts
        if x is not logits:  # an extreme penalty can overflow: keep the order, stay finite
            x = torch.nan_to_num(x, nan=float("-inf"), posinf=torch.finfo(x.dtype).max)
        top = x.max()
        if not bool(torch.isfinite(top)):
            raise ValueError(f"the model produced no finite logit (max {float(top)}): cannot sample")
        if p.greedy:
            return int(torch.argmax(x)), None
        probs = filtered_probs(x.unsqueeze(0), torch.tensor([p.temperature], dtype=torch.float64),
                               torch.tensor([p.top_k]), torch.tensor([p.top_p], dtype=torch.float64),
                               torch.tensor([p.min_p], dtype=torch.float64))
        return None, probs[0]

    def batchable(self) -> bool:
        """Whether this step's token can be drawn by :func:`sample_rows` on the logits' device
        (the GPU runner batches such rows): a random draw (temperature > 0) shaped by temperature,
        top-k, top-p and min-p only: no logit_bias, penalties, logprobs or pending min_tokens
        ban, and a grammar's mask (if any) already applied by the caller (:meth:`grammar_mask`)."""
        p = self.params
        return (not p.greedy and self.bias is None and p.repetition_penalty == 1.0 and not p.presence_penalty
                and not p.frequency_penalty and p.logprobs is None
                and not (self.generated < p.min_tokens and self.end_ids.numel())
                and (self.matcher is None or self._mask_step == self.generated))

    def draw(self) -> float:
        """This step's uniform in [0, 1) from the request's generator (float64): the one random
        number a sampled token consumes, whether :meth:`sample` or :func:`sample_rows` uses it."""
        return float(torch.rand((), generator=self.generator, dtype=torch.float64))

    def sample(self, logits: torch.Tensor) -> SampleResult:
        """Choose the next token from fp32 ``logits`` [vocab_size] and record it."""
        logits = logits.float()
        greedy, probs = self._distribution(logits)
        if probs is None:
            token = greedy
        else:
            token = int(inverse_cdf(probs.unsqueeze(0), torch.tensor([self.draw()], dtype=torch.float64))[0])
        return self._record(token, logits)

    def speculate(self, logits: torch.Tensor, draft: int, q: torch.Tensor | None = None) -> tuple[SampleResult, bool]:
        """One verify position of speculative decoding (Leviathan et al. 2023; Chen et al. 2023):
        the target's ``logits`` [V] at the position a proposer drafted ``draft`` for, with the
        proposer's distribution ``q`` [V] (None: a deterministic proposer, q one-hot on the
        draft). p is this sampler's distribution (:meth:`_distribution`: every parameter applied
        exactly as :meth:`sample` applies it). The draft is accepted with probability
        min(1, p[d] / q[d]); on rejection the token is drawn from max(0, p - q) normalised, so the
        output is distributed as plain sampling. Greedy: accepted iff it is the argmax, else the
        argmax. Records the chosen token; returns (it, whether it is the draft)."""
        logits = logits.float()
        greedy, probs = self._distribution(logits)
        if probs is None:
            return self._record(greedy, logits), greedy == draft
        probs = probs / probs.sum()  # top-p / min-p leave it unnormalised (multinomial does not care)
        qd = 1.0 if q is None else float(q[draft])
        u = float(torch.rand((), generator=self.generator, dtype=torch.float64))
        if qd > 0 and u * qd < float(probs[draft]):
            return self._record(draft, logits), True
        if q is None:
            residual = probs.clone()
            residual[draft] = 0.0
        else:
            residual = (probs - q.double()).clamp_min(0.0)
        if not float(residual.sum()) > 0:  # p <= q everywhere: p == q, so rejection had probability 0
            residual = probs
        token = int(torch.multinomial(residual, 1, generator=self.generator))
        return self._record(token, logits), False

    def _record(self, token: int, logits: torch.Tensor) -> SampleResult:
        """Record the chosen ``token`` (counts, grammar, logprobs of the raw ``logits``)."""
        p = self.params
        result = SampleResult(token)
        if p.logprobs is not None:
            raw_lp = torch.log_softmax(logits, dim=-1)
        if self.matcher is not None:
            self.matcher.advance(token)
        if p.logprobs is not None:
            result.logprob = float(raw_lp[token])
            if p.logprobs > 0:
                v, i = torch.topk(raw_lp, p.logprobs)
                result.top = list(zip(i.tolist(), v.tolist()))
            else:
                result.top = []
        self.counts[token] += 1
        self.generated += 1
        return result


#: Rows :func:`sample_rows` filters at a time: its float64 temporaries are ~10 [rows, V] tensors
#: (32 rows of a 152k vocabulary: ~0.4 GB).
SAMPLE_CHUNK = 32


def filtered_probs(x: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                   min_p: torch.Tensor) -> torch.Tensor:
    """The sampling distribution of each row of logits, as vLLM shapes it: temperature, then top-k,
    top-p (nucleus; Holtzman et al. 2019), min-p. One function for the host sampler (one row) and
    the batched device sampler (:func:`sample_rows`), so both draw from the same numbers.

    Args:
        x: logits [B, V] (any float dtype, any device; computed in float64). A row needs a
            finite maximum.
        temperature: float64 [B], > 0. top_k: int [B] (<= 0 or >= V: off). top_p: float64 [B]
            in (0, 1] (1: off). min_p: float64 [B] in [0, 1) (0: off).
    Returns:
        float64 [B, V] probabilities, not renormalised after top-p / min-p (:func:`inverse_cdf`
        does not need it).
    """
    dev = x.device
    temperature, top_k, top_p, min_p = (t.to(dev) for t in (temperature, top_k, top_p, min_p))
    v = x.shape[-1]
    # shifting by the max first keeps a tiny temperature exact: the best token's logit is 0,
    # every other one tends to -inf (its limit is greedy), never inf - inf = nan
    # (in float64: a temperature below float32's range must not become a division by 0)
    x = x.double()
    x = (x - x.amax(dim=-1, keepdim=True)) / temperature[:, None]
    use_k = (top_k > 0) & (top_k < v)
    use_p = top_p < 1.0
    if bool(use_k.any()):  # the k-th largest value of each row from one topk (no full sort)
        k_max = int(top_k[use_k].max())
        kth = torch.topk(x, k_max, dim=-1).values.gather(1, (top_k.clamp(1, k_max) - 1)[:, None])
        x = x.masked_fill(use_k[:, None] & (x < kth), float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if bool(use_p.any()):
        # stable: of exactly tied tokens at the nucleus boundary the lowest ids are kept
        sp, order = torch.sort(probs, dim=-1, descending=True, stable=True)
        before = torch.cumsum(sp, dim=-1) - sp  # mass strictly above each token
        drop = use_p[:, None] & (before >= top_p[:, None])
        drop[:, 0] = False
        probs = probs.scatter(1, order, sp.masked_fill(drop, 0.0))
    if bool((min_p > 0).any()):
        probs = probs.masked_fill(probs < min_p[:, None] * probs.amax(dim=-1, keepdim=True), 0.0)
    return probs


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Token ids [B] (int64) drawn from unnormalised ``probs`` [B, V] with uniforms ``u`` [B] in [0, 1)
    (float64): the first index whose cumulative mass exceeds ``u`` times the row's total, so a
    zero-probability token is never chosen. Deterministic in (probs, u): batch-invariant."""
    c = torch.cumsum(probs, dim=-1)
    target = (u.to(c.device, c.dtype) * c[:, -1])[:, None]
    return torch.searchsorted(c, target, right=True)[:, 0].clamp_max(probs.shape[-1] - 1)


def sample_rows(logits: torch.Tensor, samplers: list[Sampler]) -> list[tuple[int, float]]:
    """One token per row of ``logits`` [B, V] (any device) for :meth:`Sampler.batchable` samplers, on
    the logits' device: :func:`filtered_probs` with each row's parameters and :func:`inverse_cdf`
    with each sampler's :meth:`Sampler.draw`. Returns (token, its logit) per row, for
    :meth:`Sampler.take`. Two small host transfers per call (the parameters and uniforms in,
    B tokens and logits out) instead of B rows of logits."""
    ps = [s.params for s in samplers]
    f64 = torch.float64
    temperature = torch.tensor([p.temperature for p in ps], dtype=f64)
    top_k = torch.tensor([p.top_k for p in ps])
    top_p = torch.tensor([p.top_p for p in ps], dtype=f64)
    min_p = torch.tensor([p.min_p for p in ps], dtype=f64)
    u = torch.tensor([s.draw() for s in samplers], dtype=f64)
    toks = []
    for a in range(0, len(ps), SAMPLE_CHUNK):  # bounds the float64 [rows, V] temporaries
        b = a + SAMPLE_CHUNK
        toks.append(inverse_cdf(filtered_probs(logits[a:b], temperature[a:b], top_k[a:b], top_p[a:b], min_p[a:b]),
                                u[a:b]))
    tok = torch.cat(toks)
    chosen = logits.gather(1, tok[:, None])[:, 0].float()
    # a row without a finite maximum (NaN / inf logits) reports that maximum, so take() raises as
    # the host sampler does, instead of recording whatever token the NaN cumulative sum pointed at
    top = logits.amax(dim=-1).float()
    chosen = torch.where(torch.isfinite(top), chosen, top)
    return list(zip(tok.tolist(), chosen.tolist()))
