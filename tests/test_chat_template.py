"""memra.io.chat_template: real templates render as transformers renders them; hostile
templates are stopped by the sandbox; template errors are clear."""

from __future__ import annotations

import pytest

from memra.io.chat_template import (
    ChatTemplateError,
    ChatTemplateRejected,
    ChatTemplateSecurityError,
    compile_chat_template,
    render_chat_template,
)

SMOLLM, QWEN = "smollm2-135m", "qwen2.5-coder-0.5b"

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather for a city — °C, ünïcode kept",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}

CONVERSATIONS = {
    "single_user": [{"role": "user", "content": "Hello!"}],
    "with_system": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3? 你好 🦀"},
    ],
    "tool_round_trip": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
        ]},
        {"role": "tool", "content": '{"temp_c": 21}'},
    ],
}


@pytest.fixture(scope="module")
def template(gguf_tokenizer_metadata):
    return lambda key: gguf_tokenizer_metadata(key)["tokenizer.chat_template"]


def test_smollm_renders_chatml(template, memra_tokenizer):
    msgs = [{"role": "user", "content": "Hello!"}]
    expected = (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHello!<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert render_chat_template(template(SMOLLM), msgs, add_generation_prompt=True) == expected
    assert memra_tokenizer(SMOLLM).apply_chat_template(msgs) == expected
    no_prompt = render_chat_template(template(SMOLLM), msgs, add_generation_prompt=False)
    assert no_prompt == expected[: -len("<|im_start|>assistant\n")]
    with_system = render_chat_template(
        template(SMOLLM), [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}])
    assert with_system == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n"


def test_qwen_renders(template, memra_tokenizer):
    out = memra_tokenizer(QWEN).apply_chat_template([{"role": "user", "content": "Hi"}])
    assert out == (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    with_tools = render_chat_template(template(QWEN), CONVERSATIONS["tool_round_trip"], tools=[WEATHER_TOOL])
    assert "<tools>\n" + '{"type": "function", "function": {"name": "get_weather", "description": ' \
        '"Current weather for a city — °C, ünïcode kept"' in with_tools
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in with_tools
    assert "<|im_start|>user\n<tool_response>\n{\"temp_c\": 21}\n</tool_response><|im_end|>\n" in with_tools
    assert with_tools.endswith("<|im_start|>assistant\n")


# SmolLM2's template has no tool-call support (it concatenates content), so no tool round trip.
RENDER_CASES = [(key, conv) for key in (SMOLLM, QWEN) for conv in CONVERSATIONS
                if not (key == SMOLLM and conv == "tool_round_trip")]


@pytest.mark.parametrize("key,conv", RENDER_CASES)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("tools", [None, [WEATHER_TOOL]])
def test_matches_transformers_rendering(key, conv, add_generation_prompt, tools, template):
    """Same text as transformers' template rendering (the function its
    ``apply_chat_template`` calls, after it drops None-valued message keys)."""
    from transformers.utils.chat_template_utils import render_jinja_template

    msgs = CONVERSATIONS[conv]
    ours = render_chat_template(template(key), msgs, add_generation_prompt=add_generation_prompt, tools=tools)
    hf_msgs = [{k: v for k, v in m.items() if v is not None} for m in msgs]
    (theirs,), _ = render_jinja_template(
        [hf_msgs], tools=tools, chat_template=template(key), add_generation_prompt=add_generation_prompt)
    assert ours == theirs


HOSTILE = [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ cycler.__init__.__globals__.os }}",
    "{{ cycler.__init__.__globals__ }}",
    "{{ lipsum.__globals__['os'].popen('id').read() }}",
    "{{ joiner.__init__.__globals__.__builtins__ }}",
    "{{ namespace.__init__.__globals__ }}",
    "{{ self.__init__.__globals__ }}",
    "{{ messages.__class__ }}",
    "{{ messages[0]['content'].__class__.__base__ }}",
    "{{ messages[0].content|attr('__class__') }}",
    "{{ '{0.__class__.__mro__}'.format(messages) }}",
    "{{ raise_exception.__globals__ }}",
    "{% set x = messages.append({'role': 'system'}) %}",
    "{% set _ = messages[0].update({'role': 'x'}) %}",
    "{{ 'x' * 100000000 }}",
    "{{ [1] * 100000000 }}",
    "{{ 9 ** 99999999 }}",
    "{% for i in range(10000000) %}{% endfor %}",
]


@pytest.mark.parametrize("source", HOSTILE)
def test_hostile_template_is_stopped(source):
    with pytest.raises(ChatTemplateSecurityError) as e:
        render_chat_template(source, [{"role": "user", "content": "hi"}])
    msg = str(e.value)
    assert "unsafe" in msg or "limit" in msg
    assert "<module 'os'" not in msg and "subprocess" not in msg


def test_raise_exception_is_clear():
    src = (
        "{% for m in messages %}{% if m.role not in ['user', 'assistant'] %}"
        "{{ raise_exception('Only user and assistant roles are supported, got ' + m.role) }}"
        "{% endif %}{% endfor %}"
    )
    with pytest.raises(ChatTemplateRejected, match="rejected the request: Only user and assistant roles "
                                                   "are supported, got tool"):
        render_chat_template(src, [{"role": "tool", "content": "x"}])
    assert issubclass(ChatTemplateRejected, ChatTemplateError) and issubclass(ChatTemplateError, ValueError)


def test_syntax_and_runtime_errors_name_the_line():
    with pytest.raises(ChatTemplateError, match="syntax error at line 2"):
        compile_chat_template("ok\n{% if %}")
    with pytest.raises(ChatTemplateError, match="at line 3: ZeroDivisionError"):
        render_chat_template("a\nb\n{{ 1 // 0 }}", [])
    with pytest.raises(ChatTemplateError, match="UndefinedError"):
        render_chat_template("{{ nothing.here }}", [])


def test_bad_messages():
    with pytest.raises(ChatTemplateError, match="list of message objects"):
        render_chat_template("x", "hello")
    with pytest.raises(ChatTemplateError, match=r"messages\[1\] has no string 'role'"):
        render_chat_template("x", [{"role": "user"}, {"content": "no role"}])
    with pytest.raises(ChatTemplateError, match=r"messages\[0\]\['content'\] is a set"):
        render_chat_template("x", [{"role": "user", "content": {1, 2}}])
    with pytest.raises(ChatTemplateError, match="shadow"):
        render_chat_template("x", [], raise_exception=1)


def test_environment_features():
    src = (
        "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
        "{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}|"
        "{{ tools|tojson }}|{{ {'b': 1, 'a': 'é<&'}|tojson(indent=1) }}|"
        "{{ bos_token }}{{ eos_token }}|{{ strftime_now('%Y')|length }}|{{ enable_thinking }}"
        "{% if messages[0].tool_calls is defined %}!{% endif %}"
    )
    out = render_chat_template(
        src, [{"role": "user", "content": "one", "tool_calls": None}, {"role": "user", "content": "two"}],
        tools=[{"n": "ü"}], bos_token="<s>", eos_token="</s>", enable_thinking=False)
    assert out == 'one|[{"n": "ü"}]|{\n "b": 1,\n "a": "é<&"\n}|<s></s>|4|False'
    # trim_blocks / lstrip_blocks as transformers: block tags leave no blank lines behind
    assert render_chat_template("  {% if true %}\nx\n  {% endif %}\ny", []) == "x\ny"
