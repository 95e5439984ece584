"""Tokenizers built from GGUF metadata, run by the Hugging Face ``tokenizers`` library.

A GGUF file carries its tokenizer as metadata under llama.cpp's key names
(``tokenizer.ggml.*``): the token strings, their types, BPE merges or SentencePiece
scores, the special token ids, the pre-tokenizer name and the chat template.
:class:`Tokenizer` turns those into a ``tokenizers.Tokenizer`` pipeline that
reproduces llama.cpp's tokenization (``llama-vocab.cpp``), and adds memra's API on
top: ``encode``/``decode``, special ids, end-of-generation ids and chat templates.

Two tokenizer models (``tokenizer.ggml.model``) are supported:

``gpt2`` (byte-level BPE, llama.cpp ``LLAMA_VOCAB_TYPE_BPE``)
    Tokens are spelled in GPT-2's byte alphabet (``Ġ`` is a space); the file lists the
    merges in rank order. Text is cut into words by the regular expressions that
    llama.cpp's ``llm_tokenizer_bpe`` applies for the file's ``tokenizer.ggml.pre``
    (see :data:`BPE_PRE_TOKENIZERS`), each regex applied to the pieces the previous
    one left, matches and gaps both kept; then every word is mapped to byte-alphabet
    characters and merged. Decoding maps the byte alphabet back to bytes.

``llama`` (SentencePiece-style, llama.cpp ``LLAMA_VOCAB_TYPE_SPM``; Gemma, Llama 2)
    Spaces become ``▁`` (U+2581); there is no word splitting. The file lists no
    merges, only a score per token: llama.cpp's ``llm_tokenizer_spm`` repeatedly joins
    the adjacent pair whose concatenation is the best-scoring token. That is BPE
    whose merge list is every way of cutting each token in two, ranked by the
    token's score, which is what is built here. Characters no token covers fall back
    to the byte tokens ``<0x00>``..``<0xFF>``.

In both, control tokens (type 3, e.g. ``<|im_start|>``) and user-defined tokens
(type 4, e.g. ``<tool_call>``, Gemma's ``"\\n\\n"`` or runs of spaces) are matched whole
in the raw text before anything else, longest first, as llama.cpp's
``tokenizer_st_partition`` does; control tokens count as special (dropped by
``decode(..., skip_special_tokens=True)``), user-defined ones do not. Unused tokens
(type 5, e.g. Qwen's ``[PAD151665]``) are never matched in text.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers
from tokenizers import Tokenizer as _HFTokenizer
from tokenizers.models import BPE

__all__ = [
    "TokenizerError",
    "Tokenizer",
    "NoVocabTokenizer",
    "TokenType",
    "BPE_PRE_TOKENIZERS",
    "SUPPORTED_TOKENIZER_MODELS",
    "EOG_TOKEN_TEXTS",
]


class TokenizerError(ValueError):
    """GGUF tokenizer metadata is missing, inconsistent or of an unsupported kind.

    The message names the metadata key and what was expected.
    """


class TokenType:
    """GGUF token types (``tokenizer.ggml.token_type``), llama.cpp ``llama_token_type``."""

    UNDEFINED = 0
    NORMAL = 1
    UNKNOWN = 2
    CONTROL = 3
    USER_DEFINED = 4
    UNUSED = 5
    BYTE = 6


# --- pre-tokenizer regexes (llama.cpp llama-vocab.cpp, llm_tokenizer_bpe constructor) ---

# GPT-2's word pattern: contractions, optional space + letters, optional space + digits,
# optional space + other symbols, whitespace not followed by a non-space, whitespace.
_GPT2_WORDS = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"

# Qwen2: case-insensitive contractions, letters with one leading non-letter/digit
# (not a newline), single digits, symbols with trailing newlines, newline runs.
_QWEN2_WORDS = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Llama 3: as Qwen2 but digits in groups of up to three.
_LLAMA3_WORDS = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

#: ``tokenizer.ggml.pre`` value -> (regexes applied in sequence, ignore_merges, add_bos default).
#: Source: llama.cpp ``llama_vocab::impl::load`` (pre-type by name, ``tokenizer_add_bos``,
#: ``tokenizer_ignore_merges``) and the ``llm_tokenizer_bpe`` constructor (regexes per
#: ``LLAMA_VOCAB_PRE_TYPE_*``). ``ignore_merges``: a word that is itself a token is
#: taken whole before merging (llama3).
BPE_PRE_TOKENIZERS: dict[str, tuple[tuple[str, ...], bool, bool]] = {
    # LLAMA_VOCAB_PRE_TYPE_GPT2: llama.cpp's name is "gpt-2" (it refuses "gpt2"); "gpt2" is
    # what memra's synthetic step35 files wrote before 2026-12 and is still read the same way.
    "gpt-2": ((_GPT2_WORDS,), False, False),
    "gpt2": ((_GPT2_WORDS,), False, False),
    # LLAMA_VOCAB_PRE_TYPE_SMOLLM / _STARCODER: every digit alone first, then GPT-2 words
    "smollm": ((r"\p{N}", _GPT2_WORDS), False, False),
    "starcoder": ((r"\p{N}", _GPT2_WORDS), False, False),
    # LLAMA_VOCAB_PRE_TYPE_QWEN2
    "qwen2": ((_QWEN2_WORDS,), False, False),
    "deepseek-r1-qwen": ((_QWEN2_WORDS,), False, False),
    # LLAMA_VOCAB_PRE_TYPE_LLAMA3
    "llama3": ((_LLAMA3_WORDS,), True, True),
    "llama-v3": ((_LLAMA3_WORDS,), True, True),
    "llama-bpe": ((_LLAMA3_WORDS,), True, True),
}

#: ``tokenizer.ggml.model`` values memra can build.
SUPPORTED_TOKENIZER_MODELS = ("gpt2", "llama")

#: ``tokenizer.ggml.model`` values that mean "no vocabulary" (llama.cpp ``llama_vocab::impl::load``:
#: ``no_vocab`` / ``none`` -> ``LLAMA_VOCAB_TYPE_NONE``; benchmark files are often written so).
NO_VOCAB_MODELS = ("none", "no_vocab")

#: Token texts llama.cpp treats as end of generation whenever they are in the vocabulary
#: (``llama_vocab::impl::load``, "maintain a list of tokens that cause end-of-generation").
EOG_TOKEN_TEXTS = (
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "<|end_of_text|>",
    "<end_of_utterance>",
)

# Fill-in-the-middle pad / repository / file-separator tokens, which llama.cpp also adds to
# the end-of-generation set (same source, special_fim_pad_id / _rep_id / _sep_id).
_FIM_EOG_TOKEN_TEXTS = (
    "<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>",
    "<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>",
    "<|file_sep|>",
)


def _check_merges(raw_merges: list, vocab: dict[str, int]) -> None:
    """Raises TokenizerError naming the first GGUF merge that is not two tokens separated by one
    space, or whose tokens or join are not in ``vocab`` (the wording of what tokenizers refuses)."""
    for k, m in enumerate(raw_merges):
        parts = m.split(" ") if isinstance(m, str) else []
        if len(parts) != 2:
            raise TokenizerError(f"GGUF tokenizer.ggml.merges[{k}] = {m!r} is not two tokens separated by one space")
        for piece in (parts[0], parts[1], parts[0] + parts[1]):
            if piece not in vocab:
                raise TokenizerError(
                    f"GGUF tokenizer.ggml.merges[{k}] = {m!r}: {piece!r} is not a token of the "
                    f"vocabulary (a merge joins two tokens into a third)"
                )


def _meta_list(meta: Mapping[str, Any], key: str, n: int | None, required: bool) -> list | None:
    value = meta.get(key)
    if value is None:
        if required:
            raise TokenizerError(f"GGUF tokenizer metadata lacks {key!r}")
        return None
    if not isinstance(value, (list, tuple)):
        raise TokenizerError(f"GGUF key {key!r} must be an array, got {type(value).__name__}")
    if n is not None and len(value) != n:
        raise TokenizerError(
            f"GGUF key {key!r} has {len(value)} entries, expected one per token ({n} tokens)"
        )
    return list(value)


def _meta_token_id(meta: Mapping[str, Any], key: str, n: int) -> int | None:
    value = meta.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise TokenizerError(f"GGUF key {key!r} must be an integer token id, got {value!r}")
    if not 0 <= value < n:
        raise TokenizerError(f"GGUF key {key!r} = {value} is outside the vocabulary [0, {n})")
    return value


def _meta_bool(meta: Mapping[str, Any], key: str, default: bool) -> bool:
    value = meta.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise TokenizerError(f"GGUF key {key!r} must be a boolean, got {value!r}")
    return value


def _spm_merges(tokens: list[str], scores: list[float], types: list[int]) -> list[tuple[str, str]]:
    """BPE merges equivalent to llama.cpp's score-driven SentencePiece merging.

    Every NORMAL token of two or more characters contributes each cut ``(left, right)``
    whose halves are both mergeable tokens (NORMAL or USER_DEFINED); merges are ranked by
    the joined token's score, best first (llama.cpp ``llm_tokenizer_spm`` picks the
    best-scoring bigram), then by token id, then longer left half first.
    """
    mergeable = {
        t: i for i, (t, ty) in enumerate(zip(tokens, types))
        if ty in (TokenType.NORMAL, TokenType.USER_DEFINED, TokenType.UNDEFINED)
    }
    order = sorted(
        (i for i, (tok, ty) in enumerate(zip(tokens, types)) if ty == TokenType.NORMAL and len(tok) > 1),
        key=lambda i: (-scores[i], i),
    )
    merges: list[tuple[str, str]] = []
    for i in order:
        tok = tokens[i]
        for cut in range(len(tok) - 1, 0, -1):
            left, right = tok[:cut], tok[cut:]
            if left in mergeable and right in mergeable:
                merges.append((left, right))
    return merges


class Tokenizer:
    """A model's tokenizer: text <-> token ids, special tokens, chat template.

    Build with :meth:`from_gguf_metadata` (or :meth:`from_gguf` for a path), or
    :meth:`from_hf_dir` for a Hugging Face directory's ``tokenizer.json``. Encoding
    and decoding run in the ``tokenizers`` library (Rust); this class holds the ids
    and rules that come from the GGUF and from llama.cpp's conventions.

    Attributes:
        model: ``tokenizer.ggml.model`` (``"gpt2"`` or ``"llama"``), or ``"hf"`` for a
            tokenizer read from a HF ``tokenizer.json`` (:meth:`from_hf_dir`).
        pre: ``tokenizer.ggml.pre`` (the BPE pre-tokenizer name; informational for ``llama``).
        name: ``general.name`` of the model, or None; used in error messages.
        bos_token_id, eos_token_id: from ``tokenizer.ggml.bos_token_id`` /
            ``eos_token_id`` (int or None).
        add_bos, add_eos: whether :meth:`encode` adds them when ``add_special_tokens``.
        chat_template: ``tokenizer.chat_template`` (str) or None.
    """

    has_vocab = True  # False on NoVocabTokenizer

    def __init__(
        self,
        backend: _HFTokenizer,
        *,
        tokens: list[str],
        token_types: list[int],
        model: str,
        pre: str | None,
        bos_token_id: int | None,
        eos_token_id: int | None,
        add_bos: bool,
        add_eos: bool,
        chat_template: str | None,
        name: str | None,
        aliases: dict[int, int],
        token_to_id: dict[str, int] | None = None,
    ):
        """Low-level constructor; use :meth:`from_gguf_metadata`. ``token_to_id``: each token text's
        first id, when the caller has it (else computed from ``tokens``)."""
        self._backend = backend
        self._tokens = tokens
        self._types = token_types
        if token_to_id is None:
            token_to_id = {}
            for i, t in enumerate(tokens):
                token_to_id.setdefault(t, i)
        self._token_to_id: dict[str, int] = token_to_id
        self._aliases = aliases  # duplicate token text id -> first id with that text
        self.model = model
        self.pre = pre
        self.name = name
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id
        self.add_bos = add_bos
        self.add_eos = add_eos
        self.chat_template = chat_template
        eog: list[int] = [] if eos_token_id is None else [eos_token_id]
        for text in EOG_TOKEN_TEXTS + _FIM_EOG_TOKEN_TEXTS:
            i = self._token_to_id.get(text)
            if i is not None and i not in eog:
                eog.append(i)
        self._eos_token_ids = eog

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_gguf(cls, path: str | Path) -> Tokenizer:
        """Read a GGUF file's metadata and build its tokenizer.

        Raises:
            FileNotFoundError, memra.io.gguf.CheckpointError: unreadable file.
            TokenizerError: see :meth:`from_gguf_metadata`.
        """
        from .gguf import read_metadata

        return cls.from_gguf_metadata(read_metadata(path))

    @classmethod
    def from_gguf_metadata(cls, meta: Mapping[str, Any]) -> Tokenizer:
        """Build the tokenizer a GGUF file's metadata describes.

        Args:
            meta: GGUF key/values as plain Python (``memra.io.gguf.read_metadata``);
                the ``tokenizer.*`` keys and ``general.name`` are used.

        Returns:
            A :class:`Tokenizer`.

        Raises:
            TokenizerError: ``tokenizer.ggml.model`` is not one of
                :data:`SUPPORTED_TOKENIZER_MODELS`; a ``gpt2`` model's
                ``tokenizer.ggml.pre`` is missing or not in :data:`BPE_PRE_TOKENIZERS`;
                required arrays (tokens; merges for ``gpt2``; scores for ``llama``) are
                missing or of the wrong length; a special token id is out of range;
                the ``tokenizers`` library rejects the vocabulary.

        Source: llama.cpp ``llama_vocab::impl::load`` (vocab types, add_bos defaults,
        special-token handling) and ``llm_tokenizer_bpe`` / ``llm_tokenizer_spm``.
        """
        if not isinstance(meta, Mapping):
            raise TypeError(f"meta must be a mapping of GGUF keys, got {type(meta).__name__}")
        model = meta.get("tokenizer.ggml.model")
        if model in NO_VOCAB_MODELS:
            return NoVocabTokenizer.from_gguf_metadata(meta)
        if model not in SUPPORTED_TOKENIZER_MODELS:
            raise TokenizerError(
                f"GGUF tokenizer.ggml.model is {model!r}; memra supports "
                f"{', '.join(repr(m) for m in SUPPORTED_TOKENIZER_MODELS)}"
            )
        tokens = _meta_list(meta, "tokenizer.ggml.tokens", None, True)
        if not tokens or not all(isinstance(t, str) for t in tokens):
            raise TokenizerError("GGUF key 'tokenizer.ggml.tokens' must be a non-empty list of strings")
        n = len(tokens)
        types = _meta_list(meta, "tokenizer.ggml.token_type", n, False)
        if types is None:  # llama.cpp: every token is NORMAL when the file gives no types
            types = [TokenType.NORMAL] * n
        pre = meta.get("tokenizer.ggml.pre")
        bos = _meta_token_id(meta, "tokenizer.ggml.bos_token_id", n)
        eos = _meta_token_id(meta, "tokenizer.ggml.eos_token_id", n)
        unk = _meta_token_id(meta, "tokenizer.ggml.unknown_token_id", n)
        template = meta.get("tokenizer.chat_template")
        if template is not None and not isinstance(template, str):
            raise TokenizerError(f"GGUF key 'tokenizer.chat_template' must be a string, got {type(template).__name__}")
        name = meta.get("general.name") if isinstance(meta.get("general.name"), str) else None

        vocab: dict[str, int] = {}
        aliases: dict[int, int] = {}
        for i, t in enumerate(tokens):
            first = vocab.setdefault(t, i)
            if first != i:
                aliases[i] = first

        if model == "gpt2":
            if pre not in BPE_PRE_TOKENIZERS:
                what = "is missing" if pre is None else f"is {pre!r}, which memra does not know"
                raise TokenizerError(
                    f"GGUF tokenizer.ggml.pre {what}: byte-level BPE needs the pre-tokenizer "
                    f"its merges were learned with; supported: {', '.join(sorted(BPE_PRE_TOKENIZERS))}"
                )
            regexes, ignore_merges, add_bos_default = BPE_PRE_TOKENIZERS[pre]
            raw_merges = _meta_list(meta, "tokenizer.ggml.merges", None, True)
            # split only: tokenizers' BPE checks that every merge's two tokens and their join are in
            # the vocabulary; on any refusal (a merge not two str parts, or BPE's) _check_merges
            # names the merge at fault (a 128k-merge file loads ~0.2 s sooner than with the check
            # on every start)
            try:
                merges = [(a, b) for a, b in (m.split(" ") for m in raw_merges)]
                bpe = BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False,
                          ignore_merges=ignore_merges)
                refusal = None
            except Exception as e:  # noqa: BLE001 - worded below, outside the except (no chained traceback)
                refusal = e
            if refusal is not None:
                _check_merges(raw_merges, vocab)
                raise TokenizerError(f"GGUF BPE vocabulary/merges rejected by tokenizers: {refusal}")
            backend = _HFTokenizer(bpe)
            backend.pre_tokenizer = pre_tokenizers.Sequence(
                [pre_tokenizers.Split(Regex(r), behavior="isolated", invert=False) for r in regexes]
                + [pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)]
            )
            backend.decoder = decoders.ByteLevel()
            add_space_prefix = False
        else:  # "llama": SentencePiece-style
            scores = _meta_list(meta, "tokenizer.ggml.scores", n, True)
            add_bos_default = True
            add_space_prefix = _meta_bool(meta, "tokenizer.ggml.add_space_prefix", True)
            merges = _spm_merges(tokens, [float(s) for s in scores], types)
            unk_text = tokens[unk] if unk is not None else None
            try:
                bpe = BPE(vocab=vocab, merges=merges, unk_token=unk_text, fuse_unk=True, byte_fallback=True)
            except Exception as e:
                raise TokenizerError(f"GGUF SentencePiece vocabulary rejected by tokenizers: {e}") from None
            backend = _HFTokenizer(bpe)
            steps = [normalizers.Replace(" ", "\u2581")]
            if add_space_prefix:
                # llama.cpp prefixes a space to every raw-text fragment at the start of the
                # text or right after a special token; tokenizers normalizes each fragment
                # between added tokens separately, so Prepend does the same.
                steps.insert(0, normalizers.Prepend("\u2581"))
            backend.normalizer = normalizers.Sequence(steps)
            dec = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
            if add_space_prefix:
                dec.append(decoders.Strip(" ", 1, 0))
            backend.decoder = decoders.Sequence(dec)

        # Control and user-defined tokens are matched whole in the raw text.
        control = [
            AddedToken(t, special=True, normalized=False)
            for t, ty in zip(tokens, types) if ty == TokenType.CONTROL and t
        ]
        user = [
            AddedToken(t, special=False, normalized=False)
            for t, ty in zip(tokens, types) if ty == TokenType.USER_DEFINED and t
        ]
        if control:
            backend.add_special_tokens(control)
        if user:
            backend.add_tokens(user)
        if backend.get_vocab_size(with_added_tokens=True) != len(vocab):
            raise TokenizerError(
                "tokenizers assigned new ids to GGUF special tokens; the vocabulary is inconsistent"
            )

        add_bos = _meta_bool(meta, "tokenizer.ggml.add_bos_token", add_bos_default)
        add_eos = _meta_bool(meta, "tokenizer.ggml.add_eos_token", False)
        if add_bos and bos is None:
            raise TokenizerError("GGUF asks to add a BOS token but has no tokenizer.ggml.bos_token_id")
        if add_eos and eos is None:
            raise TokenizerError("GGUF asks to add an EOS token but has no tokenizer.ggml.eos_token_id")
        return cls(
            backend,
            tokens=tokens,
            token_types=types,
            model=model,
            pre=pre if isinstance(pre, str) else None,
            bos_token_id=bos,
            eos_token_id=eos,
            add_bos=add_bos,
            add_eos=add_eos,
            chat_template=template,
            name=name,
            aliases=aliases,
            token_to_id=vocab,
        )

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> Tokenizer:
        """Build the tokenizer of a Hugging Face model directory from its ``tokenizer.json``.

        ``tokenizer_config.json`` (optional) gives ``bos_token`` / ``eos_token`` (text or
        ``{"content": ...}``), ``add_bos_token`` / ``add_eos_token`` and ``chat_template``
        (else ``chat_template.jinja``). Without ``add_bos_token``, BOS is added when the
        tokenizer's own post-processor adds it. Added tokens marked special count as
        control tokens, other added tokens as user-defined; the rest are normal.

        Raises:
            TokenizerError: no ``tokenizer.json``, a file the ``tokenizers`` library rejects,
                invalid ``tokenizer_config.json``, ids with gaps, or a BOS/EOS text that is
                not a token.

        Source: transformers' ``PreTrainedTokenizerFast`` conventions (tokenizer.json +
        tokenizer_config.json).
        """
        import json

        d = Path(path)
        tj = d / "tokenizer.json"
        if not tj.is_file():
            raise TokenizerError(f"{d}: no tokenizer.json (memra reads HF tokenizers from tokenizer.json)")
        try:
            backend = _HFTokenizer.from_file(str(tj))
        except Exception as e:
            raise TokenizerError(f"{tj}: rejected by the tokenizers library: {e}") from None
        cfg: dict[str, Any] = {}
        tc = d / "tokenizer_config.json"
        if tc.is_file():
            try:
                cfg = json.loads(tc.read_text(encoding="utf-8"))
            except json.JSONDecodeError as e:
                raise TokenizerError(f"{tc}: not valid JSON ({e})") from None
            if not isinstance(cfg, dict):
                raise TokenizerError(f"{tc}: expected a JSON object")
        vocab = backend.get_vocab(with_added_tokens=True)
        n = max(vocab.values()) + 1 if vocab else 0
        tokens: list[str | None] = [None] * n
        for t, i in vocab.items():
            tokens[i] = t
        if n == 0 or any(t is None for t in tokens):
            missing = next((i for i, t in enumerate(tokens) if t is None), 0)
            raise TokenizerError(f"{tj}: token ids are not contiguous (no token has id {missing})")
        types = [TokenType.NORMAL] * n
        for i, added in backend.get_added_tokens_decoder().items():
            types[i] = TokenType.CONTROL if added.special else TokenType.USER_DEFINED

        def token_id(key: str) -> int | None:
            v = cfg.get(key)
            if isinstance(v, dict):
                v = v.get("content")
            if v is None:
                return None
            if not isinstance(v, str) or v not in vocab:
                raise TokenizerError(f"{tc}: {key} = {v!r} is not a token of tokenizer.json")
            return vocab[v]

        def flag(key: str, default: bool) -> bool:
            v = cfg.get(key, default)
            if not isinstance(v, bool):
                raise TokenizerError(f"{tc}: {key} must be a boolean, got {v!r}")
            return v

        bos, eos = token_id("bos_token"), token_id("eos_token")
        if "add_bos_token" in cfg:
            add_bos = flag("add_bos_token", False)
        else:  # does the tokenizer's own post-processor add it?
            with_special = backend.encode("a", add_special_tokens=True).ids
            add_bos = bos is not None and bool(with_special) and with_special[0] == bos and \
                backend.encode("a", add_special_tokens=False).ids[:1] != [bos]
        template = cfg.get("chat_template")
        if template is None and (d / "chat_template.jinja").is_file():
            template = (d / "chat_template.jinja").read_text(encoding="utf-8")
        if template is not None and not isinstance(template, str):
            raise TokenizerError(f"{tc}: chat_template must be a string (named templates are not supported)")
        add_eos = flag("add_eos_token", False)
        if add_bos and bos is None:
            raise TokenizerError(f"{tc}: add_bos_token is set but there is no bos_token")
        if add_eos and eos is None:
            raise TokenizerError(f"{tc}: add_eos_token is set but there is no eos_token")
        return cls(backend, tokens=tokens, token_types=types, model="hf", pre=None, bos_token_id=bos,
                   eos_token_id=eos, add_bos=add_bos, add_eos=add_eos, chat_template=template,
                   name=cfg.get("name_or_path") if isinstance(cfg.get("name_or_path"), str) else None, aliases={})

    # ------------------------------------------------------------------ properties

    @property
    def vocab_size(self) -> int:
        """Number of tokens in the GGUF vocabulary (ids are ``0..vocab_size-1``)."""
        return len(self._tokens)

    @property
    def eos_token_ids(self) -> list[int]:
        """Every end-of-generation id: the EOS id first, then the tokens llama.cpp treats
        as EOG by their text (:data:`EOG_TOKEN_TEXTS`, e.g. ``<|im_end|>``,
        ``<|endoftext|>``, ``<end_of_turn>``, ``<|eot_id|>``) and the fill-in-the-middle
        pad/repo/file-separator tokens, where present. A new list each call."""
        return list(self._eos_token_ids)

    @property
    def bos_token(self) -> str:
        """Text of the BOS token, or ``""`` if there is none (as chat templates expect)."""
        return "" if self.bos_token_id is None else self._tokens[self.bos_token_id]

    @property
    def eos_token(self) -> str:
        """Text of the EOS token, or ``""`` if there is none."""
        return "" if self.eos_token_id is None else self._tokens[self.eos_token_id]

    @property
    def special_token_ids(self) -> frozenset[int]:
        """Ids of control tokens (type 3): the ones ``skip_special_tokens`` drops."""
        return frozenset(i for i, ty in enumerate(self._types) if ty == TokenType.CONTROL)

    @property
    def backend(self) -> _HFTokenizer:
        """The underlying ``tokenizers.Tokenizer`` (do not mutate)."""
        return self._backend

    # ------------------------------------------------------------------ encode / decode

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``.

        Args:
            text: any Unicode text; control/user-defined token texts in it (e.g.
                ``"<|im_start|>"``) become those tokens.
            add_special_tokens: add BOS (and EOS) when the GGUF says so
                (``tokenizer.ggml.add_bos_token``; default True for ``llama``
                vocabularies and llama3 BPE, False otherwise, as in llama.cpp).

        Raises:
            TypeError: ``text`` is not a str.
        """
        if not isinstance(text, str):
            raise TypeError(f"encode() takes a str, got {type(text).__name__}")
        ids = self._backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens:
            if self.add_bos:
                ids.insert(0, self.bos_token_id)
            if self.add_eos:
                ids.append(self.eos_token_id)
        return ids

    def _check_ids(self, ids: Sequence[int]) -> list[int]:
        n = len(self._tokens)
        out = []
        for k, i in enumerate(ids):
            if isinstance(i, bool) or not isinstance(i, int):
                try:
                    i = int(i.__index__())  # numpy / torch integer scalars
                except (AttributeError, TypeError):
                    raise TypeError(f"token ids must be integers; ids[{k}] is {i!r}") from None
            if not 0 <= i < n:
                raise ValueError(f"token id {i} (ids[{k}]) is outside the vocabulary [0, {n})")
            out.append(self._aliases.get(i, i))
        return out

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text of token ids.

        Byte-level tokens are mapped back to bytes, ``▁`` to spaces and ``<0xNN>``
        tokens to bytes; byte sequences that are not valid UTF-8 (e.g. a character
        cut between tokens) come out as U+FFFD. Control tokens appear as their text
        unless ``skip_special_tokens``.

        Raises:
            TypeError: an id is not an integer.
            ValueError: an id is outside ``[0, vocab_size)``.
        """
        return self._backend.decode(self._check_ids(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, i: int) -> str:
        """The GGUF spelling of token ``i`` (byte-level ``Ġhello``, SentencePiece ``▁hello``).

        Raises:
            ValueError: ``i`` is outside ``[0, vocab_size)``.
        """
        if not 0 <= i < len(self._tokens):
            raise ValueError(f"token id {i} is outside the vocabulary [0, {len(self._tokens)})")
        return self._tokens[i]

    def token_to_id(self, token: str) -> int | None:
        """Id of the token spelled ``token`` in the GGUF vocabulary, or None if there is none."""
        return self._token_to_id.get(token)

    def token_type(self, i: int) -> int:
        """GGUF type of token ``i`` (a :class:`TokenType` value)."""
        self.id_to_token(i)
        return self._types[i]

    # ------------------------------------------------------------------ chat

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        *,
        chat_template: str | None = None,
        limits: Any = None,
        **kwargs: Any,
    ) -> str:
        """Render a conversation into prompt text with the model's chat template, in a worker
        process bounded in time, output size and memory
        (:func:`memra.io.chat_template.render_chat_template_bounded`; ``limits`` a
        :class:`~memra.io.chat_template.RenderLimits`, default 1 s / 4 M characters / 1 GiB).

        Args:
            messages: OpenAI-style messages (``{"role": ..., "content": ...}``).
            add_generation_prompt: end with the header that starts the assistant's turn.
            tools: tool (function) descriptions, passed to the template as ``tools``.
            chat_template: a template string to use instead of the model's.
            **kwargs: extra template variables (e.g. ``enable_thinking``).

        Returns:
            The prompt text; encode it with ``add_special_tokens=False`` when the
            template writes the BOS token itself.

        Raises:
            NoChatTemplateError: neither the model nor the caller gives a template.
            ChatTemplateError: the template is invalid, fails, or calls
                ``raise_exception`` (see :mod:`memra.io.chat_template`).
            ChatTemplateSecurityError: the template tries to reach Python internals.
            ChatTemplateLimitError: the render exceeded a bound of ``limits``.
        """
        from .chat_template import NoChatTemplateError, render_chat_template_bounded

        template = chat_template if chat_template is not None else self.chat_template
        if template is None:
            who = f"model {self.name!r}" if self.name else "this model"
            raise NoChatTemplateError(
                f"{who} has no chat template (GGUF key 'tokenizer.chat_template' is absent; "
                f"it is probably a base model): pass a template explicitly or use plain completion"
            )
        return render_chat_template_bounded(
            template,
            messages,
            limits=limits,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
            **kwargs,
        )

    def __repr__(self) -> str:
        return (
            f"Tokenizer(model={self.model!r}, pre={self.pre!r}, vocab_size={self.vocab_size}, "
            f"bos={self.bos_token_id}, eos={self.eos_token_id}, add_bos={self.add_bos})"
        )


class NoVocabTokenizer:
    """The "tokenizer" of a GGUF without a vocabulary (``tokenizer.ggml.model`` = ``none``).

    Prompts must be token ids; completions carry token ids and empty text (as vLLM with
    ``skip_tokenizer_init``). llama.cpp loads such files too (``LLAMA_VOCAB_TYPE_NONE``), so
    memra and llama.cpp can run the same benchmark file.

    Attributes:
        vocab_size: ``{arch}.vocab_size`` (ids are ``0..vocab_size-1``), or None if absent.
        bos_token_id, eos_token_id: from the GGUF when given, else None.
    """

    model = "none"
    pre = None
    chat_template = None
    add_bos = add_eos = False
    has_vocab = False

    def __init__(self, vocab_size: int | None, bos_token_id: int | None, eos_token_id: int | None,
                 name: str | None = None):
        self.vocab_size, self.bos_token_id, self.eos_token_id, self.name = vocab_size, bos_token_id, eos_token_id, name

    @classmethod
    def from_gguf_metadata(cls, meta: Mapping[str, Any]) -> NoVocabTokenizer:
        """Build from GGUF metadata (``general.architecture``'s ``vocab_size``, bos/eos ids).

        Raises:
            TokenizerError: a bos/eos id or the vocab size is not a non-negative integer.
        """
        arch = meta.get("general.architecture")
        n = meta.get(f"{arch}.vocab_size") if isinstance(arch, str) else None
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n <= 0):
            raise TokenizerError(f"GGUF key '{arch}.vocab_size' = {n!r} must be a positive integer")
        ids = {}
        for key in ("tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id"):
            v = meta.get(key)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0
                                  or (n is not None and v >= n)):
                raise TokenizerError(f"GGUF key {key!r} = {v!r} is not a token id in [0, {n})")
            ids[key] = v
        name = meta.get("general.name") if isinstance(meta.get("general.name"), str) else None
        return cls(n, ids["tokenizer.ggml.bos_token_id"], ids["tokenizer.ggml.eos_token_id"], name)

    def _refuse(self, what: str):
        who = f"model {self.name!r}" if self.name else "this model"
        raise TokenizerError(f"{who} has no vocabulary (GGUF tokenizer.ggml.model = 'none'): {what}; give the "
                             "prompt as token ids")

    @property
    def eos_token_ids(self) -> list[int]:
        """The EOS id if the file gives one (a new list each call)."""
        return [] if self.eos_token_id is None else [self.eos_token_id]

    @property
    def special_token_ids(self) -> frozenset[int]:
        return frozenset()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Raises TokenizerError: text cannot be tokenized without a vocabulary."""
        self._refuse("text prompts cannot be tokenized")

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Always ``""``: there is no text for token ids without a vocabulary."""
        return ""

    def apply_chat_template(self, messages, add_generation_prompt: bool = True, tools=None, **kwargs) -> str:
        """Raises TokenizerError: no vocabulary, so no chat template either."""
        self._refuse("chat messages cannot be rendered or tokenized")

    def __repr__(self) -> str:
        return f"NoVocabTokenizer(vocab_size={self.vocab_size}, bos={self.bos_token_id}, eos={self.eos_token_id})"
