"""POST /v1/chat/completions: messages -> the chat template -> an assistant reply, whole or streamed.

Tools: tool_choice "auto" (the default when tools are given) needs the server's --enable-auto-tool-choice and
--tool-call-parser, and the parser finds the calls in the reply; "required" and a named function force the reply
with a JSON schema (structured outputs), so the calls always parse; "none" leaves the reply as text. The tools
reach the model through the chat template's `tools` variable, or, for a template that never mentions tools (such as
SmolLM2's), in the system message, in the Hermes format (tool_parsers.inline_tools).

Reasoning: with --reasoning-parser, a reply's thinking (<think> ... </think>) goes to the message's `reasoning`
(streamed: the deltas' `reasoning`) and the rest to `content`, which is what the tool parser reads.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Sequence
from typing import Any, cast

import jinja2

from pagedllm.engine.async_engine import AsyncEngine
from pagedllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    NamedToolChoice,
    OpenAIError,
    now,
)
from pagedllm.entrypoints.openai.reasoning_parsers import REASONING_FORMATS, REASONING_PARSERS, ReasoningStream
from pagedllm.entrypoints.openai.serving_base import FrontendOptions, LoRAModules, Prompt, ServerLimits
from pagedllm.entrypoints.openai.serving_choices import (
    ChoiceState,
    GenerationServing,
    ResponseOptions,
    TokenLogprob,
    keep_prompt_logprobs,
    prompt_logprobs_json,
)
from pagedllm.entrypoints.openai.tool_parsers import (
    TOOL_PARSERS,
    ToolCallStream,
    named_tool_schema,
    required_tools_schema,
    with_tools,
)
from pagedllm.multimodal import check_image_count
from pagedllm.outputs import PromptLogprobs
from pagedllm.sampling_params import SamplingParams, StructuredOutputsParams
from pagedllm.tokenizer.chat_template import (
    apply_chat_template,
    conversation_images,
    image_parts,
    render_chat_template,
    validate_messages,
)


class ChatChoiceState(ChoiceState):
    """A chat choice, with its message's `role`, its tool calls when the request has tools, and its reasoning split
    from its answer under a reasoning parser (`show_reasoning`: the request's include_reasoning)."""

    def __init__(self, role: str, tools: ToolCallStream | None, echo: str, prompt_token_ids: list[int],
                 reasoning: ReasoningStream | None = None, show_reasoning: bool = True) -> None:
        super().__init__(echo, prompt_token_ids)
        self.role, self.tools = role, tools
        self.reasoning, self.show_reasoning = reasoning, show_reasoning


class OpenAIServingChat(GenerationServing):
    """The chat completions API, with vLLM's sampling extras.

    Args:
        tool_call_parser: the parser of tool_choice "auto" (a name of TOOL_PARSERS); None: "auto" is refused.
        reasoning_parser: a name of REASONING_PARSERS: each reply's thinking goes to the message's `reasoning`,
            the rest to its `content` (and to the tool parser); None: the whole reply is content.
    """

    prompt_token_ids_on_choices = False     # one conversation: its prompt's ids go on the response, as vLLM's

    def __init__(self, engine: AsyncEngine, served_model_names: Sequence[str], limits: ServerLimits,
                 tool_call_parser: str | None = None, reasoning_parser: str | None = None,
                 lora_modules: LoRAModules | None = None, options: FrontendOptions | None = None) -> None:
        super().__init__(engine, served_model_names, limits, lora_modules, options)
        if reasoning_parser is not None and reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"unknown reasoning parser {reasoning_parser!r}; pagedllm has {REASONING_PARSERS}")
        self.tool_call_parser, self.reasoning_parser = tool_call_parser, reasoning_parser

    async def create(self, request: ChatCompletionRequest,
                     sse: bool = True) -> dict[str, Any] | AsyncIterator[str] | AsyncIterator[dict[str, Any]]:
        """A response dict, or (stream=True) an iterator of SSE lines (or, `sse` false, of the chunks as dicts).
        Raises OpenAIError on bad input."""
        model = self.check_model(request.model)
        self.check_common(request)
        tool_choice = self._tool_choice(request)
        if request.echo and tool_choice != "none":
            raise OpenAIError("echo cannot be combined with tool calls (tool_choice other than none)", param="echo")
        if request.top_logprobs is not None and not request.logprobs:
            raise OpenAIError("top_logprobs requires logprobs to be true", param="top_logprobs")
        self.check_logprobs(request.top_logprobs, "top_logprobs")
        self.check_prompt_logprobs(request)
        num_logprobs = (request.top_logprobs or 0) if request.logprobs else None
        truncation = self.truncation(request)
        prompt = await self.render_prompt(request, truncation)
        max_tokens, param = request.max_tokens, "max_tokens"
        if request.max_completion_tokens is not None:
            max_tokens, param = request.max_completion_tokens, "max_completion_tokens"
        max_tokens = self.resolve_max_tokens(max_tokens, len(prompt.token_ids), param)
        request_id = self.request_id_for("chatcmpl", request.request_id)
        self.check_num_choices(1, request.n)
        role = self.options.response_role if request.add_generation_prompt else request.messages[-1].get("role")
        if request.use_beam_search:
            return await self.beam_search(request, request_id, [prompt], [max_tokens], {
                "id": request_id, "object": "chat.completion", "created": now(), "model": model},
                self.lora_for(model), role)
        params = self._force_tool_call(request, tool_choice, self.sampling_params(
            request, max_tokens, num_logprobs, request.prompt_logprobs))
        if self.reasoning_parser is not None and REASONING_FORMATS[self.reasoning_parser].keeps_special_tokens:
            params = dataclasses.replace(params, skip_special_tokens=False)    # its markers are special tokens
        prompt_logprobs: dict[int, PromptLogprobs] = {}
        outputs = await self.first_then_rest(keep_prompt_logprobs(self.run_prompts(
            request_id, [prompt], [params], request.priority, request.cache_salt, self.lora_for(model)),
            prompt_logprobs))
        head = {"id": request_id, "created": now(), "model": model,
                "object": "chat.completion.chunk" if request.stream else "chat.completion"}
        states = [ChatChoiceState(role, self._tool_stream(tool_choice, request), _echo(request), prompt.token_ids,
                                  ReasoningStream(self.reasoning_parser) if self.reasoning_parser else None,
                                  request.include_reasoning)
                  for _ in range(request.n)]
        response = await self.respond(request, outputs, states, head,
                                      ResponseOptions.of(request, len(prompt.token_ids), num_logprobs, self.options),
                                      sse)
        if request.prompt_logprobs is not None:     # never streamed (refused above): a whole response
            cast(dict[str, Any], response)["prompt_logprobs"] = prompt_logprobs_json(prompt_logprobs.get(0))
        return response

    async def render(self, request: ChatCompletionRequest) -> list[int]:
        """The conversation's prompt token ids, templated off the event loop; 400 naming `messages` on a bad
        message or template."""
        self.tokenizer_for("messages")
        messages, kwargs = self._with_tools(request)
        try:
            return await self.engine.run_on_tokenizer_thread(
                apply_chat_template, self.engine.tokenizer, messages, request.chat_template,
                request.add_generation_prompt, request.continue_final_message,
                self.options.chat_template_content_format, **kwargs)
        except (ValueError, TypeError, jinja2.TemplateError) as exc:
            raise OpenAIError(str(exc), param="messages") from exc

    async def render_prompt(self, request: ChatCompletionRequest, truncation: slice | None) -> Prompt:
        """The conversation's prompt, checked as the engine will: its token ids, and its images where its messages
        hold some (made by the model's processor, off the event loop); 400 naming `messages` on a bad message,
        image or template, more images than the engine's limit, or a model that takes no images; on
        mm_processor_kwargs unless the server trusts a request's."""
        if request.mm_processor_kwargs and not self.options.trust_request_mm_kwargs:
            raise OpenAIError("the request passes mm_processor_kwargs, and the server processes images with its own "
                              "only (start it with --trust-request-mm-kwargs to take a request's)",
                              param="mm_processor_kwargs")
        parts = image_parts(request.messages)
        if not parts:     # a text chat: no thread hop to look for images
            return Prompt(None, await self.prompt_token_ids(await self.render(request), "messages", truncation))
        self.tokenizer_for("messages")      # (render checks it for a text chat)
        processor = self.engine.image_processor
        try:
            check_image_count(len(parts), self.engine.image_limit)
            if processor is None:   # refused, naming the first image, before any image is read
                validate_messages(request.messages)
            images = await self.engine.run_on_tokenizer_thread(conversation_images, request.messages,
                                                                self.engine.media_access)
        except ValueError as exc:
            raise OpenAIError(str(exc), param="messages") from exc
        if truncation is not None:
            raise OpenAIError("truncate_prompt_tokens cuts text prompts: a conversation with images cannot be cut",
                              param="truncate_prompt_tokens")
        messages, kwargs = self._with_tools(request)
        try:
            text = await self.engine.run_on_tokenizer_thread(
                render_chat_template, self.engine.tokenizer, messages, request.chat_template,
                request.add_generation_prompt, request.continue_final_message,
                None if processor is None else processor.image_token, self.options.chat_template_content_format,
                **kwargs)
            assert processor is not None, "render_chat_template refuses images without a marker"
            token_ids, inputs = await self.engine.run_on_tokenizer_thread(processor, text, images, False,
                                                                          request.mm_processor_kwargs)
        except (ValueError, TypeError, jinja2.TemplateError) as exc:
            raise OpenAIError(str(exc), param="messages") from exc
        return Prompt(text, await self.prompt_token_ids(token_ids, "messages"), images=inputs)

    def _with_tools(self, request: ChatCompletionRequest) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """The request's messages and template variables (its own over the server's defaults), its tools put where
        the template takes them; 400 for a template of the request's own unless the server trusts them."""
        own = request.chat_template_kwargs or {}
        if not self.options.trust_request_chat_template and (request.chat_template is not None
                                                             or own.get("chat_template") is not None):
            raise OpenAIError("the request passes a chat template, and the server renders chats with its own only "
                              "(start it with --trust-request-chat-template to take a request's)",
                              param="chat_template")
        effort = {} if request.reasoning_effort is None else {"reasoning_effort": request.reasoning_effort}
        messages, kwargs = request.messages, {**(self.options.default_chat_template_kwargs or {}), **effort, **own}
        if request.tools and not (self.options.exclude_tools_when_tool_choice_none and request.tool_choice == "none"):
            template = request.chat_template or getattr(self.engine.tokenizer, "chat_template", None) or ""
            messages, tool_kwargs = with_tools(messages, [t.model_dump(exclude_none=True) for t in request.tools],
                                               template)
            kwargs |= tool_kwargs
        return messages, kwargs

    # ---- tools --------------------------------------------------------------------------------------------------
    def _tool_choice(self, request: ChatCompletionRequest) -> str | NamedToolChoice:
        """The request's tool_choice ("auto" when tools are given without one), checked; 400 if it cannot run."""
        choice = request.tool_choice or ("auto" if request.tools else "none")
        if choice != "none" and not request.tools:
            raise OpenAIError("tool_choice needs tools", param="tool_choice")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in {t.function.name
                                                                                for t in request.tools or []}:
            raise OpenAIError(f"tool_choice names the function {choice.function.name!r}, which is not in tools",
                              param="tool_choice")
        if choice == "auto" and self.tool_call_parser is None:
            raise OpenAIError('"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be '
                              'set (or use tool_choice "required", "none" or a named function)', param="tool_choice")
        if choice in ("none", "auto"):
            return choice
        if request.response_format is not None or request.structured_outputs is not None:
            raise OpenAIError("a forced tool call (tool_choice required or a named function) cannot be combined "
                              "with response_format or structured_outputs", param="tool_choice")
        return choice

    def _force_tool_call(self, request: ChatCompletionRequest, tool_choice: str | NamedToolChoice,
                         params: SamplingParams) -> SamplingParams:
        """"required" and a named function: constrain the reply to the calls' JSON schema. "auto" with a parser
        whose marker is a special token: keep special tokens in the reply's text (vLLM's mistral parser does)."""
        tools = [tool.model_dump(exclude_none=True) for tool in request.tools or []]
        if tool_choice == "auto":
            keeps = TOOL_PARSERS[cast(str, self.tool_call_parser)].keeps_special_tokens
            return dataclasses.replace(params, skip_special_tokens=False) if keeps else params
        if tool_choice == "required":
            schema = required_tools_schema(tools, request.parallel_tool_calls)
        elif isinstance(tool_choice, NamedToolChoice):
            schema = named_tool_schema(next(t for t in tools if t["function"]["name"] == tool_choice.function.name))
        else:
            return params
        return dataclasses.replace(params, structured_outputs=StructuredOutputsParams(json=schema))

    def _tool_stream(self, tool_choice: str | NamedToolChoice, request: ChatCompletionRequest) -> ToolCallStream | None:
        if tool_choice == "none":
            return None
        if tool_choice == "auto":
            tools = [tool.model_dump(exclude_none=True) for tool in request.tools or []]
            return ToolCallStream(parser=TOOL_PARSERS[cast(str, self.tool_call_parser)](tools),
                                  parallel=request.parallel_tool_calls)
        if tool_choice == "required":
            return ToolCallStream(required=True)
        return ToolCallStream(forced_name=tool_choice.function.name)

    # ---- response shape -----------------------------------------------------------------------------------------
    def _opening(self, state: ChoiceState) -> dict[str, Any]:
        assert isinstance(state, ChatChoiceState)
        return {"delta": {"role": state.role, "content": ""}}

    def _message(self, state: ChoiceState) -> dict[str, Any]:
        assert isinstance(state, ChatChoiceState)
        message: dict[str, Any] = {"role": state.role}
        text: str | None = state.text
        if state.reasoning is not None:
            reasoning, text = state.reasoning.final(state.text)
            message |= {"reasoning": reasoning} if state.show_reasoning else {}
        if state.tools is None:
            return {"message": message | {"content": text}}
        content, calls = state.tools.final(text or "")
        if not calls:
            return {"message": message | {"content": content if text is not None else None}}
        _finish_with_tool_calls(state)
        return {"message": message | {"content": content, "tool_calls": [c.to_json() for c in calls]}}

    def _delta(self, state: ChoiceState, text: str) -> dict[str, Any]:
        assert isinstance(state, ChatChoiceState)
        finished = state.finish_reason is not None
        delta: dict[str, Any] = {}
        if state.reasoning is not None:
            reasoning, text = state.reasoning.delta(text, finished)
            delta = {"reasoning": reasoning} if reasoning and state.show_reasoning else {}
        if state.tools is None:
            return {"delta": delta | ({"content": text} if text or not (finished or delta) else {})}
        delta |= state.tools.delta(text, finished)
        if finished and (delta.get("tool_calls") or state.tools.forced_call is not None):
            _finish_with_tool_calls(state)
        return {"delta": delta}

    def _logprobs_json(self, tokens: list[TokenLogprob]) -> dict[str, Any]:
        return {"content": [{**_token_json(t.token, t.logprob),
                             "top_logprobs": [_token_json(text, logprob) for text, logprob in t.top]}
                            for t in tokens]}


def _echo(request: ChatCompletionRequest) -> str:
    """What an `echo` reply starts with: the last message's text when it is the assistant's, as vLLM does (with
    continue_final_message, the start of the reply given, then its continuation)."""
    last = request.messages[-1]
    if not request.echo or last.get("role") != "assistant":
        return ""
    return validate_messages([last])[0]["content"]


def _finish_with_tool_calls(state: ChoiceState) -> None:
    """A reply that ended on its own and made calls finishes with "tool_calls" (one cut at max_tokens keeps
    "length")."""
    if state.finish_reason == "stop":
        state.finish_reason = "tool_calls"


def _token_json(text: str, logprob: float | None) -> dict[str, Any]:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}
