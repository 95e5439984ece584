"""The offline Python API: ``LLM(model).generate(prompts, params)``.

One request runs as: tokenize -> prefill the whole prompt once (K/V of every prompt
token cached) -> one token per decode step (only the new token goes through the
model) -> sample -> detokenize and check stop conditions.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

import torch

from ..hub import resolve_model
from ..io.tokenizer import Tokenizer
from ..models import load_model
from .kv_cache import ContiguousKVCache
from .output import CompletionOutput, OutputProcessor
from .sampling import Sampler, SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams", "PromptTooLongError"]

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


class PromptTooLongError(ValueError):
    """Prompt tokens plus max_tokens exceed the model's context length."""


@dataclass
class RequestOutput:
    """Result of one prompt: the prompt, its token ids and ``n`` completions."""

    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    metrics: dict[str, float] = field(default_factory=dict)


class LLM:
    """A loaded model with its tokenizer, ready to generate.

    Args:
        model: a model key (``memra.hub.MODELS``, e.g. ``"smollm2-135m"``), a GGUF path, or a
            Hugging Face directory (``config.json``, safetensors weights, ``tokenizer.json``).
        dtype: compute dtype on the CPU: ``"float32"`` (default, exact) or ``"bfloat16"``.
        max_model_len: context length to allow (default: the model's).
        progress: show a progress bar while loading.

    Raises:
        FileNotFoundError, CheckpointError, ConfigError: the model cannot be loaded.
        TokenizerError: the tokenizer cannot be built (a HF directory needs ``tokenizer.json``).
        ValueError: unknown dtype, or max_model_len out of range.
    """

    def __init__(self, model: str | Path, dtype: str = "float32", max_model_len: int | None = None,
                 progress: bool = False):
        if dtype not in _DTYPES:
            raise ValueError(f"unknown dtype {dtype!r} (supported: {', '.join(_DTYPES)})")
        t0 = time.perf_counter()
        local = Path(model).expanduser()
        path = local if local.is_dir() else resolve_model(str(model))  # HF directory, or key / GGUF file
        self.model, self.checkpoint = load_model(path, _DTYPES[dtype], progress=progress)
        self.tokenizer = (Tokenizer.from_hf_dir(path) if path.is_dir()
                          else Tokenizer.from_gguf_metadata(self.checkpoint.metadata))
        self.config = self.model.config
        self.eos_ids = sorted(set(self.tokenizer.eos_token_ids) | set(self.config.eos_token_ids))
        ctx = self.config.max_position_embeddings
        if max_model_len is not None and not (1 <= max_model_len <= ctx):
            raise ValueError(f"max_model_len={max_model_len} must be in [1, {ctx}] (the model's context length)")
        self.max_model_len = max_model_len or ctx
        self.load_seconds = time.perf_counter() - t0

    # ----------------------------------------------------------------- API
    def encode_prompt(self, prompt: str | Sequence[int]) -> list[int]:
        """Token ids of a prompt given as text (special tokens parsed, bos added per the model) or ids.

        Raises:
            ValueError: empty prompt, or a token id outside the vocabulary.
        """
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        if not ids:
            raise ValueError("prompt is empty: it must contain at least one token")
        bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {self.config.vocab_size})")
        return ids

    def generate(self, prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
                 params: SamplingParams | None = None) -> list[RequestOutput]:
        """Complete each prompt.

        Args:
            prompts: one prompt or a list; a prompt is text or a list of token ids.
            params: sampling parameters (default: ``SamplingParams()``).
        Returns:
            One :class:`RequestOutput` per prompt, in order.
        Raises:
            ValueError / PromptTooLongError: bad prompt (see :meth:`encode_prompt`).
        """
        params = params or SamplingParams()
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        results = []
        for prompt in prompts:
            ids = self.encode_prompt(prompt)
            outs = [None] * params.n
            for i, _ in self._run(ids, params, outs):
                pass
            results.append(RequestOutput(prompt if isinstance(prompt, str) else None, ids, outs,
                                         metrics=self.last_metrics))
        return results

    def stream(self, prompt: str | Sequence[int], params: SamplingParams | None = None) -> Iterator[str]:
        """Yield the completion text of one prompt piece by piece (``params.n`` must be 1)."""
        params = params or SamplingParams()
        if params.n != 1:
            raise ValueError("stream() produces one completion: use n=1")
        outs = [None]
        for _, delta in self._run(self.encode_prompt(prompt), params, outs):
            if delta:
                yield delta

    def chat(self, messages: list[dict], params: SamplingParams | None = None, **template_kwargs) -> RequestOutput:
        """Complete a conversation rendered through the model's chat template."""
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, **template_kwargs)
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        return self.generate([ids], params)[0]

    # ------------------------------------------------------------ the loop
    @torch.inference_mode()
    def _run(self, ids: list[int], params: SamplingParams, outs: list) -> Iterator[tuple[int, str]]:
        total = len(ids) + params.max_tokens
        if total > self.max_model_len:
            raise PromptTooLongError(
                f"prompt of {len(ids)} tokens plus max_tokens={params.max_tokens} is {total} tokens, "
                f"more than the context length {self.max_model_len}")
        V = self.config.vocab_size
        bad = [t for t in params.stop_token_ids if t >= V]
        if bad:
            raise ValueError(f"invalid sampling parameter stop_token_ids: id {bad[0]} is outside the vocabulary [0, {V})")
        t0 = time.perf_counter()
        kv = ContiguousKVCache(self.config, total, self.model.dtype)
        hidden = self.model(torch.tensor(ids), torch.arange(len(ids)), kv)
        kv.advance(len(ids))
        first_logits = self.model.logits(hidden[-1])
        t_prefill = time.perf_counter() - t0
        decode_tokens, t_decode = 0, 0.0
        for j in range(params.n):
            cache = kv if j == params.n - 1 else _clone_cache(kv)
            sampler = Sampler(params, ids, V, seed_offset=j)
            proc = OutputProcessor(j, self.tokenizer, params, self.eos_ids, ids)
            logits = first_logits
            pos = len(ids)
            while True:
                r = sampler.sample(logits)
                delta = proc.add(r)
                yield j, delta
                if proc.finished:
                    break
                t1 = time.perf_counter()
                h = self.model(torch.tensor([r.token]), torch.tensor([pos]), cache)
                cache.advance(1)
                logits = self.model.logits(h[-1])
                t_decode += time.perf_counter() - t1
                decode_tokens += 1
                pos += 1
            outs[j] = proc.out
        self.last_metrics = {"prompt_tokens": len(ids), "prefill_s": t_prefill, "decode_tokens": decode_tokens,
                             "decode_s": t_decode}


def _clone_cache(kv: ContiguousKVCache) -> ContiguousKVCache:
    c = ContiguousKVCache.__new__(ContiguousKVCache)
    c.__dict__.update(kv.__dict__)
    c.k = [t.clone() for t in kv.k]
    c.v = [t.clone() for t in kv.v]
    return c
