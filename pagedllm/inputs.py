"""The prompt forms vLLM takes: a string, a list of token ids, `{"prompt": str}` (TextPrompt),
`{"prompt_token_ids": [...]}` (TokensPrompt) or `{"prompt_embeds": tensor}` (EmbedsPrompt), each dict with an optional
`cache_salt`, a TokensPrompt with
optional `token_type_ids` (a cross-encoder's pair of texts), and a TextPrompt with images in `multi_modal_data`
(`pagedllm.multimodal`). Pure Python: the core and the server may import it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NotRequired, TypedDict

from pagedllm.multimodal import ImageInput, is_image


class TextPrompt(TypedDict):
    """A prompt as text, tokenized by the engine."""

    prompt: str
    cache_salt: NotRequired[str]
    multi_modal_data: NotRequired[dict[str, Any]]    # {"image": a PIL image or a list of them}
    mm_processor_kwargs: NotRequired[dict[str, Any]]     # arguments for the model's processor on these images


class TokensPrompt(TypedDict):
    """A prompt as token ids; `prompt`, if given, is its text (reported back in RequestOutput.prompt).
    `token_type_ids`: one per token, for a model that adds token type embeddings (BERT's: 0 for a pair's first
    text, 1 for its second), as vLLM takes them for cross-encoders."""

    prompt_token_ids: list[int]
    prompt: NotRequired[str]
    cache_salt: NotRequired[str]
    token_type_ids: NotRequired[list[int]]


class EmbedsPrompt(TypedDict):
    """A prompt as embeddings (vLLM's): [num_tokens, hidden_size] rows standing for its tokens' embeddings (what the
    model's embedding layer would give), taken where the engine has enable_prompt_embeds."""

    prompt_embeds: Any      # a torch tensor
    cache_salt: NotRequired[str]


PromptType = str | list[int] | TextPrompt | TokensPrompt | EmbedsPrompt

_KEYS = {"prompt", "prompt_token_ids", "cache_salt", "token_type_ids", "multi_modal_data", "mm_processor_kwargs",
         "prompt_embeds"}


@dataclass(frozen=True, slots=True)
class ParsedPrompt:
    """One prompt, whatever its form: its text and/or token ids (at least one is set), its cache salt, its token
    type ids (only beside token ids, one each), and its images: as given (`images`, beside text, with arguments for
    the processor), or, once the model's processor has made token ids of text and images
    (`LLMEngine.process_images`), as `image_inputs`."""

    text: str | None
    token_ids: list[int] | None
    cache_salt: str | None = None
    token_type_ids: list[int] | None = None
    images: tuple[Any, ...] = ()
    processor_kwargs: dict[str, Any] | None = None
    image_inputs: tuple[ImageInput, ...] = ()
    prompt_embeds: Any = None       # an EmbedsPrompt's tensor, as given (the engine checks it)


def parse_prompt(prompt: PromptType | ParsedPrompt, index: int = 0) -> ParsedPrompt:
    """Check one prompt's form and types; a ValueError names the prompt's `index` and the key at fault."""
    if isinstance(prompt, ParsedPrompt):
        return prompt
    if isinstance(prompt, str):
        return ParsedPrompt(prompt, None)
    if isinstance(prompt, dict):
        return _parse_dict(prompt, index)
    if isinstance(prompt, list | tuple):
        return ParsedPrompt(None, _token_ids(prompt, index, "the prompt"))
    raise ValueError(f"prompt {index}: a prompt is a string, a list of token ids, {{'prompt': str}} or "
                    f"{{'prompt_token_ids': [...]}}, got {type(prompt).__name__}")


def _parse_dict(prompt: dict, index: int) -> ParsedPrompt:
    for key in prompt:
        if key not in _KEYS:
            raise ValueError(f"prompt {index}: unknown key {key!r}; a prompt dict takes 'prompt', "
                             "'prompt_token_ids' or 'prompt_embeds', and 'cache_salt', 'token_type_ids' and "
                             "'multi_modal_data'")
    if "prompt_embeds" in prompt:
        if set(prompt) - {"prompt_embeds", "cache_salt"}:
            raise ValueError(f"prompt {index}: 'prompt_embeds' goes alone (with a 'cache_salt' at most)")
        salt = prompt.get("cache_salt")
        if salt is not None and not isinstance(salt, str):
            raise ValueError(f"prompt {index}: key 'cache_salt' must be a string, got {type(salt).__name__}")
        return ParsedPrompt(None, None, salt, prompt_embeds=prompt["prompt_embeds"])
    if "prompt" not in prompt and "prompt_token_ids" not in prompt:
        raise ValueError(f"prompt {index}: a prompt dict needs 'prompt' (text), 'prompt_token_ids' or "
                         "'prompt_embeds'")
    text = prompt.get("prompt")
    if text is not None and not isinstance(text, str):
        raise ValueError(f"prompt {index}: key 'prompt' must be a string, got {type(text).__name__}")
    salt = prompt.get("cache_salt")
    if salt is not None and not isinstance(salt, str):
        raise ValueError(f"prompt {index}: key 'cache_salt' must be a string, got {type(salt).__name__}")
    token_ids = prompt.get("prompt_token_ids")
    if token_ids is not None or "prompt_token_ids" in prompt:
        token_ids = _token_ids(token_ids, index, "key 'prompt_token_ids'")
    token_types = prompt.get("token_type_ids")
    if token_types is not None or "token_type_ids" in prompt:
        token_types = _token_ids(token_types, index, "key 'token_type_ids'")
        if token_ids is None or len(token_types) != len(token_ids):
            raise ValueError(f"prompt {index}: key 'token_type_ids' needs 'prompt_token_ids', one type per token")
    images = _images(prompt["multi_modal_data"], index) if "multi_modal_data" in prompt else ()
    if images and (text is None or token_ids is not None):
        raise ValueError(f"prompt {index}: images go with a text prompt ('prompt', with an <image> marker for each), "
                         "not with 'prompt_token_ids'")
    processor_kwargs = prompt.get("mm_processor_kwargs")
    if processor_kwargs is not None and (not isinstance(processor_kwargs, dict) or not images):
        raise ValueError(f"prompt {index}: 'mm_processor_kwargs' is a dict of the processor's arguments, beside "
                         "'multi_modal_data'")
    return ParsedPrompt(text, token_ids, salt, token_types, images, processor_kwargs)


def _images(data: object, index: int) -> tuple[Any, ...]:
    if not isinstance(data, dict) or set(data) - {"image"}:
        keys = sorted(data) if isinstance(data, dict) else type(data).__name__
        raise ValueError(f"prompt {index}: 'multi_modal_data' takes {{'image': ...}} (images only), got {keys}")
    images = data["image"] if isinstance(data["image"], list | tuple) else [data["image"]]
    if not images or not all(map(is_image, images)):
        raise ValueError(f"prompt {index}: 'multi_modal_data' image must be a PIL image or a non-empty list of them")
    return tuple(images)


def _token_ids(value: object, index: int, what: str) -> list[int]:
    # type() is int, not isinstance: a bool is no token id. One C-level pass (a prompt may hold millions of ids).
    if not isinstance(value, list | tuple) or not set(map(type, value)) <= {int}:
        raise ValueError(f"prompt {index}: {what} must be a list of integer token ids")
    return list(value)


def as_prompt_list(prompts: PromptType | Sequence[PromptType]) -> list[ParsedPrompt]:
    """One prompt or a list of them (in any of the forms) -> the parsed prompts, in order."""
    if isinstance(prompts, str | dict):
        prompts = [prompts]
    elif not isinstance(prompts, list | tuple):
        raise ValueError(f"prompts must be a prompt or a list of prompts, got {type(prompts).__name__}")
    if not prompts:
        raise ValueError("prompts is empty: give at least one prompt")
    if all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
        prompts = [list(prompts)]    # one prompt as token ids
    return [parse_prompt(p, i) for i, p in enumerate(prompts)]


def truncation_slice(keep: int, side: str | None, tokenizer: Any) -> slice:
    """The prompt tokens vLLM's truncate_prompt_tokens keeps (`keep` >= 1): the first `keep` where the side is
    "right", the last where it is "left"; without a side, the tokenizer's own (its `truncation_side`, "right"
    unless the checkpoint sets another; "right" without a tokenizer), as vLLM 0.32 cuts (its renderer's
    `_truncation_slice`)."""
    side = side or getattr(tokenizer, "truncation_side", None) or "right"
    return slice(-keep, None) if side == "left" else slice(0, keep)
