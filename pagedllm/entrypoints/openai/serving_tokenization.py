"""POST /tokenize and /detokenize (vLLM's extras): text or chat messages (with their images' placeholders, for a model
that takes images) -> token ids, and back."""

from __future__ import annotations

from typing import Any

from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest, DetokenizeRequest, OpenAIError, TokenizeRequest
from pagedllm.entrypoints.openai.serving_base import OpenAIServing
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedllm.tokenizer.chat_template import image_parts


class OpenAIServingTokenization(OpenAIServing):
    """Tokenization with the server's own names and limits; chat messages go through the chat serving's template."""

    def __init__(self, chat: OpenAIServingChat) -> None:
        super().__init__(chat.engine, chat.served_model_names, chat.limits, chat.lora_modules, chat.options)
        self.chat = chat

    async def tokenize(self, body: TokenizeRequest) -> dict[str, Any]:
        self.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise OpenAIError("give exactly one of prompt and messages", param="prompt")
        tokenizer = self.tokenizer_for("prompt" if body.prompt is not None else "messages")
        if body.messages is not None:
            request = ChatCompletionRequest(messages=body.messages, add_generation_prompt=body.add_generation_prompt,
                                            continue_final_message=body.continue_final_message)
            # a chat with images: its images' placeholders counted, as the model's processor expands them
            tokens = (await self.chat.render_prompt(request, None)).token_ids if image_parts(body.messages) else \
                await self.chat.render(request)
        else:
            tokens = await self.engine.run_on_tokenizer_thread(tokenizer.encode, body.prompt,
                                                               add_special_tokens=body.add_special_tokens)
        return {"count": len(tokens), "max_model_len": self.engine.max_model_len, "tokens": tokens}

    def tokenizer_info(self) -> dict[str, Any]:
        """vLLM's /tokenizer_info: the tokenizer's settings (its init arguments less its files' paths), its class
        and the chat template the server renders with."""
        tokenizer = self.tokenizer_for("tokenizer")
        info = {key: _jsonable(value) for key, value in getattr(tokenizer, "init_kwargs", {}).items()
                if key not in ("vocab_file", "merges_file", "tokenizer_file", "name_or_path")}
        info["tokenizer_class"] = type(tokenizer).__name__
        template = getattr(tokenizer, "chat_template", None)
        if template:
            info["chat_template"] = template
        return info

    async def detokenize(self, body: DetokenizeRequest) -> dict[str, str]:
        self.check_model(body.model)
        tokenizer = self.tokenizer_for("tokens")
        vocab_size = self.engine.vocab_size
        if any(not 0 <= t < vocab_size for t in body.tokens):
            raise OpenAIError(f"tokens must be in [0, {vocab_size})", param="tokens")
        return {"prompt": await self.engine.run_on_tokenizer_thread(tokenizer.decode, body.tokens)}


def _jsonable(value: Any) -> Any:
    """A tokenizer setting as JSON: an added token by its text, containers item by item, anything else JSON cannot
    hold by its str."""
    if hasattr(value, "content"):
        return value.content
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return value if value is None or isinstance(value, str | int | float | bool) else str(value)
