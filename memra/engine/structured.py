"""Structured output: grammar-constrained decoding with llguidance.

A :class:`Grammar` (compiled once per request, off the engine's step loop: the server compiles
in a worker thread before it submits the request) hands each of the request's sequences a
:class:`Matcher`. Before every sampled token the sampler masks the logits to the tokens the
grammar allows (:meth:`Matcher.allowed`); after it, the token advances the matcher. Where the
grammar may end, the model's end-of-generation ids are allowed (and only they once it must
end); an end id finishes the sequence as usual and is not fed to the matcher.

Backend: llguidance (MIT, no dependencies; Lark grammars with embedded JSON schemas, JSON
schema, regex). Chosen over xgrammar on this project's 2-core CPU: ~1-3 ms per grammar compile
against 12-80 ms, no torch/transformers import, and a stable 1.x API; its masks are ~1.7-2.5x
slower (30-60 µs per token mean on the smollm2 / qwen2.5 vocabularies), far below a decode step
(benchmarks/grammar_backends.py, benchmarks/results/grammar-backends-cpu.json).

Errors: :class:`GrammarError` (a ValueError) names what the grammar or schema got wrong,
including JSON-schema features llguidance does not support; the server answers it with 400.
"""

from __future__ import annotations

import json
import threading
from typing import Any

import numpy as np
import torch

__all__ = ["Grammar", "GrammarBackend", "GrammarError", "Matcher"]


class GrammarError(ValueError):
    """A grammar, schema or regex that cannot be compiled (the message says why)."""


class GrammarBackend:
    """llguidance over one tokenizer: builds grammars for it.

    Args:
        tokenizer: memra :class:`~memra.io.tokenizer.Tokenizer` (its HF ``backend`` is read).
        vocab_size: the model's logits width (may exceed the tokenizer's: padding rows are never allowed).
        end_ids: the model's end-of-generation ids (allowed where the grammar may end).

    The llguidance tokenizer is built on first use (0.4 s for a 49k vocabulary, 1.5 s for 152k).
    Raises: GrammarError if the tokenizer has no vocabulary.
    """

    def __init__(self, tokenizer, vocab_size: int, end_ids: list[int]):
        self.tokenizer, self.vocab_size, self.end_ids = tokenizer, vocab_size, sorted(set(end_ids))
        self._llg_tok = None
        self._lock = threading.Lock()

    def _tok(self):
        with self._lock:
            if self._llg_tok is None:
                import llguidance

                backend = getattr(self.tokenizer, "backend", None)
                if backend is None or not self.end_ids:
                    raise GrammarError("structured output needs a model with a vocabulary and an end-of-text "
                                       "token")
                self._llg_tok = llguidance.LLTokenizer(backend.to_str(), n_vocab=self.vocab_size,
                                                       eos_token=self.end_ids[0])
            return self._llg_tok

    def is_single_token(self, text: str) -> bool:
        """Whether ``text`` is one added token of the vocabulary (grammars must then name it as a
        token, ``<text>``, besides spelling it: llguidance treats added tokens as special)."""
        try:
            ids = self.tokenizer.encode(text, add_special_tokens=False)
        except Exception:  # noqa: BLE001 - any tokenizer failure: treat as text
            return False
        return len(ids) == 1 and len(text) > 1 and text.startswith("<") and text.endswith(">")

    def literal(self, text: str) -> str:
        """A Lark expression matching ``text``: the quoted string, or also the token when it is one."""
        q = json.dumps(text)
        return f"({text} | {q})" if self.is_single_token(text) else q

    def _compile(self, what: str, make) -> Grammar:
        import llguidance

        tok = self._tok()
        try:
            grammar = make(llguidance.LLMatcher)
        except (ValueError, TypeError, RuntimeError) as e:
            raise GrammarError(f"{what}: {e}") from None
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tok)
        if is_error:
            raise GrammarError(f"{what}: {messages[0] if messages else 'invalid grammar'}")
        return Grammar(self, grammar, what)

    #: JSON layout of constrained output: ``json.dumps``'s separators, no other whitespace (a
    #: model cannot pad the output with blank lines until max_tokens); a schema's ``x-guidance``
    #: key overrides it.
    JSON_LAYOUT = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}

    def json_schema(self, schema: dict[str, Any], what: str = "json_schema") -> Grammar:
        """Output that is one JSON value valid under ``schema`` (``{"type": "object"}``: any object),
        laid out as :data:`JSON_LAYOUT`, integers without bounds held to 16 digits
        (:func:`bounded_integers`)."""
        if not isinstance(schema, dict):
            raise GrammarError(f"{what}: a JSON schema must be an object, got {type(schema).__name__}")
        return self._compile(what, lambda M: M.grammar_from_json_schema(json.dumps(bounded_integers(schema)),
                                                                          defaults=self.JSON_LAYOUT))

    def lark(self, grammar: str, what: str = "grammar") -> Grammar:
        """Output in the language of a Lark grammar (llguidance's dialect: ``%json {...}`` embeds a schema)."""
        return self._compile(what, lambda M: M.grammar_from_lark(grammar))

    def regex(self, pattern: str, what: str = "regex") -> Grammar:
        return self._compile(what, lambda M: M.grammar_from_regex(pattern))

    def choice(self, options: list[str], what: str = "choice") -> Grammar:
        """Exactly one of the strings ``options``."""
        if not options or not all(isinstance(o, str) for o in options):
            raise GrammarError(f"{what}: expected a non-empty list of strings")
        # one lexeme (a terminal), not a rule of N alternatives: the parser's row limit is 2000 items
        return self.lark("start: CHOICE\nCHOICE: " + " | ".join(json.dumps(o) for o in options), what)


INT_DIGITS = 16  # as llama.cpp's json-schema-to-grammar: a model cannot loop on one digit until max_tokens


def bounded_integers(schema: Any) -> Any:
    """``schema`` with ``minimum`` / ``maximum`` of +-(10**16 - 1) on every integer schema that has
    neither bound (a constrained model that repeats a digit would otherwise run to max_tokens and
    return JSON cut in the middle)."""
    if isinstance(schema, list):
        return [bounded_integers(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    # one walk: maps of subschemas (properties, $defs, ...) are recursed into like schemas (a map has
    # no "type" of its own, so nothing is added to it)
    out = {k: bounded_integers(v) if isinstance(v, (dict, list)) and k not in ("enum", "const", "default", "examples")
           else v for k, v in schema.items()}
    t = schema.get("type")
    if (t == "integer" or t == ["integer"]) and not any(k in schema for k in (
            "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")):
        out["minimum"], out["maximum"] = -(10 ** INT_DIGITS - 1), 10 ** INT_DIGITS - 1
    return out


class Grammar:
    """A validated grammar for one request; :meth:`matcher` gives each sequence its own state."""

    def __init__(self, backend: GrammarBackend, grammar: str, what: str):
        self.backend, self.grammar, self.what = backend, grammar, what

    def matcher(self) -> Matcher:
        return Matcher(self)


class Matcher:
    """The grammar state of one sequence (module docstring)."""

    def __init__(self, grammar: Grammar):
        import llguidance
        import llguidance.numpy as lnp

        b = grammar.backend
        self.m = llguidance.LLMatcher(b._tok(), grammar.grammar, log_level=0)
        if self.m.is_error():
            raise GrammarError(f"{grammar.what}: {self.m.get_error()}")
        self.vocab_size, self.end_ids = b.vocab_size, torch.tensor(b.end_ids, dtype=torch.long)
        self._end_set = set(b.end_ids)
        self._lnp = lnp
        self._bits = lnp.allocate_token_bitmask(1, self.vocab_size)

    def allowed(self) -> torch.Tensor:
        """bool [vocab_size]: the tokens the grammar allows next (the end ids where it may end).

        Raises: GrammarError if the matcher is in an error state (a token it rejected)."""
        if self.m.is_error():
            raise GrammarError(f"structured output: {self.m.get_error()}")
        self._lnp.fill_next_token_bitmask(self.m, self._bits)
        bits = np.unpackbits(self._bits.view(np.uint8), bitorder="little")[: self.vocab_size]
        mask = torch.from_numpy(bits.astype(np.bool_))
        if self.m.is_accepting() or self.m.is_stopped():
            mask[self.end_ids] = True
        elif self.end_ids.numel():
            mask[self.end_ids] = False
        return mask

    def advance(self, token: int) -> None:
        """Feed the chosen ``token`` (end ids are not fed). Raises GrammarError if it is rejected."""
        if token in self._end_set:
            return
        if not self.m.consume_token(token):
            raise GrammarError(f"structured output: token {token} rejected: {self.m.get_error()}")
