"""Incremental detokenization: turn a stream of generated token ids into text pieces.

One token is not one character: a byte-level BPE token can hold part of a UTF-8
character (an emoji is often 2-4 tokens), a SentencePiece model spells rare characters
as ``<0xNN>`` byte tokens, and how a token reads can depend on its left neighbour.
Decoding each token alone would emit broken characters (U+FFFD); decoding the whole
sequence each step costs O(n) per token. :class:`IncrementalDetokenizer` keeps two
offsets into the ids, as vLLM and TGI do:

* ``prefix_offset``: start of a short window of already-emitted tokens kept as left
  context;
* ``read_offset``: end of the emitted part.

Each step decodes ``ids[prefix_offset:read_offset]`` and ``ids[prefix_offset:]``; the
new text is what the second adds to the first. If the second ends in U+FFFD (a
character still incomplete), nothing is emitted and the offsets stay, so the window
grows until the character is complete; otherwise both offsets move forward. The pieces
joined equal ``tokenizer.decode(generated_ids)`` (with the same
``skip_special_tokens``), for tokenizers whose decoding of a sequence is the
concatenation of its tokens' bytes (byte-level BPE, and SentencePiece without the
leading-space strip).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

__all__ = ["IncrementalDetokenizer", "PROMPT_CONTEXT_TOKENS"]

#: Prompt tokens kept as left context for the first generated tokens (vLLM uses 5).
PROMPT_CONTEXT_TOKENS = 5

_REPLACEMENT = "\ufffd"


class _Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str: ...


class IncrementalDetokenizer:
    """Streams text for generated token ids without emitting broken UTF-8.

    Args:
        tokenizer: anything with ``decode(ids, skip_special_tokens) -> str`` (a
            :class:`memra.io.tokenizer.Tokenizer`); if it has ``vocab_size``, ids are
            range-checked before they are taken.
        prompt_ids: the prompt's ids; its last :data:`PROMPT_CONTEXT_TOKENS` serve as
            left context (never emitted). None or empty: start with no context.
        skip_special_tokens: drop control tokens (e.g. ``<|im_end|>``) from the text.

    Use :meth:`add` for each generated id and :meth:`flush` at the end; the returned
    pieces concatenated equal ``tokenizer.decode(generated_ids, skip_special_tokens)``.
    A piece never ends inside a character; it holds U+FFFD only where the generated
    bytes themselves are not valid UTF-8 and a later token shows it (or at flush).

    Source: the prefix-offset/read-offset scheme of vLLM's ``detokenize_incrementally``
    and Hugging Face text-generation-inference's ``decode_token``.
    """

    def __init__(self, tokenizer: _Decoder, prompt_ids: Sequence[int] | None = None,
                 skip_special_tokens: bool = False):
        self._tok = tokenizer
        self._skip = bool(skip_special_tokens)
        context = list(prompt_ids[-PROMPT_CONTEXT_TOKENS:]) if prompt_ids else []
        self._check(context, "prompt_ids")
        self._ids: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._n_generated = 0

    def _check(self, ids: Sequence[int], what: str) -> None:
        n = getattr(self._tok, "vocab_size", None)
        for i in ids:
            if isinstance(i, bool) or not isinstance(i, int) or (n is not None and not 0 <= i < n):
                bound = f" in [0, {n})" if n is not None else ""
                raise ValueError(f"{what}: token id {i!r} is not an integer{bound}")

    @property
    def generated_ids(self) -> list[int]:
        """The ids given to :meth:`add` so far (a copy)."""
        return self._ids[len(self._ids) - self._n_generated:]

    def add(self, token_id: int) -> str:
        """Append one generated id; return the text it completes ("" if held back).

        Raises:
            ValueError: ``token_id`` is not an integer (in ``[0, vocab_size)`` when the
                tokenizer has ``vocab_size``); the detokenizer is left unchanged.
        """
        if not isinstance(token_id, int):
            try:
                token_id = token_id.__index__()  # numpy / torch integer scalars
            except (AttributeError, TypeError):
                raise ValueError(f"token id {token_id!r} is not an integer") from None
        self._check((token_id,), "add()")
        self._ids.append(token_id)
        self._n_generated += 1
        prefix_text = self._tok.decode(self._ids[self._prefix_offset:self._read_offset], self._skip)
        new_text = self._tok.decode(self._ids[self._prefix_offset:], self._skip)
        if len(new_text) > len(prefix_text) and not new_text.endswith(_REPLACEMENT):
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            return new_text[len(prefix_text):]
        return ""

    def flush(self) -> str:
        """Return whatever is held back (an incomplete character comes out as U+FFFD)
        and mark everything as emitted."""
        prefix_text = self._tok.decode(self._ids[self._prefix_offset:self._read_offset], self._skip)
        new_text = self._tok.decode(self._ids[self._prefix_offset:], self._skip)
        self._prefix_offset = self._read_offset = len(self._ids)
        return new_text[len(prefix_text):]
