"""Tool-call and reasoning parsers on fixtures: every fixture is parsed whole and streamed in
deltas of every size 1..8 and random sizes; both must give the same content and calls."""

from __future__ import annotations

import json
import random

import pytest

from memra.server.reasoning import ReasoningParser, detect_reasoning_parser, prompt_opens_reasoning
from memra.server.tool_parsers import detect_tool_parser, make_tool_parser, parse_tool_calls

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"},
        "scale": {"type": "number"}, "opts": {"type": "object"}, "tags": {"type": "array"},
        "note": {"type": ["string", "null"]}}}}},
    {"type": "function", "function": {"name": "write_file", "parameters": {"type": "object", "properties": {
        "path": {"type": "string"}, "content": {"type": "string"}}}}},
]


def _streamed(name, text, sizes):
    p = make_tool_parser(name, TOOLS)
    content, calls, i = [], [], 0
    for n in sizes:
        c, k = p.feed(text[i:i + n])
        content.append(c)
        calls += k
        i += n
    c, k = p.finish()
    return "".join(content) + c, calls + k


def _check_streaming_equals_whole(name, text):
    whole = parse_tool_calls(name, text, TOOLS)
    rng = random.Random(len(text))
    splits = [[n] * (len(text) // n + 1) for n in range(1, 9)]
    splits += [[rng.randint(1, 12) for _ in range(len(text))] for _ in range(5)] + [[len(text)]]
    for sizes in splits:
        content, calls = _streamed(name, text, sizes)
        assert content == whole[0], sizes
        assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in whole[1]], sizes
    return whole


def _args(call):
    return json.loads(call.arguments)


def test_step3p5_types_nested_json_and_multiline_values():
    text = ("Let me check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nSan Francisco\n</parameter>\n"
            "<parameter=days>\n3\n</parameter>\n<parameter=metric>\ntrue\n</parameter>\n<parameter=scale>\n1.5\n"
            "</parameter>\n<parameter=opts>\n{\"a\": {\"b\": [1, 2, {\"c\": null}]}}\n</parameter>\n"
            "<parameter=tags>\n[\"x\", \"y\"]\n</parameter>\n<parameter=note>\nnull\n</parameter>\n</function>\n"
            "</tool_call>")
    content, calls = _check_streaming_equals_whole("step3p5", text)
    assert content == "Let me check.\n"
    assert [c.name for c in calls] == ["get_weather"]
    assert _args(calls[0]) == {"city": "San Francisco", "days": 3, "metric": True, "scale": 1.5,
                               "opts": {"a": {"b": [1, 2, {"c": None}]}}, "tags": ["x", "y"], "note": None}
    assert calls[0].id.startswith("call_") and len(calls[0].id) > 10

    code = "def f(x):\n    return x + 1\n\n# <b>not a tag</b>\n"
    text = (f"<tool_call>\n<function=write_file>\n<parameter=path>\na.py\n</parameter>\n<parameter=content>\n{code}\n"
            f"</parameter>\n</function>\n</tool_call>")
    content, calls = _check_streaming_equals_whole("step3p5", text)
    assert content == "" and _args(calls[0]) == {"path": "a.py", "content": code}


def test_step3p5_values_of_the_wrong_type_stay_strings():
    text = "<tool_call>\n<function=get_weather>\n<parameter=days>\nthree\n</parameter>\n<parameter=city>\n42\n" \
           "</parameter>\n<parameter=extra>\n7\n</parameter>\n</function>\n</tool_call>"
    _, calls = _check_streaming_equals_whole("step3p5", text)
    assert _args(calls[0]) == {"days": "three", "city": "42", "extra": "7"}


def test_two_calls_back_to_back_and_several_calls_in_one_delta():
    one = "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n</function>\n</tool_call>"
    two = one.replace("Oslo", "Rome")
    for text in (one + two, one + "\n" + two + " done", "<tool_call>\n" + one[12:-12] + two[12:-12] + "</tool_call>"):
        content, calls = _check_streaming_equals_whole("step3p5", text)
        assert [_args(c)["city"] for c in calls] == ["Oslo", "Rome"], text
        assert "<" not in content
    p = make_tool_parser("step3p5", TOOLS)  # both complete calls in one delta: both come out, once
    c1, k1 = p.feed(one + two)
    c2, k2 = p.finish()
    assert len(k1) == 2 and k2 == [] and c1 + c2 == ""
    assert k1[0].id != k1[1].id


def test_bare_function_without_tool_call_wrapper():
    text = "ok <function=get_weather>\n<parameter=city>\nLima\n</parameter>\n</function> bye"
    content, calls = _check_streaming_equals_whole("step3p5", text)
    assert content == "ok  bye" and _args(calls[0]) == {"city": "Lima"}


def test_truncated_and_malformed_markup_is_content():
    cut = "Sure <tool_call>\n<function=get_weather>\n<parameter=city>\nPar"
    content, calls = _check_streaming_equals_whole("step3p5", cut)
    assert calls == [] and content == cut
    bad = "x <tool_call>\nnot xml at all\n</tool_call> y"
    content, calls = _check_streaming_equals_whole("step3p5", bad)
    assert calls == [] and content == bad
    for text in ("a <tool_call>{\"name\": \"f\", \"arguments\": {</tool_call> b", "<tool_call>[1, 2]</tool_call>",
                 "<tool_c", "partial <tool_call>{\"name\": \"get_weather\""):
        content, calls = _check_streaming_equals_whole("hermes", text)
        assert calls == [] and content == text


def test_hermes_calls():
    text = ('I will call.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "opts": {"a": [1]}}}\n'
            '</tool_call>\n<tool_call>\n{"name": "write_file", "arguments": "{\\"path\\": \\"b\\"}"}\n</tool_call>')
    content, calls = _check_streaming_equals_whole("hermes", text)
    assert content == "I will call.\n\n"
    assert [(c.name, _args(c)) for c in calls] == [("get_weather", {"city": "Paris", "opts": {"a": [1]}}),
                                                  ("write_file", {"path": "b"})]


def test_detection_from_the_chat_template():
    assert detect_tool_parser("{{ '<tool_call>\\n<function=' }}{{ '<parameter=' }}") == "step3p5"
    assert detect_tool_parser("<tool_call>\\n{{ tool_call | tojson }}") == "hermes"
    assert detect_tool_parser("{{ messages }}") is None
    assert detect_reasoning_parser("<think>\\n{{ r }}</think>") == "step3p5"
    assert detect_reasoning_parser("{{ messages }}") is None
    with pytest.raises(ValueError, match="unknown tool-call parser"):
        make_tool_parser("xml", None)


def _reason(text, seeded, sizes=None):
    p = ReasoningParser(seeded=seeded)
    r, c, i = [], [], 0
    for n in sizes or [len(text)]:
        a, b = p.feed(text[i:i + n])
        r.append(a)
        c.append(b)
        i += n
    a, b = p.finish()
    return "".join(r) + a, "".join(c) + b


@pytest.mark.parametrize("text,seeded,want", [
    ("<think>\nplan it\n</think>\nThe answer.", False, ("\nplan it\n", "The answer.")),
    ("  <think>x</think>y", False, ("x", "y")),
    ("plan it\n</think>\nThe answer.", True, ("plan it\n", "The answer.")),  # template-seeded <think>
    ("No thinking here.", False, ("", "No thinking here.")),
    ("<think>still thinking", False, ("still thinking", "")),  # unterminated: all reasoning
    ("<think>I'll check <tool_call>\n<function=f>\n</function>\n</tool_call>", False,
     ("I'll check ", "<tool_call>\n<function=f>\n</function>\n</tool_call>")),  # a call before </think>
    ("think <b>", False, ("", "think <b>")),
    ("<", False, ("", "<")),
])
def test_reasoning_split(text, seeded, want):
    for n in range(1, 8):
        assert _reason(text, seeded, [n] * len(text)) == want, n
    assert _reason(text, seeded) == want


def test_a_tool_call_inside_an_unterminated_reasoning_block_is_kept():
    text = "<think>need the weather <tool_call>\n<function=get_weather>\n<parameter=city>\nBern\n</parameter>\n" \
           "</function>\n</tool_call>"
    reasoning, content = _reason(text, False, [3] * len(text))
    assert reasoning == "need the weather "
    _, calls = parse_tool_calls("step3p5", content, TOOLS)
    assert _args(calls[0]) == {"city": "Bern"}


def test_prompt_opens_reasoning():
    assert prompt_opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_reasoning("<think>a</think> earlier turn <|im_start|>assistant\n")
    assert not prompt_opens_reasoning("plain")


def test_multi_turn_tool_calls_reach_the_template_as_mappings():
    from memra.server.protocol import ChatMessage

    m = ChatMessage(role="assistant", content=None, tool_calls=[
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}])
    d = m.template_dict(1)
    assert d["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}
    t = ChatMessage(role="tool", content='{"temp": 3}', tool_call_id="call_1").template_dict(2)
    assert t["tool_call_id"] == "call_1" and t["content"] == '{"temp": 3}'
