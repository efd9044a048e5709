"""Tool calls in a chat reply: the parsers of `--tool-call-parser`, the JSON schema that forces a call
(tool_choice "required" or a named function), and ToolCallStream, which turns a choice's text into OpenAI's
`content` and `tool_calls`, whole or as streamed deltas.

    hermes       <tool_call>{"name": ..., "arguments": {...}}</tool_call>, one block per call (Qwen2, Qwen3, Hermes)
    llama3_json  {"name": ..., "parameters": {...}}, calls separated by ";", optionally after <|python_tag|>
    mistral      [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...], or from Mistral's v11 tokenizer
                 [TOOL_CALLS]name[ARGS]{...} per call (the marker is a special token: these replies keep theirs)
    pythonic     [get_weather(city="Rome"), get_time()]: a Python list of calls with literal arguments (Llama 3.2
                 and 4's pythonic format), read by `ast`, never evaluated
    qwen3_coder  <tool_call><function=NAME><parameter=KEY>VALUE</parameter>...</function></tool_call> (Qwen3-Coder,
                 Qwen3-Next): each value text, read as its schema's type (number, boolean, object...) where the
                 request's tool says one
    granite      <|tool_call|> (a special token: kept) or <tool_call>, then a JSON list of calls (Granite 3.x)
    phi4_mini_json  functools[{"name": ..., "arguments": {...}}, ...] (Phi-4-mini)
    lfm2         <|tool_call_start|>[pythonic calls]<|tool_call_end|>, content around it (LiquidAI's LFM2)
    functiongemma   <start_function_call>call:NAME{key:<escape>value<escape>,...}<end_function_call>
                 (FunctionGemma; each value JSON where it reads as such)
    openai       gpt-oss's harmony messages addressed to a function: <|channel|>commentary to=functions.NAME
                 <|constrain|>json<|message|>{...}<|call|> (the recipient may come before the channel, after
                 <|start|>assistant); the content is the final channel's message (with --reasoning-parser
                 openai_gptoss, whose answer this parser reads, the text before the first call)
and vLLM's other names for these formats: llama4_json, llama4_pythonic, qwen3_json and granite4 (hermes).
"""

from __future__ import annotations

import ast
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, cast


@dataclass(slots=True)
class FunctionCall:
    name: str
    arguments: str          # JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_json(self, index: int | None = None) -> dict[str, Any]:
        """The OpenAI `tool_calls` entry (with `index`, for a streamed delta)."""
        head = {} if index is None else {"index": index}
        return {**head, "id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


def _call_from(value: Any, arguments_key: str) -> FunctionCall | None:
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get(arguments_key, value.get("arguments", {}))
    return FunctionCall(value["name"], arguments if isinstance(arguments, str) else json.dumps(arguments))


def partial_marker_start(text: str, marker: str) -> int | None:
    """Where a suffix of `text` that begins `marker` starts (it may become the marker), if any."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return len(text) - k
    return None


class ToolParser:
    """Finds the calls a model wrote in its reply (`tool_start` while it streams, `extract` once it is whole);
    `tools`: the request's (OpenAI's shape), for a format whose arguments are typed by their schemas."""

    keeps_special_tokens = False    # True: the calls' marker is a special token, which the reply's text must keep

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        self.tools = tools or []

    def tool_start(self, text: str) -> int | None:
        """Where a tool call starts (or may be starting) in the text so far; None: it is all content."""
        raise NotImplementedError

    def extract(self, text: str) -> tuple[str | None, list[FunctionCall]]:
        """(content, calls); a reply whose calls do not parse is all content."""
        raise NotImplementedError


class _MarkedToolParser(ToolParser):
    """Calls after a marker (START), the content before it."""

    START: str

    def tool_start(self, text: str) -> int | None:
        index = text.find(self.START)
        return index if index >= 0 else partial_marker_start(text, self.START)


class HermesToolParser(_MarkedToolParser):
    """Calls in <tool_call> blocks; the text before the first block is the content."""

    START = "<tool_call>"
    _BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def extract(self, text: str) -> tuple[str | None, list[FunctionCall]]:
        start = text.find(self.START)
        if start < 0:
            return text, []
        calls = [_call_from(_loads(block), "arguments") for block in self._BLOCK.findall(text, start)]
        if not calls or None in calls:
            return text, []
        return text[:start].strip() or None, calls


class Llama3JsonToolParser(ToolParser):
    """A reply that is one or more JSON calls (`name` and `parameters`), separated by ";"."""

    PYTHON_TAG = "<|python_tag|>"

    def tool_start(self, text: str) -> int | None:
        stripped = text.lstrip()
        if stripped.startswith(("{", self.PYTHON_TAG)) or (stripped and self.PYTHON_TAG.startswith(stripped)):
            return 0
        return None

    def extract(self, text: str) -> tuple[str | None, list[FunctionCall]]:
        body = text.strip().removeprefix(self.PYTHON_TAG).strip()
        calls, decoder, position = [], json.JSONDecoder(), 0
        while position < len(body):
            try:
                value, position = decoder.raw_decode(body, position)
            except ValueError:
                return text, []
            calls.append(_call_from(value, "parameters"))
            position = len(body) - len(body[position:].lstrip().removeprefix(";").lstrip())
        if not calls or None in calls:
            return text, []
        return None, calls


class MistralToolParser(_MarkedToolParser):
    """The content, then [TOOL_CALLS] and the calls: a JSON list (or object) of calls, or `name[ARGS]{arguments}`
    after each [TOOL_CALLS] (Mistral's v11 tokenizer on)."""

    START, ARGS = "[TOOL_CALLS]", "[ARGS]"
    keeps_special_tokens = True         # [TOOL_CALLS] is one: a reply's text must keep it for the parser to see

    def extract(self, text: str) -> tuple[str | None, list[FunctionCall]]:
        start = text.find(self.START)
        if start < 0:
            return text, []
        calls: list[FunctionCall | None] = []
        for piece in filter(None, (p.strip() for p in text[start:].split(self.START))):
            if self.ARGS in piece:
                name, _, arguments = piece.partition(self.ARGS)
                value = _loads(arguments)
                calls.append(FunctionCall(name.strip(), json.dumps(value))
                             if name.strip() and isinstance(value, dict) else None)
            else:
                value = _loads(piece)
                calls += [_call_from(v, "arguments") for v in (value if isinstance(value, list) else [value])]
        if not calls or None in calls:
            return text, []
        return text[:start].strip() or None, cast(list[FunctionCall], calls)


class PythonicToolParser(ToolParser):
    """A reply that is a Python list of calls with keyword arguments, each a literal; the list is parsed (`ast`),
    never run."""

    TAGS = ("<|python_start|>", "<|python_end|>")      # Llama 4 may wrap the list in these

    def tool_start(self, text: str) -> int | None:
        stripped = text.lstrip()
        if stripped.startswith(("[", self.TAGS[0])) or (stripped and self.TAGS[0].startswith(stripped)):
            return 0
        return None

    def extract(self, text: str) -> tuple[str | None, list[FunctionCall]]:
        calls = _pythonic_calls(text.strip().removeprefix(self.TAGS[0]).removesuffix(self.TAGS[1]).strip())
        return (None, calls) if calls else (text, [])


def _pythonic_calls(body: str) -> list[FunctionCall]:
    """The calls of a Python list of calls with literal keyword arguments; [] if `body` is not one."""
    try:
        tree = ast.parse(body, mode="eval").body
    except SyntaxError:
        return []
    if not isinstance(tree, ast.List) or not tree.elts:
        return []
    calls = []
    for node in tree.elts:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            return []
        try:
            arguments = {_keyword(k): ast.literal_eval(k.value) for k in node.keywords}
        except ValueError:      # not a literal (or **kwargs)
            return []
        calls.append(FunctionCall(node.func.id, json.dumps(arguments)))
    return calls


class Qwen3CoderToolParser(_MarkedToolParser):
    """Qwen3-Coder's XML calls: <tool_call><function=NAME> and a <parameter=KEY>VALUE</parameter> per argument;
    the text before the first call is the content. A value is text unless the tool's schema gives that
    parameter another type, as which it is read (vLLM's schema-aware coercion)."""

    START = "<tool_call>"
    _CALL = re.compile(r"<tool_call>\s*<function=([^>\n]+)>(.*?)(?:</function>|$)", re.DOTALL)
    _PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|$)", re.DOTALL)

    def extract(self, text: str) -> tuple[str | None, list[FunctionCall]]:
        start = text.find(self.START)
        calls = [FunctionCall(name.strip(), json.dumps(self._arguments(name.strip(), body)))
                 for name, body in self._CALL.findall(text, start)] if start >= 0 else []
        return (text[:start].strip() or None, calls) if calls else (text, [])

    def _arguments(self, name: str, body: str) -> dict[str, Any]:
        properties = next((_parameters(t).get("properties", {}) for t in self.tools
                           if t.get("function", {}).get("name") == name), {})
        return {key.strip(): _typed(_one_newline_off(value), properties.get(key.strip()))
                for key, value in self._PARAMETER.findall(body)}


def _one_newline_off(value: str) -> str:
    """A parameter's text less the newline its template puts on each side."""
    return value.removeprefix("\n").removesuffix("\n")


def _typed(value: str, schema: Any) -> Any:
    """`value` read as its schema's type where that is not text (and it reads as JSON), else the text itself."""
    kinds = schema.get("type") if isinstance(schema, dict) else None
    kinds = set(kinds) if isinstance(kinds, list) else {kinds}
    if kinds & {"integer", "number", "boolean", "object", "array", "null"} and "string" not in kinds:
        return _json_or_text(value)
    return value


class GraniteToolParser(ToolParser):
    """Granite 3.x: a marker, <|tool_call|> (3.0; a special token, which the reply keeps) or <tool_call> (3.1), then
    a JSON list of calls; the text before the marker is the content."""

    MARKERS = ("<|tool_call|>", "<tool_call>")
    keeps_special_tokens = True

    def tool_start(self, text: str) -> int | None:
        found = [i for i in (text.find(m) for m in self.MARKERS) if i >= 0]
        if found:
            return min(found)
        partial = [i for i in (partial_marker_start(text, m) for m in self.MARKERS) if i is not None]
        return min(partial) if partial else None

    def extract(self, text: str) -> tuple[str | None, list[FunctionCall]]:
        start = self.tool_start(text)
        if start is None:
            return text, []
        marker = next(m for m in self.MARKERS if text.startswith(m, start))
        calls = _json_list_calls(text[start + len(marker):], "arguments")
        return (text[:start].strip() or None, calls) if calls else (text, [])


class Phi4MiniJsonToolParser(_MarkedToolParser):
    """Phi-4-mini: `functools` and a JSON list of calls (`arguments`, or `parameters`); the text before is the
    content."""

    START = "functools["

    def extract(self, text: str) -> tuple[str | None, list[FunctionCall]]:
        start = text.find(self.START)
        calls = _json_list_calls(text[start + len("functools"):], "parameters") if start >= 0 else []
        return (text[:start].strip() or None, calls) if calls else (text, [])


def _json_list_calls(text: str, arguments_key: str) -> list[FunctionCall]:
    """The calls of the JSON list `text` starts with (what follows it is ignored); [] if it is not one."""
    try:
        value, _ = json.JSONDecoder().raw_decode(text.lstrip())
    except ValueError:
        return []
    calls = [_call_from(v, arguments_key) for v in value] if isinstance(value, list) else [None]
    return [] if None in calls else cast(list[FunctionCall], calls)


class Lfm2ToolParser(_MarkedToolParser):
    """LiquidAI's LFM2: pythonic calls between <|tool_call_start|> and <|tool_call_end|> (special tokens, which the
    reply keeps); the text around them is the content."""

    START, END = "<|tool_call_start|>", "<|tool_call_end|>"
    keeps_special_tokens = True

    def extract(self, text: str) -> tuple[str | None, list[FunctionCall]]:
        start = text.find(self.START)
        if start < 0:
            return text, []
        body, _, after = text[start + len(self.START):].partition(self.END)
        calls = _pythonic_calls(body.strip())
        content = "\n".join(part for part in (text[:start].strip(), after.strip()) if part)
        return (content or None, calls) if calls else (text, [])


class FunctionGemmaToolParser(_MarkedToolParser):
    """FunctionGemma: <start_function_call>call:NAME{key:<escape>value<escape>,...}<end_function_call> per call
    (special tokens, which the reply keeps); each value JSON where it reads as such, else text."""

    START = "<start_function_call>"
    keeps_special_tokens = True
    _CALL = re.compile(r"<start_function_call>call:(\w+)\{(.*?)\}(?:<end_function_call>|$)", re.DOTALL)
    _ARGUMENT = re.compile(r"(\w+):<escape>(.*?)<escape>", re.DOTALL)

    def extract(self, text: str) -> tuple[str | None, list[FunctionCall]]:
        start = text.find(self.START)
        calls = [FunctionCall(name, json.dumps({key: _json_or_text(value)
                                                for key, value in self._ARGUMENT.findall(arguments)}))
                 for name, arguments in self._CALL.findall(text, start)] if start >= 0 else []
        return (text[:start].strip() or None, calls) if calls else (text, [])


class OpenAIToolParser(ToolParser):
    """gpt-oss's harmony calls: each message whose header names a function (to=functions.NAME), its body the
    arguments (up to <|call|>, the end of the message or of the reply); the content the final channel's messages'
    bodies, or without one the text before the first message; special tokens, which the reply keeps."""

    STARTS = ("<|start|>", "<|channel|>")     # a message's header, which may name a function
    keeps_special_tokens = True
    _MESSAGE = re.compile(r"(?:<\|start\|>)?(?P<header>(?:(?!<\|message\|>|<\|start\|>).)*)<\|message\|>"
                          r"(?P<body>(?:(?!<\|start\|>|<\|call\|>|<\|end\|>).)*)", re.DOTALL)
    _RECIPIENT = re.compile(r"to=functions\.([^\s<]+)")
    _CHANNEL = re.compile(r"<\|channel\|>(\w+)")

    def tool_start(self, text: str) -> int | None:
        found = [index for start in self.STARTS
                 if (index := text.find(start)) >= 0 or (index := partial_marker_start(text, start)) is not None]
        return min(found, default=None)

    def extract(self, text: str) -> tuple[str | None, list[FunctionCall]]:
        messages = list(self._MESSAGE.finditer(text))
        calls = [FunctionCall(recipient.group(1), message["body"].strip()) for message in messages
                 if (recipient := self._RECIPIENT.search(message["header"]))]
        finals = [message["body"] for message in messages
                  if (channel := self._CHANNEL.search(message["header"])) and channel.group(1) == "final"]
        if not messages:
            return text, []
        content = "".join(finals) if finals else text[:messages[0].start()].strip()
        return content or None, calls


def _json_or_text(value: str) -> Any:
    """`value` read as JSON where it is JSON (null included), else the text itself."""
    read = _loads(value)
    return value if read is None and value.strip() != "null" else read


def _keyword(keyword: ast.keyword) -> str:
    if keyword.arg is None:
        raise ValueError("**kwargs in a call")
    return keyword.arg


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser, "mistral": MistralToolParser,
    "pythonic": PythonicToolParser, "qwen3_coder": Qwen3CoderToolParser, "granite": GraniteToolParser,
    "phi4_mini_json": Phi4MiniJsonToolParser, "lfm2": Lfm2ToolParser, "functiongemma": FunctionGemmaToolParser,
    "openai": OpenAIToolParser,
    # vLLM's other names for these formats
    "llama4_json": Llama3JsonToolParser, "llama4_pythonic": PythonicToolParser, "qwen3_json": HermesToolParser,
    "qwen3_xml": Qwen3CoderToolParser, "granite4": HermesToolParser}


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


# ---- forcing a call ----------------------------------------------------------------------------------------------
def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}


def named_tool_schema(tool: dict[str, Any]) -> dict[str, Any]:
    """tool_choice names a function: the reply is that function's arguments."""
    return _parameters(tool)


def required_tools_schema(tools: list[dict[str, Any]], parallel: bool = True) -> dict[str, Any]:
    """tool_choice "required": the reply is a JSON list of one or more calls of the given tools (exactly one when
    not `parallel`, as vLLM does for parallel_tool_calls false)."""
    calls = [{"type": "object", "properties": {"name": {"const": t["function"]["name"]}, "parameters": _parameters(t)},
              "required": ["name", "parameters"], "additionalProperties": False} for t in tools]
    return {"type": "array", "minItems": 1, "items": {"anyOf": calls}} | ({} if parallel else {"maxItems": 1})


# ---- a choice's text -> content and tool calls -------------------------------------------------------------------
class ToolCallStream:
    """One choice's tool calls, in one of three modes.

    Args:
        parser: "auto": the parser that finds calls in free text (content before them streams as it comes).
        forced_name: a named tool_choice: the whole reply is this function's arguments (they stream as they come).
        required: tool_choice "required": the reply is a JSON list of calls (sent once complete).
        parallel: False: only the first call the parser finds is kept (vLLM's parallel_tool_calls false; the
            other modes make one call then).
    """

    def __init__(self, parser: ToolParser | None = None,
                 forced_name: str | None = None, required: bool = False, parallel: bool = True) -> None:
        self.parser, self.forced_name, self.required, self.parallel = parser, forced_name, required, parallel
        self.text = ""
        self.num_content_sent = 0
        self.forced_call = FunctionCall(forced_name, "") if forced_name is not None else None
        self.forced_call_named = False

    def final(self, text: str) -> tuple[str | None, list[FunctionCall]]:
        """(content, calls) of a whole reply."""
        if self.forced_call is not None:
            self.forced_call.arguments = text
            return None, [self.forced_call]
        if self.required:
            value = _loads(text)
            calls = [_call_from(v, "parameters") for v in value] if isinstance(value, list) else [None]
            return (text, []) if None in calls else (None, calls)
        assert self.parser is not None
        content, calls = self.parser.extract(text)
        return content, calls if self.parallel else calls[:1]

    def delta(self, text: str, finished: bool) -> dict[str, Any]:
        """The streamed `delta` for this much new text (`finished`: the reply's last)."""
        self.text += text
        if self.forced_call is not None:
            return self._forced_delta(text)
        if not finished:
            start = self.parser.tool_start(self.text) if self.parser is not None else 0
            return self._content_delta(len(self.text) if start is None else start)
        content, calls = self.final(self.text)
        if not calls:
            return self._content_delta(len(self.text))
        return {"tool_calls": [call.to_json(i) for i, call in enumerate(calls)]}

    def _content_delta(self, end: int) -> dict[str, Any]:
        content, self.num_content_sent = self.text[self.num_content_sent:end], max(end, self.num_content_sent)
        return {"content": content} if content else {}

    def _forced_delta(self, text: str) -> dict[str, Any]:
        assert self.forced_call is not None
        if not self.forced_call_named:         # the first delta names the call
            self.forced_call_named = True
            entry = self.forced_call.to_json(0)
        elif not text:
            return {}
        else:
            entry = {"index": 0, "function": {}}
        entry["function"]["arguments"] = text
        return {"tool_calls": [entry]}


# ---- a chat template that knows nothing of tools -----------------------------------------------------------------
_TOOLS_PROMPT = """You can call functions. These are the functions, as JSON schemas:
<tools>
{tools}
</tools>
To call a function, reply with its name and arguments as a JSON object inside <tool_call></tool_call> tags:
<tool_call>
{{"name": "<function name>", "arguments": <arguments as a JSON object>}}
</tool_call>"""


def gather_call_deltas(calls: dict[int, dict[str, Any]], pieces: list[dict[str, Any]]) -> None:
    """Add a chat chunk's streamed tool-call pieces (the first names a call, the rest add to its arguments) to
    `calls`, by index, in the chat's shape: how the Responses and Messages APIs gather calls to send them whole."""
    for piece in pieces:
        call = calls.setdefault(piece["index"], {"id": None, "function": {"name": None, "arguments": ""}})
        call["id"] = piece.get("id") or call["id"]
        function = piece.get("function", {})
        call["function"]["name"] = function.get("name") or call["function"]["name"]
        call["function"]["arguments"] += function.get("arguments") or ""


def with_tools(messages: list[dict[str, Any]], tools: list[dict[str, Any]],
               template: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """How tools reach the model (the server's `tools`, `LLM.chat(tools=...)`): as the chat template's `tools`
    variable when the template uses one, else written into the system message (`inline_tools`). Returns the
    messages and the extra template variables."""
    if "tools" in template:
        return messages, {"tools": tools}
    return inline_tools(messages, tools), {}


def inline_tools(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The conversation with the tools written into its system message, in the Hermes format (the one the
    hermes parser reads back), and each earlier assistant call written into its content the same way."""
    prompt = _TOOLS_PROMPT.format(tools="\n".join(json.dumps(t["function"]) for t in tools))
    out = [_with_calls_inline(m) for m in messages]
    if out and out[0].get("role") == "system" and isinstance(out[0].get("content"), str):
        return [{**out[0], "content": out[0]["content"] + "\n\n" + prompt}, *out[1:]]
    return [{"role": "system", "content": prompt}, *out]


def _with_calls_inline(message: dict[str, Any]) -> dict[str, Any]:
    calls = message.get("tool_calls") if message.get("role") == "assistant" else None
    if not calls:
        return message
    blocks = [f"<tool_call>\n{json.dumps(_inline_call(c))}\n</tool_call>" for c in calls]
    content = message.get("content") or ""
    return {key: value for key, value in message.items() if key != "tool_calls"} | {
        "content": "\n".join(([content] if content else []) + blocks)}


def _inline_call(call: Any) -> dict[str, Any]:
    function = call.get("function", {}) if isinstance(call, dict) else {}
    arguments = function.get("arguments", "{}")
    return {"name": function.get("name"), "arguments": _loads(arguments) if isinstance(arguments, str) else arguments}
