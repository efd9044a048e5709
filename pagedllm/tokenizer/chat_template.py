"""Chat messages -> prompt, through the model's (or a given) Jinja chat template, with clear errors."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from transformers import PreTrainedTokenizerBase

ROLES = frozenset({"system", "user", "assistant", "tool", "developer"})


def render_chat_template(tokenizer: PreTrainedTokenizerBase, messages: Sequence[Mapping[str, Any]],
                         chat_template: str | None = None, add_generation_prompt: bool = True,
                         continue_final_message: bool = False, **template_kwargs: Any) -> str:
    """The conversation as prompt text.

    Args:
        tokenizer: supplies the default template and the special tokens the template may use.
        messages: OpenAI-style messages: {"role": ..., "content": str | [{"type": "text", "text": ...}]}.
        chat_template: a Jinja template replacing the tokenizer's own.
        add_generation_prompt: end with the header of an assistant turn.
        continue_final_message: end with the last message left open (no end-of-turn after it), for the model to
            continue: a reply whose start is given ("prefill"). Not with add_generation_prompt.
        template_kwargs: extra variables for the template (e.g. tools).
    """
    conversation = validate_messages(messages)
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message and add_generation_prompt cannot both be true: set "
                         "add_generation_prompt to false to continue the last message")
    template = chat_template if chat_template is not None else getattr(tokenizer, "chat_template", None)
    if not template:
        raise ValueError("this model's tokenizer has no chat template; pass chat_template= "
                         "(or --chat-template) to use chat messages, or send a plain prompt")
    return tokenizer.apply_chat_template(conversation, chat_template=template, tokenize=False,
                                         add_generation_prompt=add_generation_prompt,
                                         continue_final_message=continue_final_message, **template_kwargs)


def apply_chat_template(tokenizer: PreTrainedTokenizerBase, messages: Sequence[Mapping[str, Any]],
                        chat_template: str | None = None, add_generation_prompt: bool = True,
                        continue_final_message: bool = False, **template_kwargs: Any) -> list[int]:
    """The conversation as prompt token ids. See render_chat_template for the arguments.

    The template writes any BOS token itself, so the text is encoded without adding special tokens again.
    """
    text = render_chat_template(tokenizer, messages, chat_template, add_generation_prompt, continue_final_message,
                                **template_kwargs)
    return tokenizer.encode(text, add_special_tokens=False)


def validate_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Check each message and return copies whose content is a plain string (text parts joined by newlines).

    Raises ValueError on an empty conversation, a message that is not a dict, an unknown role, missing content,
    or content that is neither a string nor a list of text parts.
    """
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ValueError(f"messages must be a list of {{'role', 'content'}} dicts, got {type(messages).__name__}")
    if not messages:
        raise ValueError("messages must not be empty")
    return [_validate_message(i, message) for i, message in enumerate(messages)]


def _validate_message(index: int, message: Mapping[str, Any]) -> dict[str, Any]:
    where = f"messages[{index}]"
    if not isinstance(message, Mapping):
        raise ValueError(f"{where} must be a dict with 'role' and 'content', got {type(message).__name__}")
    role = message.get("role")
    if role not in ROLES:
        raise ValueError(f"{where} has role {role!r}; expected one of {sorted(ROLES)}")
    out = dict(message)
    content = message.get("content")
    if content is None:
        # OpenAI allows an assistant turn that only calls tools.
        if role == "assistant" and message.get("tool_calls"):
            out["content"] = ""
            return out
        raise ValueError(f"{where} ({role}) has no 'content'")
    out["content"] = _content_text(where, content)
    return out


def _content_text(where: str, content: Any) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"{where}.content must be a string or a list of text parts, got {type(content).__name__}")
    texts = []
    for j, part in enumerate(content):
        if isinstance(part, str):
            texts.append(part)
        elif isinstance(part, Mapping) and part.get("type", "text") == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        else:
            kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
            raise ValueError(f"{where}.content[{j}] must be a text part {{'type': 'text', 'text': str}}, "
                             f"got {kind!r}")
    return "\n".join(texts)
