"""memra.engine.detokenizer.IncrementalDetokenizer on real vocabularies.

Characters that span tokens (emoji and CJK cut by byte-level BPE, byte-fallback tokens
in gemma3) must never come out broken, and the pieces must add up to ``decode``.
"""

from __future__ import annotations

import pytest

from memra.engine.detokenizer import PROMPT_CONTEXT_TOKENS, IncrementalDetokenizer

KEYS = ("smollm2-135m", "qwen2.5-coder-0.5b", "gemma3-270m")

TEXTS = [
    "Family: 👨‍👩‍👧‍👦, flag 🏳️‍🌈, coder 👩🏽‍💻, crab 🦀🦀.",
    "你好，世界！这是一个测试。日本語のテキスト。안녕하세요",
    "Mixed é and e\u0301, 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 math, \ue000 private use, 🧑‍🔬 done<|im_end|>",
    "<start_of_turn>model\nplain ASCII with specials<end_of_turn>\n",
]


def _stream(tok, ids, prompt_ids=None, skip=False):
    d = IncrementalDetokenizer(tok, prompt_ids=prompt_ids, skip_special_tokens=skip)
    pieces = [d.add(i) for i in ids]
    pieces.append(d.flush())
    return pieces, d


@pytest.mark.parametrize("skip", [False, True])
@pytest.mark.parametrize("with_prompt", [False, True])
@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("key", KEYS)
def test_pieces_join_to_decode(key, text, with_prompt, skip, memra_tokenizer):
    tok = memra_tokenizer(key)
    ids = tok.encode(text, add_special_tokens=False)
    prompt = tok.encode("Prompt with 中文 and 🙂:") if with_prompt else None
    pieces, d = _stream(tok, ids, prompt, skip)
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=skip)
    assert not any("\ufffd" in p for p in pieces), pieces
    assert d.generated_ids == ids


@pytest.mark.parametrize("key", KEYS)
def test_multibyte_characters_do_span_tokens(key, memra_tokenizer):
    """The texts above really contain characters cut across tokens (else the test is moot),
    and those are held back until complete."""
    tok = memra_tokenizer(key)
    ids = tok.encode(TEXTS[0] + TEXTS[1] + TEXTS[2], add_special_tokens=False)
    alone = [tok.decode([i]) for i in ids]
    assert any("\ufffd" in a for a in alone), "no token holds a partial character"
    pieces, _ = _stream(tok, ids)
    held = [k for k, p in enumerate(pieces[:-1]) if p == ""]
    assert held, "nothing was held back"
    for k in held:
        assert "\ufffd" in tok.decode(ids[: k + 1])[-1:] or tok.decode([ids[k]]) == ""


def test_emoji_split_by_byte_level_bpe(memra_tokenizer):
    tok = memra_tokenizer("smollm2-135m")
    ids = tok.encode("🦀", add_special_tokens=False)
    assert len(ids) > 1  # 4 UTF-8 bytes, more than one token
    pieces, _ = _stream(tok, ids)
    assert pieces[:-2] == [""] * (len(ids) - 1) and pieces[-2] == "🦀" and pieces[-1] == ""


def test_flush_emits_incomplete_character_as_replacement(memra_tokenizer):
    tok = memra_tokenizer("smollm2-135m")
    ids = tok.encode("ok 🦀", add_special_tokens=False)
    cut = ids[:-1]  # the crab's last token never arrives
    pieces, _ = _stream(tok, cut)
    assert "".join(pieces) == tok.decode(cut)
    assert pieces[-1].endswith("\ufffd") and "\ufffd" not in "".join(pieces[:-1])


def test_invalid_bytes_come_out_once_known(memra_tokenizer):
    """A stray UTF-8 continuation byte is emitted (as U+FFFD) once a later token shows
    the character cannot complete, not held forever."""
    tok = memra_tokenizer("smollm2-135m")
    stray = tok.token_to_id("\u0122")  # byte-level spelling of byte 0x80
    assert tok.decode([stray]) == "\ufffd"
    ids = [stray] + tok.encode("abc", add_special_tokens=False)
    pieces, _ = _stream(tok, ids)
    assert pieces[0] == "" and pieces[1] == "\ufffd" + tok.decode(ids[1:2])
    assert "".join(pieces) == tok.decode(ids)


def test_special_tokens_skipped(memra_tokenizer):
    tok = memra_tokenizer("qwen2.5-coder-0.5b")
    ids = tok.encode("Hi<|im_end|>", add_special_tokens=False)
    assert "".join(_stream(tok, ids, skip=True)[0]) == "Hi"
    assert "".join(_stream(tok, ids, skip=False)[0]) == "Hi<|im_end|>"


class _CountingTokenizer:
    """Wraps a tokenizer and records the length of every decode window."""

    def __init__(self, tok):
        self._tok = tok
        self.vocab_size = tok.vocab_size
        self.windows: list[int] = []

    def decode(self, ids, skip_special_tokens=False):
        self.windows.append(len(ids))
        return self._tok.decode(ids, skip_special_tokens)


def test_decodes_a_small_window(memra_tokenizer):
    tok = memra_tokenizer("qwen2.5-coder-0.5b")
    ids = tok.encode(" ".join(TEXTS) * 20, add_special_tokens=False)
    assert len(ids) > 500
    counting = _CountingTokenizer(tok)
    d = IncrementalDetokenizer(counting, prompt_ids=tok.encode("a long prompt " * 50))
    out = "".join(d.add(i) for i in ids) + d.flush()
    assert out == tok.decode(ids)
    assert max(counting.windows) <= PROMPT_CONTEXT_TOKENS + 8


def test_bad_ids(memra_tokenizer):
    tok = memra_tokenizer("smollm2-135m")
    d = IncrementalDetokenizer(tok)
    with pytest.raises(ValueError, match="not an integer in"):
        d.add(tok.vocab_size)
    with pytest.raises(ValueError, match="not an integer"):
        d.add("7")
    with pytest.raises(ValueError, match="prompt_ids"):
        IncrementalDetokenizer(tok, prompt_ids=[-1])
