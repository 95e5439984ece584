"""Agents end to end, through the official ``openai`` client against ``memra serve``'s app (CPU):
structured output (json_object, json_schema, vLLM's structured_outputs) on smollm2-135m, forced
tool calls (``tool_choice`` required / named) on qwen2.5-coder-0.5b (hermes format, from its chat
template), and a constrained step3p5 call on the tiny random Step-3.5 model: every output must
parse and validate (``jsonschema``), every time.
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from test_server import ServerThread

from memra.engine.async_engine import AsyncLLMEngine
from memra.engine.engine import EngineConfig, LLMEngine
from memra.server import create_app

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}}, "required": ["colour"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "score": {"type": "number"}},
     "required": ["ok", "score"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string"}, "minItems": 1,
                                               "maxItems": 3}}, "required": ["tags"]},
    {"type": "object", "properties": {"point": {"type": "object", "properties": {
        "x": {"type": "integer"}, "y": {"type": "integer"}}, "required": ["x", "y"], "additionalProperties": False}},
     "required": ["point"], "additionalProperties": False},
    {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}, "zip": {
        "type": "string", "pattern": "^[0-9]{5}$"}}, "required": ["city", "zip"]},
    {"type": "object", "properties": {"note": {"type": ["string", "null"]}}, "required": ["note"]},
    {"type": "object", "properties": {"items": {"type": "array", "items": {"type": "object", "properties": {
        "id": {"type": "integer"}, "qty": {"type": "integer"}}, "required": ["id", "qty"]}}}, "required": ["items"]},
    {"type": "object", "properties": {"kind": {"const": "event"}, "when": {"type": "string"}},
     "required": ["kind", "when"]},
    {"type": "object", "properties": {"v": {"anyOf": [{"type": "integer"}, {"type": "string"}]}}, "required": ["v"]},
]


def _server(model: str, **kw):
    eng = AsyncLLMEngine(LLMEngine(EngineConfig(model=model, max_model_len=kw.pop("max_model_len", 1024),
                                                max_num_seqs=4, kv_cache_blocks=kw.pop("blocks", 160))))
    eng.start()
    srv = ServerThread(create_app(eng, **kw))
    return eng, srv


@pytest.fixture(scope="module")
def smol():
    eng, srv = _server("smollm2-135m", max_model_len=512, blocks=96)
    yield openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0), eng
    srv.stop()
    eng.shutdown()


@pytest.fixture(scope="module")
def qwen():
    eng, srv = _server("qwen2.5-coder-0.5b", max_model_len=2048, blocks=300)
    yield openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0), eng
    srv.stop()
    eng.shutdown()


def test_json_object_is_valid_json(qwen):
    """Any JSON object: every completion the model ends parses (one cut by max_tokens cannot: no
    schema bounds a free object, so the count of those is asserted to stay the exception)."""
    client, _ = qwen
    ended = 0
    for i, stream in enumerate((False, True, False, True)):
        kw = dict(model="qwen2.5-coder-0.5b", max_tokens=400, temperature=0.5 * (i % 2), seed=3 + i,
                  messages=[{"role": "user", "content": "Give a short JSON object about a cat: name and age."}],
                  response_format={"type": "json_object"})
        if stream:
            text, finish = "", None
            for ch in client.chat.completions.create(stream=True, **kw):
                for c in ch.choices:
                    text += c.delta.content or ""
                    finish = c.finish_reason or finish
        else:
            c = client.chat.completions.create(**kw).choices[0]
            text, finish = c.message.content, c.finish_reason
        if finish == "stop":
            ended += 1
            assert isinstance(json.loads(text), dict), text
    assert ended >= 3, f"{ended} of 4 json_object completions ended before max_tokens"


def test_json_schema_output_validates_every_time(qwen):
    """20 requests (10 schemas x 2 temperatures) on qwen2.5-coder-0.5b: every one ends and validates.
    (A completion cut by max_tokens could not: the grammar cannot make a model end an unbounded
    string, so the count of those is asserted too.)"""
    client, _ = qwen
    finished = 0
    for i, schema in enumerate(SCHEMAS):
        for temperature in (0.0, 0.7):
            r = client.chat.completions.create(
                model="qwen2.5-coder-0.5b", max_tokens=200, temperature=temperature, seed=i,
                messages=[{"role": "user", "content": f"Give me a short JSON example #{i}."}],
                response_format={"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema,
                                                                         "strict": True}})
            c = r.choices[0]
            assert c.finish_reason in ("stop", "length"), c.finish_reason
            if c.finish_reason == "stop":
                finished += 1
                jsonschema.validate(json.loads(c.message.content), schema)
    assert finished == 20, f"only {finished} of 20 constrained completions ended before max_tokens"


def test_vllm_structured_outputs(smol):
    client, _ = smol
    r = client.completions.create(model="smollm2-135m", prompt="Pick a colour:", max_tokens=10, temperature=1.0,
                                  extra_body={"structured_outputs": {"choice": ["red", "green", "blue"]}})
    assert r.choices[0].text in ("red", "green", "blue")
    r = client.completions.create(model="smollm2-135m", prompt="A date:", max_tokens=20, temperature=1.0, seed=1,
                                  extra_body={"structured_outputs": {"regex": "[0-9]{4}-[0-9]{2}-[0-9]{2}"}})
    import re

    assert re.fullmatch(r"[0-9]{4}-[0-9]{2}-[0-9]{2}", r.choices[0].text), r.choices[0].text
    r = client.completions.create(model="smollm2-135m", prompt="JSON:", max_tokens=60, temperature=0,
                                  extra_body={"response_format": {"type": "json_schema", "json_schema": {
                                      "name": "p", "schema": SCHEMAS[0]}}})
    jsonschema.validate(json.loads(r.choices[0].text), SCHEMAS[0])


@pytest.mark.parametrize("body,param,match", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "array", "uniqueItems": True}}}}, "response_format.json_schema.schema", "uniqueItems"),
    ({"response_format": {"type": "yaml"}}, "response_format.type", "yaml"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"grammar": "start: ("}}, "structured_outputs.grammar", ""),
    ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos", "structured"),
    ({"tool_choice": "required"}, "tool_choice", "at least one tool"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required"}, "tool_choice",
     "tool-call format"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice", "not in tools"),
])
def test_bad_structured_requests_are_400_naming_the_field(smol, body, param, match):
    client, _ = smol
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="smollm2-135m", max_tokens=5,
                                       messages=[{"role": "user", "content": "hi"}], extra_body=body)
    err = e.value.body if isinstance(e.value.body, dict) else {}
    assert err.get("param") == param, err
    assert match in err.get("message", ""), err


TOOL_SPECS = [
    ("get_weather", {"city": {"type": "string"}, "days": {"type": "integer"}}, ["city"], "Weather in Paris?"),
    ("add", {"a": {"type": "number"}, "b": {"type": "number"}}, ["a", "b"], "What is 2.5 plus 4?"),
    ("send_email", {"to": {"type": "string"}, "subject": {"type": "string"}, "urgent": {"type": "boolean"}},
     ["to", "subject"], "Email bob@example.com about lunch."),
    ("set_light", {"room": {"enum": ["kitchen", "bedroom"]}, "on": {"type": "boolean"}}, ["room", "on"],
     "Turn on the kitchen light."),
    ("search", {"query": {"type": "string"}, "limit": {"type": "integer", "minimum": 1}}, ["query"],
     "Search for rust tutorials."),
    ("create_user", {"name": {"type": "string"}, "tags": {"type": "array", "items": {"type": "string"}}},
     ["name", "tags"], "Make a user ann tagged admin."),
    ("move", {"to": {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                     "required": ["x", "y"]}}, ["to"], "Move to 3, 4."),
    ("translate", {"text": {"type": "string"}, "lang": {"enum": ["fr", "de", "es"]}}, ["text", "lang"],
     "Say hello in French."),
    ("book_table", {"people": {"type": "integer"}, "time": {"type": "string"}}, ["people", "time"],
     "Table for 2 at 8pm."),
    ("convert", {"amount": {"type": "number"}, "from": {"type": "string"}, "to": {"type": "string"}},
     ["amount", "from", "to"], "10 USD in EUR?"),
]


def _tool(name, props, required):
    return {"type": "function", "function": {"name": name, "description": f"the {name} tool", "parameters": {
        "type": "object", "properties": props, "required": required, "additionalProperties": False}}}


def test_forced_tool_calls_parse_and_validate(qwen):
    """20 cases: each tool forced by name, and tool_choice required over all tools; streaming and
    not; the arguments always validate against the chosen tool's schema."""
    client, eng = qwen
    assert eng.engine.tokenizer.chat_template and "<tool_call>" in eng.engine.tokenizer.chat_template
    tools = [_tool(*spec[:3]) for spec in TOOL_SPECS]
    by_name = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    cases = [(spec[3], {"type": "function", "function": {"name": spec[0]}}) for spec in TOOL_SPECS]
    cases += [(spec[3], "required") for spec in TOOL_SPECS]
    for i, (prompt, choice) in enumerate(cases):
        kw = dict(model="qwen2.5-coder-0.5b", max_tokens=160, temperature=0.0 if i % 2 else 0.7, seed=i,
                  messages=[{"role": "user", "content": prompt}], tools=tools, tool_choice=choice)
        if i % 3 == 2:  # streamed: the calls come whole, once
            calls, finish = {}, None
            for ch in client.chat.completions.create(stream=True, **kw):
                for c in ch.choices:
                    for tc in c.delta.tool_calls or []:
                        assert tc.index not in calls, "a call was emitted twice"
                        calls[tc.index] = (tc.function.name, tc.function.arguments)
                    finish = c.finish_reason or finish
            got = list(calls.values())
        else:
            r = client.chat.completions.create(**kw)
            finish = r.choices[0].finish_reason
            got = [(tc.function.name, tc.function.arguments) for tc in r.choices[0].message.tool_calls or []]
        assert finish == "tool_calls" and len(got) == 1, (i, finish, got)
        name, args = got[0]
        if isinstance(choice, dict):
            assert name == choice["function"]["name"]
        jsonschema.validate(json.loads(args), by_name[name])


def test_auto_tool_choice_parses_what_the_model_says(qwen):
    client, _ = qwen
    tools = [_tool(*TOOL_SPECS[0][:3])]
    r = client.chat.completions.create(model="qwen2.5-coder-0.5b", max_tokens=80, temperature=0,
                                       messages=[{"role": "user", "content": "What is the weather in Oslo? Use the "
                                                                              "tool."}], tools=tools)
    m = r.choices[0].message
    if m.tool_calls:  # the model chose to call: the call parses and the finish reason says so
        assert r.choices[0].finish_reason == "tool_calls"
        json.loads(m.tool_calls[0].function.arguments)
        assert "<tool_call>" not in (m.content or "")
    r = client.chat.completions.create(model="qwen2.5-coder-0.5b", max_tokens=20, temperature=0, tool_choice="none",
                                       messages=[{"role": "user", "content": "Say hi."}], tools=tools)
    assert r.choices[0].message.tool_calls is None


def test_constrained_step3p5_call_on_the_tiny_step_model(tmp_path):
    """Random weights: the grammar alone makes the output a valid step3p5 call, which the parser
    reads back into the tool call."""
    from memra.engine.llm import LLM
    from memra.engine.sampling import SamplingParams
    from memra.engine.structured import GrammarBackend
    from memra.hub import resolve_model
    from memra.io.synthetic import load_geometry, with_vocabulary, write_synthetic
    from memra.server.tool_parsers import parse_tool_calls, tool_call_grammar

    g = with_vocabulary(load_geometry("tiny"), resolve_model("smollm2-135m", progress=False))
    path = write_synthetic(g, "gguf-q8_0", 0, tmp_path / "step.gguf")
    llm = LLM(path, max_model_len=256, max_num_seqs=2, kv_cache_blocks=40)
    tools = [_tool("get_weather", {"city": {"type": "string", "minLength": 1, "maxLength": 12},
                                   "days": {"type": "integer", "minimum": 1, "maximum": 14},
                                   "metric": {"type": "boolean"}}, ["city", "days", "metric"])]
    g = GrammarBackend(llm.tokenizer, llm.config.vocab_size, llm.eos_ids)
    grammar = g.lark(tool_call_grammar("step3p5", tools, "get_weather", g.literal))
    for seed in range(3):
        params = SamplingParams(max_tokens=120, temperature=1.0, seed=seed, structured=grammar)
        text = llm.generate("weather?", params)[0].outputs[0].text
        content, calls = parse_tool_calls("step3p5", text, tools)
        assert len(calls) == 1 and calls[0].name == "get_weather", text
        jsonschema.validate(json.loads(calls[0].arguments), tools[0]["function"]["parameters"])


def test_structured_bench_runs(tmp_path, capsys):
    """``memra bench structured`` measures both modes and writes its JSON (the numbers are the
    note's, not asserted)."""
    from memra.cli import main

    out = tmp_path / "s.json"
    assert main(["bench", "structured", "--tokens", "8", "--rounds", "1", "--json-out", str(out)]) == 0
    res = json.loads(out.read_text())
    assert set(res["tok_s"]) == {"free", "json_schema", "json_object"} and all(v > 0 for v in res["tok_s"].values())
    assert res["grammar_us_per_token"]["json_schema"] > 0
    assert "| json_schema |" in capsys.readouterr().out
