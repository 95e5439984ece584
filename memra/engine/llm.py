"""The offline Python API: ``LLM(model).generate(prompts, params)``.

A thin layer over :class:`~memra.engine.engine.LLMEngine`: every prompt becomes an
engine request, and the engine's loop (continuous batching over a paged KV cache,
chunked prefill, prefix caching) runs until all of them finish. A prompt is prefilled
once (in chunks of ``max_num_batched_tokens``), then each decode step feeds one token.
"""

from __future__ import annotations

import operator
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from .engine import EngineConfig, LLMEngine, PromptTooLongError
from .output import CompletionOutput
from .sampling import SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams", "PromptTooLongError"]


@dataclass
class RequestOutput:
    """Result of one prompt: the prompt, its token ids and ``n`` completions."""

    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    metrics: dict[str, float] = field(default_factory=dict)
    prompt_logprobs: list | None = None


class LLM:
    """A loaded model with its tokenizer, ready to generate.

    Args:
        model: a model key (``memra.hub.MODELS``, e.g. ``"smollm2-135m"``), a GGUF path, or a
            Hugging Face directory (``config.json``, safetensors weights, ``tokenizer.json``).
        dtype: compute dtype: ``"float32"`` (the CPU default, exact) or ``"bfloat16"`` (the
            only one, and the default, on a GPU: ``device="cuda"`` in ``engine_options``).
        max_model_len: context length to allow (default: the model's).
        progress: show a progress bar while loading.
        **engine_options: further :class:`~memra.engine.engine.EngineConfig` fields
            (``max_num_seqs``, ``max_num_batched_tokens``, ``kv_cache_blocks``, ...).

    Raises:
        FileNotFoundError, CheckpointError, ConfigError: the model cannot be loaded.
        TokenizerError: the tokenizer cannot be built (a HF directory needs ``tokenizer.json``).
        ValueError: unknown dtype, or max_model_len out of range.
    """

    def __init__(self, model: str | Path, dtype: str | None = None, max_model_len: int | None = None,
                 progress: bool = False, **engine_options):
        self._attach(LLMEngine(EngineConfig(model=str(model), dtype=dtype, max_model_len=max_model_len,
                                            **engine_options), progress=progress))

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> LLM:
        """An :class:`LLM` over an already built engine (for example one built with ``model=`` to
        share loaded weights between engines of different settings)."""
        self = cls.__new__(cls)
        self._attach(engine)
        return self

    def _attach(self, engine: LLMEngine) -> None:
        self.engine = e = engine
        self.model, self.checkpoint, self.tokenizer, self.config = e.model, e.checkpoint, e.tokenizer, e.config
        self.eos_ids, self.max_model_len, self.load_seconds = e.eos_ids, e.max_model_len, e.load_seconds
        self._next_id = 0
        self.last_metrics: dict[str, float] = {}

    def close(self) -> None:
        """Stops the worker ranks of a tensor-parallel engine (idempotent; nothing to do otherwise)."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ----------------------------------------------------------------- API
    def encode_prompt(self, prompt: str | Sequence[int] | dict) -> list[int]:
        """Token ids of a prompt given as text (special tokens parsed, bos added per the model), as ids,
        or as vLLM's dict forms ``{"prompt": text}`` / ``{"prompt_token_ids": [ids]}``.

        Raises:
            ValueError: empty prompt, a token id outside the vocabulary, a dict without exactly one
                of those keys, or ids that are not integers.
        """
        if isinstance(prompt, dict):
            keys = set(prompt) & {"prompt", "prompt_token_ids"}
            if len(keys) != 1 or set(prompt) - keys:
                raise ValueError(f"a dict prompt holds exactly one of 'prompt' (text) or 'prompt_token_ids' "
                                 f"(ids), got keys {sorted(prompt)}")
            key = keys.pop()
            prompt = prompt[key]
            if key == "prompt" and not isinstance(prompt, str):
                raise ValueError(f"a dict prompt's 'prompt' must be text (str), got {type(prompt).__name__}; "
                                 f"token ids go under 'prompt_token_ids'")
            if key == "prompt_token_ids" and isinstance(prompt, (str, bytes)):
                raise ValueError("a dict prompt's 'prompt_token_ids' must be a list of integer token ids, got "
                                 "text; text goes under 'prompt'")
        if isinstance(prompt, str):
            return self.engine.encode_prompt(prompt)
        items = _as_list(prompt, "a prompt is text (str), a list of integer token ids or a dict "
                                 "({'prompt': text} / {'prompt_token_ids': ids})")
        ids = []
        for t in items:
            if not _is_token_id(t):
                raise ValueError(f"token ids must be integers, got {t!r} ({type(t).__name__})")
            ids.append(operator.index(t))  # int, numpy and torch integer scalars
        return self.engine.encode_prompt(ids)

    def generate(self, prompts: str | Sequence[int] | dict | Sequence[str | Sequence[int] | dict],
                 params: SamplingParams | Sequence[SamplingParams] | None = None, prompt_logprobs: int | None = None) -> list[RequestOutput]:
        """Complete each prompt; all prompts run together in the engine's batches.

        Args:
            prompts: one prompt or a list; a prompt is text, a list of token ids, or a dict
                (:meth:`encode_prompt`).
            params: sampling parameters (default: ``SamplingParams()``), or a list of them, one per
                prompt (as vLLM).
            prompt_logprobs: also return the top-k logprobs of each prompt token.
        Returns:
            One :class:`RequestOutput` per prompt, in order.
        Raises:
            ValueError / PromptTooLongError: bad prompt or params (nothing is run if any is bad).
        """
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        else:
            prompts = _as_list(prompts, "prompts: expected text (str), token ids, a dict prompt or a list of those")
            if prompts and _is_token_id(prompts[0]):
                prompts = [prompts]  # one prompt of token ids
        if params is None:
            params = SamplingParams()
        if isinstance(params, SamplingParams):
            per_prompt = [params] * len(prompts)
        elif isinstance(params, (list, tuple)) and all(isinstance(q, SamplingParams) for q in params):
            if len(params) != len(prompts):
                raise ValueError(f"params: {len(params)} SamplingParams for {len(prompts)} prompts (one each, or one "
                                 f"for all)")
            per_prompt = list(params)
        else:
            raise ValueError(f"params: expected a SamplingParams or a list of them (one per prompt), got "
                             f"{type(params).__name__}")
        ids = [self.encode_prompt(p) for p in prompts]
        for x, q in zip(ids, per_prompt):
            self.engine.validate(x, q)
        rids = []
        for x, q in zip(ids, per_prompt):
            rids.append(self._new_id())
            self.engine.add_request(rids[-1], x, q, prompt_logprobs=prompt_logprobs)
        results = {rid: RequestOutput(p if isinstance(p, str) else p.get("prompt") if isinstance(p, dict) else None, x,
                                      [CompletionOutput(j, logprobs=[] if q.logprobs is not None else None)
                                       for j in range(q.n)])
                   for rid, p, x, q in zip(rids, prompts, ids, per_prompt)}
        t0 = time.perf_counter()
        s0 = self.engine.stats()
        try:
            for ev in self._events():
                res = results.get(ev.request_id)
                if res is None:
                    continue
                if ev.prompt_logprobs is not None:
                    res.prompt_logprobs = ev.prompt_logprobs
                for d in ev.deltas:
                    _accumulate(res.outputs, d)
        finally:
            for rid in rids:
                self.engine.abort_request(rid)
        self._record(s0, time.perf_counter() - t0)
        for r in results.values():
            r.metrics = self.last_metrics
        return [results[rid] for rid in rids]

    def stream(self, prompt: str | Sequence[int], params: SamplingParams | None = None) -> Iterator[str]:
        """Yield the completion text of one prompt piece by piece (``params.n`` must be 1). Afterwards
        ``last_metrics`` holds the timings, ``completion_tokens``, ``finish_reason`` ("stop",
        "length") and ``stop_reason`` (the stop string or token id, if one ended it)."""
        params = params or SamplingParams()
        if params.n != 1:
            raise ValueError("stream() produces one completion: use n=1")
        ids = self.encode_prompt(prompt)
        rid = self._new_id()
        self.engine.add_request(rid, ids, params)
        t0 = time.perf_counter()
        t_first, n = None, 0
        finish: tuple = (None, None)
        try:
            for ev in self._events():
                for d in ev.deltas:
                    n += len(d.token_ids)
                    if d.finish_reason is not None:
                        finish = (d.finish_reason, d.stop_reason)
                    if t_first is None:
                        t_first = time.perf_counter()
                    if d.text:
                        yield d.text
        finally:
            self.engine.abort_request(rid)
            t_end = time.perf_counter()
            self.last_metrics = {"prompt_tokens": len(ids), "ttft_s": (t_first or t_end) - t0,
                                 "decode_tokens": max(0, n - 1), "decode_s": t_end - (t_first or t_end),
                                 "completion_tokens": n, "finish_reason": finish[0], "stop_reason": finish[1]}

    def chat(self, messages: list[dict], params: SamplingParams | None = None, **template_kwargs) -> RequestOutput:
        """Complete a conversation rendered through the model's chat template."""
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, **template_kwargs)
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        return self.generate([ids], params)[0]

    # ------------------------------------------------------------ helpers
    def _events(self):
        """Step the engine until it is idle, yielding its events; a failed request raises RuntimeError."""
        while self.engine.has_unfinished():
            events = self.engine.step()
            for rid, e in self.engine.pop_failures():
                raise RuntimeError(f"request {rid} failed in the engine: {e!r}") from e
            yield from events

    def _new_id(self) -> str:
        self._next_id += 1
        return f"llm-{self._next_id}"

    def _record(self, s0, seconds: float) -> None:
        s1 = self.engine.stats()
        self.last_metrics = {"prompt_tokens_computed": s1.num_prompt_tokens_computed - s0.num_prompt_tokens_computed,
                             "generated_tokens": s1.num_generation_tokens - s0.num_generation_tokens,
                             "steps": s1.num_steps - s0.num_steps, "seconds": seconds}


def _accumulate(outs: list[CompletionOutput], d) -> None:
    """Fold one :class:`~memra.engine.request.CompletionDelta` into its completion."""
    o = outs[d.index]
    o.text += d.text
    o.token_ids.extend(d.token_ids)
    if o.logprobs is not None and d.logprobs:
        o.logprobs.extend(d.logprobs)
    if d.finish_reason is not None:
        o.finish_reason, o.stop_reason = d.finish_reason, d.stop_reason


def _is_token_id(t) -> bool:
    """An integer token id: int, numpy or torch integer scalar (not bool, float or text)."""
    if isinstance(t, (bool, float, str, bytes)):
        return False
    try:
        operator.index(t)
    except TypeError:
        return False
    return True


def _as_list(x, what: str) -> list:
    """``x`` as a list if it is an ordered sequence (list, tuple, 1-D+ tensor or array, other
    iterables but sets); raises ValueError starting with ``what`` otherwise."""
    if x is None or isinstance(x, (str, bytes, set, frozenset, dict)) or not isinstance(x, Iterable):
        raise ValueError(f"{what}, got {type(x).__name__}")
    try:
        return list(x)
    except TypeError:  # e.g. a 0-d tensor or array
        raise ValueError(f"{what}, got a scalar {type(x).__name__}") from None
