"""apply_chat_template: the SmolLM2 template, message validation, the content formats and clear errors."""

from __future__ import annotations

import pytest

from pagedllm.loader.resolve import default_model_gguf
from pagedllm.tokenizer.chat_template import apply_chat_template, render_chat_template, validate_messages
from pagedllm.tokenizer.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(default_model_gguf())


def test_smollm2_template(tokenizer) -> None:
    messages = [{"role": "user", "content": "Hi!"}]
    text = render_chat_template(tokenizer, messages)
    assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                    "<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n")
    ids = apply_chat_template(tokenizer, messages)
    assert ids == tokenizer.encode(text, add_special_tokens=False)
    assert ids.count(tokenizer.convert_tokens_to_ids("<|im_start|>")) == 3
    no_prompt = render_chat_template(tokenizer, messages, add_generation_prompt=False)
    assert not no_prompt.endswith("assistant\n")


def test_continue_final_message_leaves_the_last_message_open(tokenizer) -> None:
    messages = [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello, I am"}]
    text = render_chat_template(tokenizer, messages, add_generation_prompt=False, continue_final_message=True)
    closed = render_chat_template(tokenizer, messages, add_generation_prompt=False)
    assert text.endswith("<|im_start|>assistant\nHello, I am") and closed.startswith(text) and closed != text
    with pytest.raises(ValueError, match="cannot both be true"):
        render_chat_template(tokenizer, messages, continue_final_message=True)


def test_text_parts_are_joined(tokenizer) -> None:
    parts = [{"role": "system", "content": "Be brief."},
             {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert "<|im_start|>user\na\nb<|im_end|>" in render_chat_template(tokenizer, parts)


def test_custom_template(tokenizer) -> None:
    template = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
    messages = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
    assert render_chat_template(tokenizer, messages, chat_template=template) == "[user]x[assistant]y"


def test_the_content_format_gives_a_template_the_text_or_typed_parts(tokenizer) -> None:
    template = ("{% for m in messages %}{% if m['content'] is string %}S[{{ m['content'] }}]{% else %}"
                "{% for part in m['content'] %}{{ part['type'] }}[{{ part.get('text', '') }}]{% endfor %}"
                "{% endif %}{% endfor %}")
    messages = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert render_chat_template(tokenizer, messages, chat_template=template) == "S[a\nb]"     # auto: no typed images
    assert render_chat_template(tokenizer, messages, chat_template=template, content_format="string") == "S[a\nb]"
    assert render_chat_template(tokenizer, messages, chat_template=template, content_format="openai") == \
        "text[a\nb]"
    # with an image marker, "openai" gives the image its own part where it stood
    pictured = [{"role": "user", "content": "look <image> here"}]
    assert render_chat_template(tokenizer, pictured, chat_template=template, image_marker="<image>",
                                content_format="openai") == "text[look ]image[]text[ here]"
    with pytest.raises(ValueError, match="chat_template_content_format must be one of auto, string, openai"):
        render_chat_template(tokenizer, messages, content_format="markdown")


def test_missing_template_is_a_clear_error(tokenizer, monkeypatch) -> None:
    monkeypatch.setattr(tokenizer, "chat_template", None)
    with pytest.raises(ValueError, match="no chat template"):
        apply_chat_template(tokenizer, [{"role": "user", "content": "x"}])


@pytest.mark.parametrize("messages, match", [
    ([], "empty"),
    ("hello", "list"),
    (["hello"], "must be a dict"),
    ([{"role": "robot", "content": "x"}], "role 'robot'"),
    ([{"content": "x"}], "role None"),
    ([{"role": "user"}], "no 'content'"),
    ([{"role": "user", "content": 3}], "string or a list"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "takes no images"),
    ([{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}], "text part"),
])
def test_invalid_messages(messages, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        validate_messages(messages)


def test_valid_messages_are_copied_not_changed() -> None:
    messages = [{"role": "developer", "content": "d"}, {"role": "tool", "content": "t", "tool_call_id": "1"},
                {"role": "assistant", "content": None, "tool_calls": [{"id": "1"}]}]
    out = validate_messages(messages)
    assert out[1] == {"role": "tool", "content": "t", "tool_call_id": "1"}
    assert out[2]["content"] == "" and messages[2]["content"] is None


def test_file_urls_are_read_under_the_allowed_folder_only_and_hosts_as_allowed(tmp_path) -> None:
    """vLLM's --allowed-local-media-path and --allowed-media-domains, redirects included."""
    import functools
    import http.server
    import threading

    from PIL import Image

    from pagedllm.config import MediaAccess
    from pagedllm.tokenizer.chat_template import conversation_images

    folder = tmp_path / "images"
    folder.mkdir()
    Image.new("RGB", (3, 2), (255, 0, 0)).save(folder / "red.png")
    Image.new("RGB", (3, 2), (0, 0, 255)).save(tmp_path / "secret.png")

    def image_of(url: str, access: MediaAccess):
        (image,) = conversation_images([{"role": "user", "content": [{"type": "image_url",
                                                                      "image_url": {"url": url}}]}], access)
        return image

    allowed = MediaAccess(local_path=str(folder))
    assert image_of((folder / "red.png").as_uri(), allowed).getpixel((0, 0)) == (255, 0, 0)
    for outside in (tmp_path / "secret.png", folder / ".." / "secret.png"):
        with pytest.raises(ValueError, match="not under the folder the server reads images from"):
            image_of(outside.as_uri(), allowed)
    with pytest.raises(ValueError, match="reads no local files"):
        image_of((folder / "red.png").as_uri(), MediaAccess())

    class Redirect(http.server.SimpleHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path == "/away.png":     # to the same server under another host name
                self.send_response(302)
                self.send_header("Location", f"http://localhost:{self.server.server_address[1]}/red.png")
                self.end_headers()
            else:
                super().do_GET()

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Redirect, directory=str(folder)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        assert image_of(f"{base}/red.png", MediaAccess(domains=("127.0.0.1",))).getpixel((0, 0)) == (255, 0, 0)
        assert image_of(f"{base}/away.png", MediaAccess()).getpixel((0, 0)) == (255, 0, 0)
        with pytest.raises(ValueError, match="is on localhost, and the server reads images from 127.0.0.1 only"):
            image_of(f"{base}/away.png", MediaAccess(domains=("127.0.0.1",)))
    finally:
        server.shutdown()
