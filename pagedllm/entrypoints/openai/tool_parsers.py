"""Tool calls in a chat reply: the parsers of `--tool-call-parser`, the JSON schema that forces a call
(tool_choice "required" or a named function), and ToolCallStream, which turns a choice's text into OpenAI's
`content` and `tool_calls`, whole or as streamed deltas.

    hermes       <tool_call>{"name": ..., "arguments": {...}}</tool_call>, one block per call (Qwen2, Qwen3, Hermes)
    llama3_json  {"name": ..., "parameters": {...}}, calls separated by ";", optionally after <|python_tag|>
    mistral      [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...], or from Mistral's v11 tokenizer
                 [TOOL_CALLS]name[ARGS]{...} per call (the marker is a special token: these replies keep theirs)
    pythonic     [get_weather(city="Rome"), get_time()]: a Python list of calls with literal arguments (Llama 3.2
                 and 4's pythonic format), read by `ast`, never evaluated
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
    """Finds the calls a model wrote in its reply (`tool_start` while it streams, `extract` once it is whole)."""

    keeps_special_tokens = False    # True: the calls' marker is a special token, which the reply's text must keep

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
        body = text.strip().removeprefix(self.TAGS[0]).removesuffix(self.TAGS[1]).strip()
        try:
            tree = ast.parse(body, mode="eval").body
        except SyntaxError:
            return text, []
        if not isinstance(tree, ast.List) or not tree.elts:
            return text, []
        calls = []
        for node in tree.elts:
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
                return text, []
            try:
                arguments = {_keyword(k): ast.literal_eval(k.value) for k in node.keywords}
            except ValueError:      # not a literal (or **kwargs)
                return text, []
            calls.append(FunctionCall(node.func.id, json.dumps(arguments)))
        return None, calls


def _keyword(keyword: ast.keyword) -> str:
    if keyword.arg is None:
        raise ValueError("**kwargs in a call")
    return keyword.arg


TOOL_PARSERS: dict[str, type[ToolParser]] = {"hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser,
                                              "mistral": MistralToolParser, "pythonic": PythonicToolParser}


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
