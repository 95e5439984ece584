"""OpenAI-compatible request/response models and their conversion to :class:`SamplingParams`.

Shapes follow the OpenAI API reference (``/v1/completions``: the legacy Completions API;
``/v1/chat/completions``: Chat Completions) plus vLLM's sampling extensions (``top_k``,
``min_p``, ``repetition_penalty``, ``stop_token_ids``, ``ignore_eos``,
``skip_special_tokens``), which memra users compare us with.

Validation policy (DESIGN.md, "nothing silently clamped"):

* unknown fields are accepted and ignored (OpenAI clients send fields we do not know);
* known fields are type-checked strictly (``"max_tokens": "5"`` or ``"n": 1.5`` are
  errors, not coerced) and range-checked; NaN/inf are rejected;
* explicit ``null`` means "the default" for optional fields, as in vLLM;
* features we cannot honour (``suffix``, ``best_of != n``) are rejected with an error naming
  the field rather than ignored.

Every validation failure raises :class:`ProtocolError` (or pydantic's
``ValidationError``); the app turns both into an OpenAI-style 400 naming the parameter.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

from ..engine.sampling import SamplingParams

__all__ = [
    "ProtocolError", "ErrorInfo", "ErrorResponse", "StreamOptions",
    "CompletionRequest", "ChatMessage", "ChatCompletionRequest", "TokenizeRequest", "DetokenizeRequest",
    "UsageInfo", "PromptTokensDetails", "CompletionLogprobs", "CompletionChoice", "CompletionResponse",
    "ChatTopLogprob", "ChatTokenLogprob", "ChatLogprobs", "ChatResponseMessage", "ChatChoice",
    "ChatCompletionResponse", "ModelCard", "ModelList", "TokenizeResponse", "DetokenizeResponse",
    "random_id", "MAX_N", "MAX_COMPLETION_LOGPROBS", "MAX_CHAT_TOP_LOGPROBS",
]

#: What a tool's function name may be (OpenAI: ``^[a-zA-Z0-9_-]{1,64}$``; dots and colons too, as
#: agents namespace tools with them); the call formats write names unescaped.
_FUNCTION_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,64}")

#: Most completions per prompt (OpenAI documents n <= 128).
MAX_N = 128
#: Legacy completions ``logprobs``: OpenAI allows 0..5.
MAX_COMPLETION_LOGPROBS = 5
#: Chat ``top_logprobs``: OpenAI allows 0..20.
MAX_CHAT_TOP_LOGPROBS = 20


class ProtocolError(ValueError):
    """A request that is well-formed JSON but asks for something invalid or unsupported.

    Attributes:
        message: what is wrong and what was expected.
        param: the offending request field (dotted path), or None.
    """

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param


def random_id(prefix: str) -> str:
    """An OpenAI-style object id, e.g. ``cmpl-3f2a...`` (32 hex digits)."""
    return f"{prefix}-{uuid.uuid4().hex}"


# --------------------------------------------------------------------------- requests

class _Request(BaseModel):
    """Base of request bodies: strict types, no NaN/inf, unknown fields refused (400 naming
    them, as OpenAI's API does)."""

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


class StreamOptions(_Request):
    """``stream_options``: ``include_usage`` adds a final chunk with ``usage`` and empty ``choices``."""

    include_usage: StrictBool | None = False


class _SamplingFields(_Request):
    """Fields shared by /v1/completions and /v1/chat/completions (OpenAI + vLLM extensions)."""

    model: StrictStr | None = Field(None, description="must equal the served model name (default: it)")
    n: StrictInt | None = Field(None, ge=1, le=MAX_N, description="completions per prompt (default 1)")
    temperature: StrictFloat | None = Field(None, ge=0, description="0 is greedy (default 1.0)")
    top_p: StrictFloat | None = Field(None, gt=0, le=1, description="nucleus mass (default 1.0)")
    top_k: StrictInt | None = Field(None, ge=-1, description="0 or -1 disables it (default)")
    min_p: StrictFloat | None = Field(None, ge=0, lt=1)
    presence_penalty: StrictFloat | None = Field(None, ge=-2, le=2)
    frequency_penalty: StrictFloat | None = Field(None, ge=-2, le=2)
    repetition_penalty: StrictFloat | None = Field(None, gt=0)
    seed: StrictInt | None = Field(None, ge=-(2**63), le=2**63 - 1,
                                   description="int64; same seed and parameters: same tokens")
    stop: StrictStr | list[StrictStr] | None = Field(None, description="stop strings (not included in the text)")
    stop_token_ids: list[StrictInt] | None = Field(None, description="token ids that end a completion")
    ignore_eos: StrictBool | None = False
    skip_special_tokens: StrictBool | None = True
    stream: StrictBool | None = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, StrictFloat | StrictInt] | None = Field(
        None, description="token id (as a string) -> bias in [-100, 100] added to its logit")
    min_tokens: StrictInt | None = Field(None, ge=0, description="generate at least this many tokens before "
                                                                 "EOS / stop_token_ids / stop strings (vLLM)")
    user: StrictStr | None = Field(None, description="ignored")
    response_format: dict[str, Any] | None = Field(
        None, description="{'type': 'text' | 'json_object'} or {'type': 'json_schema', 'json_schema': {'name': ..., "
                          "'schema': {...}, 'strict': true}}: output that parses (grammar-constrained)")
    structured_outputs: dict[str, Any] | None = Field(
        None, description="vLLM's extension: exactly one of {'json': schema}, {'regex': str}, {'choice': [str]}, "
                          "{'grammar': Lark grammar}")

    def structured_request(self) -> tuple[str, Any, str] | None:
        """What the output must follow: (kind, spec, the field that asked), kind one of ``json``
        (spec a JSON schema), ``regex``, ``choice``, ``grammar`` (Lark); None for free text.

        Raises:
            ProtocolError: a malformed ``response_format`` / ``structured_outputs``, or both given.
        """
        out = None
        rf = self.response_format
        if rf is not None:
            kind = rf.get("type")
            if kind == "json_object":
                out = ("json", {"type": "object"}, "response_format")
            elif kind == "json_schema":
                js = rf.get("json_schema")
                if not isinstance(js, dict) or not isinstance(js.get("schema", {}), dict):
                    raise ProtocolError("response_format json_schema must be {'name': str, 'schema': {...}, "
                                        "'strict': bool}", "response_format.json_schema")
                if not isinstance(js.get("strict", False), (bool, type(None))):
                    raise ProtocolError("response_format.json_schema.strict must be true or false",
                                        "response_format.json_schema.strict")
                schema = js.get("schema") or {"type": "object"}
                out = ("json", closed_objects(schema) if js.get("strict") else schema,
                       "response_format.json_schema.schema")
            elif kind != "text":
                raise ProtocolError(f"response_format type {kind!r} must be 'text', 'json_object' or 'json_schema'",
                                    "response_format.type")
        so = self.structured_outputs
        if so is not None:
            if out is not None:
                raise ProtocolError("give response_format or structured_outputs, not both", "structured_outputs")
            keys = [k for k in ("json", "regex", "choice", "grammar") if so.get(k) is not None]
            if len(keys) != 1 or set(so) - {"json", "regex", "choice", "grammar"}:
                raise ProtocolError("structured_outputs must hold exactly one of 'json', 'regex', 'choice', "
                                    f"'grammar', got {sorted(so)}", "structured_outputs")
            k = keys[0]
            want = {"json": dict, "regex": str, "choice": list, "grammar": str}[k]
            if not isinstance(so[k], want):
                raise ProtocolError(f"structured_outputs.{k} must be a {want.__name__}", f"structured_outputs.{k}")
            out = (k, so[k], f"structured_outputs.{k}")
        return out

    def _logit_bias(self) -> dict[int, float]:
        out = {}
        for k, v in (self.logit_bias or {}).items():
            if not (k.isascii() and k.isdigit()):
                raise ProtocolError(f"logit_bias keys must be token ids (decimal strings), got {k!r}", "logit_bias")
            if not -100 <= v <= 100:
                raise ProtocolError(f"logit_bias[{k!r}] = {v} must be in [-100, 100]", "logit_bias")
            out[int(k)] = float(v)
        return out

    def _check_common(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise ProtocolError("stream_options is only allowed when stream is true", "stream_options")
        if self.stop_token_ids and any(t < 0 for t in self.stop_token_ids):
            raise ProtocolError("stop_token_ids must be token ids >= 0", "stop_token_ids")
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        if any(s == "" for s in stops):
            raise ProtocolError("stop strings must be non-empty", "stop")

    @property
    def include_usage(self) -> bool:
        """Whether a streamed response ends with a usage chunk."""
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    def _sampling(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        bias = self._logit_bias()
        try:
            return SamplingParams(
                n=1 if self.n is None else self.n,
                max_tokens=max_tokens,
                temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p,
                top_k=0 if self.top_k is None else self.top_k,
                min_p=0.0 if self.min_p is None else self.min_p,
                repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
                presence_penalty=0.0 if self.presence_penalty is None else self.presence_penalty,
                frequency_penalty=0.0 if self.frequency_penalty is None else self.frequency_penalty,
                seed=self.seed, stop=stop, stop_token_ids=list(self.stop_token_ids or []),
                ignore_eos=bool(self.ignore_eos), logprobs=logprobs,
                skip_special_tokens=True if self.skip_special_tokens is None else self.skip_special_tokens,
                min_tokens=self.min_tokens or 0, logit_bias=bias,
            )
        except ValueError as e:  # "invalid sampling parameter NAME=...": name the parameter
            raise ProtocolError(str(e), _param_of(str(e))) from None


def closed_objects(schema: Any) -> Any:
    """``schema`` with ``additionalProperties: false`` on every object schema that does not say
    otherwise: OpenAI's ``strict`` structured outputs allow exactly the declared properties."""
    if isinstance(schema, list):
        return [closed_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: closed_objects(v) if k in ("items", "anyOf", "oneOf", "allOf", "prefixItems", "not") else v
           for k, v in schema.items()}
    for key in ("properties", "$defs", "definitions"):
        if isinstance(schema.get(key), dict):
            out[key] = {name: closed_objects(sub) for name, sub in schema[key].items()}
    is_object = schema.get("type") == "object" or (isinstance(schema.get("type"), list) and "object" in schema["type"])
    if (is_object or "properties" in schema) and "additionalProperties" not in schema:
        out["additionalProperties"] = False
    return out


def _param_of(message: str) -> str | None:
    prefix = "invalid sampling parameter "
    if message.startswith(prefix):
        return message[len(prefix):].split("=", 1)[0].split(":", 1)[0].strip() or None
    return None


class CompletionRequest(_SamplingFields):
    """Body of ``POST /v1/completions`` (OpenAI legacy Completions API + vLLM extensions).

    ``prompt`` is a string, a list of strings, a list of token ids, or a list of lists of
    token ids; a batch yields ``len(prompts) * n`` choices indexed prompt-major
    (``index = prompt_index * n + j``), as OpenAI and vLLM do. ``logprobs`` (0..5) asks
    for the chosen token's logprob and the top-``logprobs`` alternatives per token;
    with ``echo`` the prompt is prepended to the text and (with ``logprobs``) its
    tokens' logprobs too, the first being null.
    """

    model_config = ConfigDict(json_schema_extra={"examples": [
        {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0},
        {"prompt": ["Once upon a time", "def fib(n):"], "max_tokens": 4, "n": 2, "seed": 1, "logprobs": 2},
        {"prompt": [1, 2, 3], "max_tokens": 3, "echo": True, "logprobs": 1, "stream": True,
         "stream_options": {"include_usage": True}},
    ]})

    prompt: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    max_tokens: StrictInt | None = Field(16, ge=1, description="tokens to generate per choice (default 16)")
    echo: StrictBool | None = False
    logprobs: StrictInt | None = Field(None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    suffix: StrictStr | None = Field(None, description="not supported (must be null)")
    best_of: StrictInt | None = Field(None, ge=1, description="only null or equal to n is supported")

    def prompts(self) -> list[str | list[int]]:
        """The prompts as a list: each a string or a list of token ids.

        Raises:
            ProtocolError: the list is empty, or a token-id prompt is empty / has a negative id.
        """
        p = self.prompt
        if isinstance(p, str):
            items: list = [p]
        elif not p:
            raise ProtocolError("prompt must not be an empty list", "prompt")
        elif isinstance(p[0], int):
            items = [p]
        else:
            items = list(p)
        for i, item in enumerate(items):
            if isinstance(item, list):
                if not item:
                    raise ProtocolError(f"prompt[{i}] is an empty list of token ids", "prompt")
                if any(t < 0 for t in item):
                    raise ProtocolError(f"prompt token ids must be >= 0 (prompt {i})", "prompt")
        return items

    def to_sampling_params(self) -> SamplingParams:
        """The engine's :class:`SamplingParams` for this request.

        Raises:
            ProtocolError: unsupported feature or value out of range, naming the parameter.
        """
        self._check_common()
        if self.suffix:
            raise ProtocolError("suffix is not supported by this server", "suffix")
        n = 1 if self.n is None else self.n
        if self.best_of is not None and self.best_of != n:
            raise ProtocolError(f"best_of={self.best_of} is not supported: it must be null or equal to n={n}",
                                "best_of")
        return self._sampling(16 if self.max_tokens is None else self.max_tokens, self.logprobs)


class ChatMessage(BaseModel):
    """One chat message. ``content`` is a string, a list of text parts, or null (assistant
    messages with ``tool_calls``). Other keys (``name``, ``tool_calls``, ``tool_call_id``)
    are passed to the chat template, a tool call's JSON-string ``arguments`` as the mapping it
    encodes (what templates iterate over)."""

    model_config = ConfigDict(strict=True, extra="allow")

    role: StrictStr
    content: StrictStr | list[dict[str, Any]] | None = None

    def template_dict(self, index: int) -> dict[str, Any]:
        """The message as the chat template sees it: text parts joined with newlines.

        Raises:
            ProtocolError: a content part that is not ``{"type": "text", "text": str}``.
        """
        d = self.model_dump(exclude_none=False)
        if self.content is None and self.role in ("system", "developer", "user", "tool"):
            raise ProtocolError(f"messages[{index}].content is required for role {self.role!r}",
                                f"messages[{index}].content")
        if isinstance(self.content, list):
            texts = []
            for j, part in enumerate(self.content):
                where = f"messages[{index}].content[{j}]"
                if part.get("type") != "text":
                    raise ProtocolError(f"{where}: unsupported content part type {part.get('type')!r} "
                                        f"(only 'text' parts are supported)", f"{where}.type")
                if not isinstance(part.get("text"), str):
                    raise ProtocolError(f"{where}.text must be a string", f"{where}.text")
                texts.append(part["text"])
            d["content"] = "\n".join(texts)
        for call in d.get("tool_calls") or []:  # templates expect arguments as a mapping (vLLM does this too)
            f = call.get("function") if isinstance(call, dict) else None
            if isinstance(f, dict) and isinstance(f.get("arguments"), str):
                try:
                    args = json.loads(f["arguments"])
                except ValueError:
                    continue
                if isinstance(args, dict):
                    call["function"] = {**f, "arguments": args}
        return d


class ChatCompletionRequest(_SamplingFields):
    """Body of ``POST /v1/chat/completions`` (OpenAI Chat Completions + vLLM extensions).

    ``max_completion_tokens`` (preferred) or ``max_tokens`` bound each choice; when both
    are absent the rest of the context is the bound (OpenAI and vLLM behaviour).
    ``logprobs: true`` returns the chosen token's logprob per token and, with
    ``top_logprobs`` (0..20), the alternatives; ``top_logprobs`` without ``logprobs: true``
    is an error (as in OpenAI's API).
    """

    model_config = ConfigDict(json_schema_extra={"examples": [
        {"messages": [{"role": "user", "content": "Name three colours."}], "max_tokens": 8, "temperature": 0},
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [
            {"type": "text", "text": "Hi!"}]}], "max_completion_tokens": 4, "n": 2, "logprobs": True,
         "top_logprobs": 2, "stream": True, "stream_options": {"include_usage": True}, "stop": ["\n"]},
    ]})

    messages: list[ChatMessage] = Field(..., min_length=1)
    max_tokens: StrictInt | None = Field(None, ge=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    logprobs: StrictBool | None = False
    top_logprobs: StrictInt | None = Field(None, ge=0, le=MAX_CHAT_TOP_LOGPROBS)
    add_generation_prompt: StrictBool | None = True
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: StrictStr | dict[str, Any] | None = None

    def template_messages(self) -> list[dict[str, Any]]:
        """Messages as dicts for the chat template (see :meth:`ChatMessage.template_dict`)."""
        return [m.template_dict(i) for i, m in enumerate(self.messages)]

    def tool_mode(self) -> tuple[str, str | None]:
        """(``auto`` | ``none`` | ``required`` | ``named``, the named function or None), checked
        against ``tools`` (OpenAI: a named or required choice needs tools, the name one of them).

        Raises:
            ProtocolError: a malformed tool or tool_choice, naming which.
        """
        names = []
        for i, t in enumerate(self.tools or []):
            f = t.get("function") if isinstance(t, dict) else None
            if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(f, dict) \
                    or not isinstance(f.get("name"), str) or not f["name"]:
                raise ProtocolError(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': str, "
                                    f"'parameters': object}}}}", f"tools[{i}]")
            if not _FUNCTION_NAME.fullmatch(f["name"]):
                raise ProtocolError(f"tools[{i}].function.name {f['name']!r} must be 1-64 letters, digits or "
                                    f"'_', '-', '.', ':'", f"tools[{i}].function.name")
            if "parameters" in f and not isinstance(f["parameters"], dict):
                raise ProtocolError(f"tools[{i}].function.parameters must be a JSON schema object",
                                    f"tools[{i}].function.parameters")
            names.append(f["name"])
        c = self.tool_choice
        if c is None:
            return ("auto" if names else "none"), None
        if isinstance(c, str):
            if c not in ("auto", "none", "required"):
                raise ProtocolError(f"tool_choice {c!r} must be 'auto', 'none', 'required' or "
                                    f"{{'type': 'function', 'function': {{'name': ...}}}}", "tool_choice")
            if c == "required" and not names:
                raise ProtocolError("tool_choice 'required' needs at least one tool in tools", "tool_choice")
            return c, None
        f = c.get("function")
        if c.get("type") != "function" or not isinstance(f, dict) or not isinstance(f.get("name"), str):
            raise ProtocolError("tool_choice must be a string or {'type': 'function', 'function': {'name': ...}}",
                                "tool_choice")
        if f["name"] not in names:
            raise ProtocolError(f"tool_choice names function {f['name']!r}, which is not in tools "
                                f"({', '.join(map(repr, names)) or 'none given'})", "tool_choice")
        return "named", f["name"]

    def template_kwargs(self) -> dict[str, Any]:
        """Extra chat-template variables: ``tools`` and ``chat_template_kwargs``.

        Raises:
            ProtocolError: a malformed ``tools`` / ``tool_choice``, or reserved template variables.
        """
        self.tool_mode()
        kw = dict(self.chat_template_kwargs or {})
        for reserved in ("messages", "add_generation_prompt", "tools", "chat_template"):
            if reserved in kw:
                raise ProtocolError(f"chat_template_kwargs must not set {reserved!r}", "chat_template_kwargs")
        if self.tools and self.tool_choice != "none":
            kw["tools"] = self.tools
        return kw

    def to_sampling_params(self, prompt_len: int, max_model_len: int) -> SamplingParams:
        """The engine's :class:`SamplingParams` for a prompt of ``prompt_len`` tokens.

        Raises:
            ProtocolError: invalid or unsupported parameter (named), or no room left in
                the context when no max_tokens was given.
        """
        self._check_common()
        if self.top_logprobs is not None and not self.logprobs:
            raise ProtocolError("top_logprobs requires logprobs to be true", "top_logprobs")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        if max_tokens is None:
            max_tokens = max_model_len - prompt_len
            if max_tokens < 1:
                raise ProtocolError(f"the prompt has {prompt_len} tokens, which leaves no room to generate in "
                                    f"the context length of {max_model_len} tokens", "messages")
        top = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling(max_tokens, top)


class TokenizeRequest(_Request):
    """Body of ``POST /tokenize`` (vLLM): either ``prompt`` (text) or ``messages`` (chat).

    ``add_special_tokens`` defaults to True for ``prompt`` (BOS as the model says) and to
    False for ``messages`` (the chat template writes them).
    """

    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: StrictBool | None = None
    add_generation_prompt: StrictBool | None = True
    return_token_strs: StrictBool | None = Field(False, description="also return each token's text (vLLM)")

    def check(self) -> None:
        """Raises: ProtocolError unless exactly one of ``prompt`` / ``messages`` is given."""
        if (self.prompt is None) == (self.messages is None):
            raise ProtocolError("give exactly one of 'prompt' or 'messages'", "prompt")


class DetokenizeRequest(_Request):
    """Body of ``POST /detokenize`` (vLLM): token ids to turn back into text."""

    model: StrictStr | None = None
    tokens: list[StrictInt]


# --------------------------------------------------------------------------- responses

class ErrorInfo(BaseModel):
    """The ``error`` object: message, OpenAI error type, offending parameter, machine code."""

    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorInfo


class PromptTokensDetails(BaseModel):
    """``cached_tokens``: prompt tokens whose KV came from the prefix cache (not prefilled)."""

    cached_tokens: int = 0


class UsageInfo(BaseModel):
    """Token counts: prompt tokens are counted once per prompt (not per choice)."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    """Legacy completions logprobs: parallel lists, one entry per token; ``text_offset`` is
    each token's character offset in the choice's text."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    """One completion; ``stop_reason`` (vLLM) is the stop string or token id that ended it."""

    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class CompletionResponse(BaseModel):
    """``text_completion`` object (also the shape of each streamed chunk, with partial text)."""

    id: str
    object: str = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    system_fingerprint: str | None = None


class ChatTopLogprob(BaseModel):
    """A token with its logprob and its UTF-8 ``bytes`` (exact even for part of a character)."""

    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(ChatTopLogprob):
    """A generated token and the ``top_logprobs`` alternatives at its position."""

    top_logprobs: list[ChatTopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    """Chat ``logprobs``: one entry per generated token in ``content``."""

    content: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(BaseModel):
    """The assistant's reply: ``content`` (text outside tool calls; null when there is only
    calls), ``tool_calls`` (OpenAI shape, ``arguments`` a JSON string) and, with a reasoning
    parser, ``reasoning_content`` (the ``<think>`` block)."""

    role: str = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


class ChatChoice(BaseModel):
    """One chat completion (``index`` 0..n-1)."""

    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class ChatCompletionResponse(BaseModel):
    """``chat.completion`` object."""

    id: str
    object: str = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None


class ModelCard(BaseModel):
    """A served model (``GET /v1/models``); ``root`` is the model it was loaded from."""

    id: str
    object: str = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "memra"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    """``GET /v1/models``: the served model."""

    object: str = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    """``POST /tokenize``: token ids, their count and the context length."""

    tokens: list[int]
    count: int
    max_model_len: int
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    """``POST /detokenize``: the text of the ids."""

    prompt: str
