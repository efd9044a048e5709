"""Chat messages -> prompt, through the model's (or a given) Jinja chat template, with clear errors.

A message's content may hold images too, as OpenAI's and vLLM's do: `{"type": "image_url", "image_url": {"url":
...}}`, a data: URL (`data:image/png;base64,...`) or an http(s) one, fetched (within
$PAGEDLLM_IMAGE_FETCH_TIMEOUT seconds, 5 by default, as vLLM's VLLM_IMAGE_FETCH_TIMEOUT; at most 64 MiB), from the
hosts `MediaAccess.domains` allows (any by default), or a file:// one, under `MediaAccess.local_path` (none by
default: vLLM's --allowed-media-domains and --allowed-local-media-path); vLLM's offline `{"type": "image_pil",
"image_pil": image}` too.
`conversation_images` gives them in order, and the template renders each where it stands as the model's image
marker (`<image>`): a template that reads typed parts (`{"type": "image"}`, as Llava's and SmolVLM's do, which
render nothing of a plain string) gets every message's content as such parts, images or not, any other template the
text with the marker in it. The processor then expands each marker (pagedllm.multimodal). That choice is the content
format "auto"; as vLLM's `chat_template_content_format`, "openai" gives every template the typed parts and "string"
the text.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerBase

from pagedllm.config import CHAT_CONTENT_FORMATS, MediaAccess

DEFAULT_ACCESS = MediaAccess()     # data: and http(s) URLs of any host; no file:// URL
ROLES = frozenset({"system", "user", "assistant", "tool", "developer"})


def render_chat_template(tokenizer: PreTrainedTokenizerBase, messages: Sequence[Mapping[str, Any]],
                         chat_template: str | None = None, add_generation_prompt: bool = True,
                         continue_final_message: bool = False, image_marker: str | None = None,
                         content_format: str = "auto", **template_kwargs: Any) -> str:
    """The conversation as prompt text.

    Args:
        tokenizer: supplies the default template and the special tokens the template may use.
        messages: OpenAI-style messages: {"role": ..., "content": str | [{"type": "text", "text": ...}]}.
        chat_template: a Jinja template replacing the tokenizer's own.
        add_generation_prompt: end with the header of an assistant turn.
        continue_final_message: end with the last message left open (no end-of-turn after it), for the model to
            continue: a reply whose start is given ("prefill"). Not with add_generation_prompt.
        image_marker: the model's image marker, where it takes images (`conversation_images`); None: image parts
            are refused.
        content_format: how each message's content reaches the template: "string" (its text, image markers in
            it), "openai" (a list of typed parts, `{"type": "text", "text": ...}` and `{"type": "image"}`) or "auto"
            (typed parts for a template that renders typed images, the text for any other).
        template_kwargs: extra variables for the template (e.g. tools).
    """
    if content_format not in CHAT_CONTENT_FORMATS:
        raise ValueError(f"chat_template_content_format must be one of {', '.join(CHAT_CONTENT_FORMATS)}, got "
                         f"{content_format!r}")
    conversation = validate_messages(messages, image_marker)
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message and add_generation_prompt cannot both be true: set "
                         "add_generation_prompt to false to continue the last message")
    template = chat_template if chat_template is not None else getattr(tokenizer, "chat_template", None)
    if not template:
        raise ValueError("this model's tokenizer has no chat template; pass chat_template= "
                         "(or --chat-template) to use chat messages, or send a plain prompt")
    if content_format == "openai" or (content_format == "auto" and _reads_typed_parts(template)):
        conversation = [{**m, "content": _typed_parts(m["content"], image_marker)} for m in conversation]
    return tokenizer.apply_chat_template(conversation, chat_template=template, tokenize=False,
                                         add_generation_prompt=add_generation_prompt,
                                         continue_final_message=continue_final_message, **template_kwargs)


def apply_chat_template(tokenizer: PreTrainedTokenizerBase, messages: Sequence[Mapping[str, Any]],
                        chat_template: str | None = None, add_generation_prompt: bool = True,
                        continue_final_message: bool = False, content_format: str = "auto",
                        **template_kwargs: Any) -> list[int]:
    """The conversation as prompt token ids. See render_chat_template for the arguments.

    The template writes any BOS token itself, so the text is encoded without adding special tokens again.
    """
    text = render_chat_template(tokenizer, messages, chat_template, add_generation_prompt, continue_final_message,
                                content_format=content_format, **template_kwargs)
    return tokenizer.encode(text, add_special_tokens=False)


def validate_messages(messages: Sequence[Mapping[str, Any]], image_marker: str | None = None
                      ) -> list[dict[str, Any]]:
    """Check each message and return copies whose content is a plain string (text parts joined by newlines, an
    image part as `image_marker`).

    Raises ValueError on an empty conversation, a message that is not a dict, an unknown role, missing content,
    or content that is neither a string nor a list of text parts (and, with an `image_marker`, image parts).
    """
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ValueError(f"messages must be a list of {{'role', 'content'}} dicts, got {type(messages).__name__}")
    if not messages:
        raise ValueError("messages must not be empty")
    return [_validate_message(i, message, image_marker) for i, message in enumerate(messages)]


def conversation_images(messages: Sequence[Mapping[str, Any]], access: MediaAccess = DEFAULT_ACCESS) -> list[Any]:
    """The images of the conversation's image parts (`image_parts`), in order, as PIL images; ValueError naming a
    part whose image cannot be read (another URL than a data:, http(s) or file:// one, a host or file `access`
    does not allow, bad base64, not an image, a fetch that failed). Decoding and fetching take time: the server
    calls it off its loop, and only when `image_parts` found some."""
    return [_image(where, part, access) for where, part in image_parts(messages)]


def image_parts(messages: Sequence[Mapping[str, Any]]) -> list[tuple[str, Mapping[str, Any]]]:
    """The conversation's image parts, in order, each with where it is (`messages[i].content[j]`); none read."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        return []   # validate_messages says what is wrong with it
    parts = []
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, Mapping) else None
        for j, part in enumerate(content if isinstance(content, list) else []):
            if isinstance(part, Mapping) and part.get("type") in IMAGE_PARTS:
                parts.append((f"messages[{i}].content[{j}]", part))
    return parts


IMAGE_PARTS = frozenset({"image_url", "image_pil"})


def _image(where: str, part: Mapping[str, Any], access: MediaAccess) -> Any:
    from PIL import Image, UnidentifiedImageError

    if part["type"] == "image_pil":
        if not isinstance(part.get("image_pil"), Image.Image):
            raise ValueError(f"{where}.image_pil must be a PIL image")
        return part["image_pil"]
    url = part.get("image_url")
    url = url.get("url") if isinstance(url, Mapping) else url
    if isinstance(url, str) and url.startswith(("http://", "https://")):
        raw = _fetch(where, url, access.domains)
    elif isinstance(url, str) and url.startswith("data:") and "," in url:
        header, data = url.split(",", 1)
        try:
            raw = base64.b64decode(data, validate=True) if header.endswith(";base64") else data.encode()
        except binascii.Error as exc:
            raise ValueError(f"{where}.image_url is not a readable image: {exc}") from exc
    elif isinstance(url, str) and url.startswith("file://"):
        raw = _read_file(where, url, access.local_path)
    else:
        raise ValueError(f"{where}.image_url must be a data: URL (data:image/png;base64,...), an http(s) URL or a "
                         "file:// URL")
    try:
        image = Image.open(io.BytesIO(raw))
        image.load()
    except (UnidentifiedImageError, OSError) as exc:
        raise ValueError(f"{where}.image_url is not a readable image: {exc}") from exc
    return image


FETCH_TIMEOUT_ENV = "PAGEDLLM_IMAGE_FETCH_TIMEOUT"
_MAX_IMAGE_BYTES = 64 << 20


def _fetch(where: str, url: str, domains: tuple[str, ...] | None) -> bytes:
    """An http(s) image's bytes; ValueError naming the part when its host (or the host it redirects to) is not one
    of `domains` (None: any), or it cannot be had in time, or is too large."""
    import http.client
    import urllib.request

    _check_host(where, url, domains)
    timeout = float(os.environ.get(FETCH_TIMEOUT_ENV, "5"))
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            landed = response.geturl()      # where redirects led
            raw = response.read(_MAX_IMAGE_BYTES + 1) if _host_allowed(landed, domains) else b""
    except (OSError, ValueError, http.client.HTTPException) as exc:     # URLError and timeouts are OSErrors
        raise ValueError(f"{where}.image_url could not be fetched from {url}: {exc}") from exc
    _check_host(where, landed, domains)
    if len(raw) > _MAX_IMAGE_BYTES:
        raise ValueError(f"{where}.image_url at {url} is over {_MAX_IMAGE_BYTES >> 20} MiB")
    return raw


def _reads_typed_parts(template: str) -> bool:
    """Whether a template renders images from typed content parts (`{"type": "image"}`), as Llava's do."""
    return "'image'" in template or '"image"' in template


def _typed_parts(content: str, image_marker: str | None) -> list[dict[str, str]]:
    """Validated content (image markers in its text) as typed parts: text, and an image for each marker, in
    order."""
    parts: list[dict[str, str]] = []
    for index, text in enumerate(content.split(image_marker) if image_marker else [content]):
        if index:
            parts.append({"type": "image"})
        if text.strip("\n"):
            parts.append({"type": "text", "text": text.strip("\n")})
    return parts


def _host_allowed(url: str, domains: tuple[str, ...] | None) -> bool:
    from urllib.parse import urlsplit

    return domains is None or urlsplit(url).hostname in domains


def _check_host(where: str, url: str, domains: tuple[str, ...] | None) -> None:
    if not _host_allowed(url, domains):
        from urllib.parse import urlsplit

        raise ValueError(f"{where}.image_url is on {urlsplit(url).hostname}, and the server reads images from "
                         f"{', '.join(domains or ())} only (--allowed-media-domains)")


def _read_file(where: str, url: str, local_path: str) -> bytes:
    """A file:// image's bytes: a file under `local_path`, which must be given; ValueError naming the part
    otherwise, or when the file cannot be read or is too large."""
    from urllib.parse import urlsplit
    from urllib.request import url2pathname

    if not local_path:
        raise ValueError(f"{where}.image_url is a file:// URL, and the server reads no local files (start it with "
                         "--allowed-local-media-path FOLDER to allow those under FOLDER)")
    parts = urlsplit(url)
    path, folder = Path(url2pathname(parts.netloc + parts.path)).resolve(), Path(local_path).resolve()
    if folder not in path.parents:
        raise ValueError(f"{where}.image_url names {path}, which is not under the folder the server reads images "
                         f"from ({folder}, --allowed-local-media-path)")
    try:
        with path.open("rb") as file:
            raw = file.read(_MAX_IMAGE_BYTES + 1)
    except OSError as exc:
        raise ValueError(f"{where}.image_url could not be read: {exc}") from exc
    if len(raw) > _MAX_IMAGE_BYTES:
        raise ValueError(f"{where}.image_url at {path} is over {_MAX_IMAGE_BYTES >> 20} MiB")
    return raw


def _validate_message(index: int, message: Mapping[str, Any], image_marker: str | None) -> dict[str, Any]:
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
    out["content"] = _content_text(where, content, image_marker)
    return out


def _content_text(where: str, content: Any, image_marker: str | None) -> str:
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
        elif isinstance(part, Mapping) and part.get("type") in IMAGE_PARTS:
            if image_marker is None:
                raise ValueError(f"{where}.content[{j}] is an image, and this model takes no images (pagedllm reads "
                                 "the images of the vision-language checkpoints README.md names)")
            texts.append(image_marker)
        else:
            kind = part.get("type") if isinstance(part, Mapping) else type(part).__name__
            raise ValueError(f"{where}.content[{j}] must be a text part {{'type': 'text', 'text': str}}, "
                             f"got {kind!r}")
    return "\n".join(texts)
