"""The command-line flags of `serve` and `run-batch`, named as vLLM names them, and the EngineConfig they make.

Importing this module is cheap (no torch), so `pagedllm --help` answers at once.
"""

from __future__ import annotations

import argparse
import json
import os
import re
from pathlib import Path
from typing import Any, cast

from pagedllm.config import (
    CHAT_CONTENT_FORMATS,
    DEFAULT_BLOCK_SIZE,
    LOAD_FORMATS,
    LOGPROBS_MODES,
    TOKENIZER_MODES,
    check_vllm_loading_args,
)
from pagedllm.entrypoints.openai.reasoning_parsers import REASONING_PARSERS
from pagedllm.entrypoints.openai.tool_parsers import TOOL_PARSERS
from pagedllm.pooling_params import CONVERTS, RUNNERS

LOG_LEVELS = ["CRITICAL", "ERROR", "WARNING", "INFO", "DEBUG", "NOTSET"]     # vLLM's --log-level
_SIZE_UNITS = {"": 1, "k": 1000, "m": 1000**2, "g": 1000**3, "ki": 1024, "mi": 1024**2, "gi": 1024**3}


def parse_bytes(text: str) -> int:
    """'67108864', '64MiB', '64M', '4GiB', '1.5G' -> bytes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kKmMgG]i?)?[bB]?\s*", text)
    if match is None:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (e.g. 67108864, 64MiB, 4GiB)")
    number, unit = match.groups()
    return int(float(number) * _SIZE_UNITS[(unit or "").lower()])


def _json_arg(text: str, fits, what: str):
    """`text` parsed as JSON, a usage error unless `fits(value)` (it is `what`)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"{text!r} is not JSON: {exc}") from None
    if not fits(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}")
    return value


def _non_negative(text: str) -> int:
    """An integer >= 0 given on the command line."""
    if not text.strip().isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer >= 0")
    return int(text)


def _non_negative_seconds(text: str) -> float:
    """A finite number of seconds >= 0 given on the command line."""
    value = float(text)
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds >= 0, got {text}")
    return value


def parse_json_object(text: str) -> dict:
    """A JSON object given on the command line, e.g. --speculative-config '{"method": "ngram", ...}'."""
    return _json_arg(text, lambda value: isinstance(value, dict), "a JSON object")


def parse_json_list(text: str) -> list[str]:
    """A JSON list of strings given on the command line, e.g. --allowed-origins '["http://localhost:3000"]'."""
    return _json_arg(text, lambda value: isinstance(value, list) and all(isinstance(v, str) for v in value),
                     "a JSON list of strings")


def parse_mm_limits(text: str) -> dict:
    """--limit-mm-per-prompt: a JSON object, '{"image": 2}', or vLLM's older form, image=2,video=1 (ModelConfig
    checks the counts)."""
    if text.lstrip().startswith("{"):
        return parse_json_object(text)
    pairs = [item.partition("=") for item in text.split(",")]
    if not all(sep and key.strip() and count.strip().isdigit() for key, sep, count in pairs):
        raise argparse.ArgumentTypeError(f"{text!r} is not a JSON object or MODALITY=COUNT,... (e.g. image=2)")
    return {key.strip(): int(count) for key, _, count in pairs}


def parse_lora_module(text: str) -> dict[str, str]:
    """One --lora-modules entry, in vLLM's two forms: NAME=PATH, or a JSON object {"name": ..., "path": ...,
    "base_model_name": ...} (the last optional)."""
    if text.lstrip().startswith("{"):
        module = _json_arg(text, lambda v: isinstance(v, dict) and isinstance(v.get("name"), str)
                           and isinstance(v.get("path"), str) and set(v) <= {"name", "path", "base_model_name"},
                           'a JSON object {"name": ..., "path": ..., "base_model_name": ...}')
        return cast(dict[str, str], module)
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME=PATH or a JSON object with name and path")
    return {"name": name, "path": path}


CONFIG_HELP = ("a YAML file of flags (vLLM's --config): each key a flag's name (port, max-model-len or "
               "max_model_len), each value its value (true for a flag alone, a list or mapping as vLLM takes them); "
               "the command line's flags win")


def with_config_file(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """`argv` (a command's arguments, after its name) with `--config FILE` replaced by the file's flags, put first
    so that the command line's own win; SystemExit naming the file for one that cannot be read, or a key that is not
    a flag of `parser`. The file's `model` gives way to a model on the command line."""
    where = [i for i, arg in enumerate(argv) if arg == "--config" or arg.startswith("--config=")]
    if not where:
        return argv
    if len(where) > 1:
        raise SystemExit("error: --config given twice")
    index = where[0]
    if argv[index] == "--config":
        if index + 1 == len(argv):
            raise SystemExit("error: --config needs a YAML file")
        path, rest = argv[index + 1], argv[:index] + argv[index + 2:]
    else:
        path, rest = argv[index].partition("=")[2], argv[:index] + argv[index + 1:]
    given_model = any(a == "--model" or a.startswith("--model=") for a in rest) or bool(rest and rest[0][:1] != "-")
    return _config_flags(path, parser, skip={"model"} if given_model else set()) + rest


def _config_flags(path: str, parser: argparse.ArgumentParser, skip: set[str]) -> list[str]:
    import yaml

    try:
        with open(path, encoding="utf-8") as file:
            config = yaml.safe_load(file)
    except (OSError, yaml.YAMLError) as exc:
        raise SystemExit(f"error: --config {path}: {exc}") from None
    if not isinstance(config, dict):
        raise SystemExit(f"error: --config {path}: not a YAML mapping of flags to their values")
    known = parser._option_string_actions     # argparse keeps its flags only there
    flags: list[str] = []
    for key, value in config.items():
        name = str(key).replace("_", "-")
        flag = f"--{name}"
        if flag not in known:
            raise SystemExit(f"error: --config {path}: {key!r} is not a flag of this command (see --help)")
        if name in skip or value is None:
            continue
        if isinstance(value, bool):
            flags += [flag] if value else [f"--no-{name}"] if f"--no-{name}" in known else []
        elif isinstance(value, list):
            flags += [flag, *(v if isinstance(v, str) else json.dumps(v) for v in value)] if value else []
        elif isinstance(value, dict):
            flags += [flag, json.dumps(value)]
        else:
            flags += [flag, str(value)]
    return flags


def lora_modules_from_args(args: argparse.Namespace) -> list:
    """The LoRARequests --lora-modules names, with ids 1, 2, ... in order."""
    from pagedllm.lora.request import LoRARequest

    return [LoRARequest(m["name"], i, m["path"], m.get("base_model_name"))
            for i, m in enumerate(args.lora_modules or [], start=1)]


def add_server_args(parser: argparse.ArgumentParser, *, positional_model: bool) -> argparse.ArgumentParser:
    """Add every serving flag to `parser`, group by group (--help lists them so).

    Args:
        positional_model: `pagedllm serve [MODEL]` takes the model as an optional positional argument; both
            forms also accept --model.
    """
    model_help = ("a Hugging Face model folder (config.json + safetensors), a .gguf file, or the name of the "
                  "embedded default model (SmolLM2-135M-Instruct, used when no model is given)")
    if positional_model:
        parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL", help=model_help)
    parser.add_argument("--model", default=None, help=model_help)
    parser.add_argument("--config", metavar="FILE", help=CONFIG_HELP)

    server = parser.add_argument_group("server")
    _add_http_args(server)
    add_request_handling_args(parser, server)
    return parser


RUN_BATCH_DESCRIPTION = ("Answer a file of requests in OpenAI's batch format (a JSON object a line: custom_id, "
                         "method POST, url /v1/chat/completions, /v1/completions or /v1/responses, body) offline, "
                         "as the server would, and write a line for each to the output file, in the input's order.")


def add_run_batch_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add `run-batch`'s flags to `parser`: the files, the model, and how requests are answered (as `serve`)."""
    parser.add_argument("--config", metavar="FILE", help=CONFIG_HELP)
    batch = parser.add_argument_group("batch")
    batch.add_argument("-i", "--input-file", required=True,
                       help="the requests, a JSON object a line ('-': standard input)")
    batch.add_argument("-o", "--output-file", required=True,
                       help="where the answers go, a line each, in the input's order ('-': standard output)")
    batch.add_argument("--model", default=None,
                       help="a Hugging Face model folder (config.json + safetensors), a .gguf file, or the name of "
                            "the embedded default model (SmolLM2-135M-Instruct, used when no model is given)")
    add_request_handling_args(parser, batch)
    return parser


def add_request_handling_args(parser: argparse.ArgumentParser, group: argparse._ArgumentGroup) -> None:
    """The flags of how requests are answered, shared by `serve` and `run-batch`: into `group` those of the
    OpenAI layer, then the request limits, model, KV cache, scheduler, LoRA and parallelism groups (vLLM's
    --help groups its engine flags so too)."""
    _add_openai_args(group)
    _add_limit_args(parser.add_argument_group("request limits"))
    _add_model_args(parser.add_argument_group("model"))
    _add_cache_args(parser.add_argument_group("KV cache"))
    _add_scheduler_args(parser.add_argument_group("scheduler"))
    _add_lora_args(parser.add_argument_group("LoRA adapters"))
    _add_parallel_args(parser.add_argument_group("parallelism (docs/scale-out.md)"))


def _add_http_args(server: argparse._ArgumentGroup) -> None:
    server.add_argument("--host", default="127.0.0.1",
                        help="address to bind; 0.0.0.0 exposes the server to the network (default: %(default)s)")
    server.add_argument("--port", type=int, default=8000, help="TCP port (default: %(default)s)")
    server.add_argument("--uds", default=None, metavar="PATH",
                        help="serve on this Unix domain socket instead of --host and --port")
    server.add_argument("--root-path", default="",
                        help="the path prefix a proxy in front serves the API under (e.g. /llm); requests are "
                             "routed with or without it (default: none)")
    server.add_argument("--ssl-keyfile", default=None, help="serve HTTPS: the server's private key (PEM)")
    server.add_argument("--ssl-certfile", default=None, help="serve HTTPS: the server's certificate (PEM)")
    server.add_argument("--ssl-ca-certs", default=None,
                        help="the CA certificates that client certificates are checked against (PEM)")
    server.add_argument("--ssl-cert-reqs", type=int, default=0, choices=[0, 1, 2],
                        help="client certificates: 0 not asked for, 1 checked when sent, 2 required (Python's "
                             "ssl.CERT_NONE, CERT_OPTIONAL, CERT_REQUIRED; default: %(default)s)")
    env_key = os.environ.get("PAGEDLLM_API_KEY")
    server.add_argument("--api-key", nargs="+", default=None if env_key is None else [env_key], metavar="KEY",
                        help="require 'Authorization: Bearer KEY' on /v1/* for one of these keys (default: "
                             "$PAGEDLLM_API_KEY; unset means no key)")
    server.add_argument("--allowed-origins", type=parse_json_list, default=[], metavar="JSON",
                        help='origins whose web pages may call the server from a browser (CORS), e.g. '
                             '\'["http://localhost:3000"]\' or \'["*"]\' (default: none, as vLLM)')
    server.add_argument("--allowed-methods", type=parse_json_list, default=["*"], metavar="JSON",
                        help="the HTTP methods those pages may use (default: all)")
    server.add_argument("--allowed-headers", type=parse_json_list, default=["*"], metavar="JSON",
                        help="the request headers those pages may send (default: all)")
    server.add_argument("--allow-credentials", action="store_true",
                        help="let those pages send cookies and HTTP authentication")
    server.add_argument("--shutdown-timeout", type=float, default=30.0,
                        help="on SIGTERM or Ctrl-C: seconds to let running requests finish before aborting them "
                             "(new requests get 503 meanwhile); a second Ctrl-C quits at once (default: %(default)s)")
    server.add_argument("--disable-uvicorn-access-log", action="store_true",
                        help="no uvicorn log line per HTTP request")
    server.add_argument("--enable-request-id-headers", action="store_true",
                        help="every response carries X-Request-Id: the request's own, else a new one")
    server.add_argument("--enable-server-load-tracking", action="store_true",
                        help='serve /load: {"server_load": N}, the requests running the model now')
    server.add_argument("--disable-access-log-for-endpoints", default=None, metavar="PATHS",
                        help="paths whose requests uvicorn does not log, comma-separated, e.g. /health,/metrics")
    server.add_argument("--h11-max-incomplete-event-size", type=parse_bytes, default=4 * 1024 * 1024,
                        help="most bytes of a request's head (and of a body chunk) not yet parsed; more is refused "
                             "(default: 4MiB)")
    server.add_argument("--enable-tokenizer-info-endpoint", action="store_true",
                        help="serve /tokenizer_info: the tokenizer's settings and the chat template")
    server.add_argument("--middleware", action="append", default=[], metavar="IMPORT.PATH",
                        help="an ASGI middleware class, or an HTTP middleware coroutine function, to add (repeat "
                             "for several)")
    server.add_argument("--ssl-ciphers", default=None,
                        help="the TLS ciphers HTTPS offers (OpenSSL's cipher list format)")
    server.add_argument("--disable-fastapi-docs", action="store_true",
                        help="no API schema or docs pages (/openapi.json, /docs, /redoc answer 404)")
    server.add_argument("--uvicorn-log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug", "trace"],
                        help="uvicorn's log level (default: %(default)s)")


def _add_openai_args(server: argparse._ArgumentGroup) -> None:
    server.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                        help="name(s) clients use in the `model` field; the first is reported back "
                             "(default: the model's own name)")
    server.add_argument("--chat-template", default=None,
                        help="a Jinja chat template, or the path of a file holding one, replacing the model's own")
    server.add_argument("--chat-template-content-format", default="auto", choices=CHAT_CONTENT_FORMATS,
                        help="how a message's content reaches the chat template: its text (string), a list of typed "
                             "parts (openai), or as the template reads it (default: %(default)s)")
    server.add_argument("--enable-auto-tool-choice", action="store_true",
                        help='let the model call tools on its own (tool_choice "auto"); needs --tool-call-parser')
    server.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                        help="how tool calls are written in the model's replies: hermes (<tool_call> JSON, Qwen2 "
                             "and Qwen3), llama3_json, mistral ([TOOL_CALLS]), pythonic ([f(x=1)], Llama 3.2/4), "
                             "qwen3_coder (XML), granite, phi4_mini_json, lfm2, functiongemma, and vLLM's other "
                             "names for these formats")
    server.add_argument("--reasoning-parser", default=None, choices=REASONING_PARSERS,
                        help="how the model marks its thinking: deepseek_r1 (<think> ... </think>: DeepSeek-R1 and "
                             "its Qwen2 distills, QwQ), qwen3 (only a reply that opens with <think> reasons) or "
                             "mistral ([THINK] ... [/THINK]: Magistral, Ministral 3's reasoning models); "
                             "replies then carry it in `reasoning`, apart from `content`")
    server.add_argument("--trust-request-chat-template", action="store_true",
                        help="take a chat request's own chat_template (Jinja a client wrote); by default such a "
                             "request gets 400, as in vLLM")
    server.add_argument("--trust-request-mm-kwargs", action="store_true",
                        help="take a chat request's own mm_processor_kwargs (they change what an image costs); by "
                             "default such a request gets 400, as in vLLM")
    server.add_argument("--default-chat-template-kwargs", type=parse_json_object, default=None, metavar="JSON",
                        help="template variables every chat is rendered with, under a request's own "
                             "chat_template_kwargs, e.g. '{\"enable_thinking\": false}' for Qwen3")
    server.add_argument("--response-role", default="assistant",
                        help="the role of a chat reply that follows the generation prompt (default: %(default)s)")
    server.add_argument("--exclude-tools-when-tool-choice-none", action="store_true",
                        help='render a chat whose tool_choice is "none" without its tools')
    server.add_argument("--return-tokens-as-token-ids", action="store_true",
                        help="log-probabilities name tokens 'token_id:{id}' unless a request says otherwise (for "
                             "tokens whose text is not valid UTF-8 on its own)")
    server.add_argument("--sse-keep-alive-interval", type=_non_negative_seconds, default=0.0, metavar="SECONDS",
                        help="a streamed response idle this many seconds (queued, prefilling, thinking between "
                             "tokens) gets an SSE comment line, so that a proxy's read timeout does not close it "
                             "(default: 0, never)")
    server.add_argument("--enable-per-request-metrics", action="store_true",
                        help="a chat or completion response of one choice carries its timings in `metrics` (time to "
                             "first token, queue time, decode time, mean inter-token latency, tokens a second; "
                             "streamed, on the usage chunk), as vLLM's")
    server.add_argument("--enable-force-include-usage", action="store_true",
                        help="a streamed response ends with its usage whether or not stream_options asks")
    server.add_argument("--enable-prompt-tokens-details", action="store_true",
                        help="taken so that vLLM command lines run: usage always carries "
                             "prompt_tokens_details.cached_tokens (the prompt's tokens the prefix cache held)")
    server.add_argument("--enable-log-requests", action="store_true",
                        help="log each request's prompt and sampling parameters (off: prompts may be private)")
    server.add_argument("--enable-log-outputs", action="store_true",
                        help="with --enable-log-requests, also log each completion's text once it ends")
    server.add_argument("--max-log-len", type=_non_negative, default=None,
                        help="with --enable-log-requests, the most characters of a request's prompt logged "
                             "(default: all)")
    server.add_argument("--log-level", type=str.upper, default=None, choices=LOG_LEVELS,
                        help="the level of pagedllm's log (default: INFO, or PAGEDLLM_LOGGING_LEVEL)")
    server.add_argument("--logging-config", type=parse_logging_config, default={}, metavar="JSON",
                        help='how the server logs, as vLLM\'s: \'{"formatter": "json"}\' (one JSON object a line), '
                             '"log_level", "pylogging_config_file" (a logging.config.dictConfig JSON file, which then '
                             'decides everything), "configure_logging": false (leave logging as it is)')
    server.add_argument("--log-config-file", default=None, metavar="PATH",
                        help="a logging.config.dictConfig JSON file (vLLM's older flag: --logging-config's "
                             "pylogging_config_file)")
    server.add_argument("--disable-log-stats", action="store_true",
                        help="no log line every 10 s of the throughput, the running and waiting requests, KV "
                             "cache usage and prefix cache hit rate")


def _add_limit_args(limits: argparse._ArgumentGroup) -> None:
    limits.add_argument("--max-request-body-bytes", type=parse_bytes, default=4 * 1024 * 1024,
                        help="larger request bodies get 413 (default: 4MiB)")
    limits.add_argument("--max-n", type=int, default=128, help="most completions per prompt, n (default: %(default)s)")
    limits.add_argument("--max-stop-strings", type=int, default=64,
                        help="most stop strings per request (default: %(default)s)")
    limits.add_argument("--max-logprobs", type=int, default=20,
                        help="most log-probabilities per token, logprobs / top_logprobs (default: %(default)s)")
    limits.add_argument("--max-choices", type=int, default=1024,
                        help="most completions one request may start, prompts x n (default: %(default)s)")


def _add_model_args(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--trust-remote-code", action="store_true",
                       help="taken so that vLLM command lines run; it changes nothing: pagedllm runs its own "
                            "model code for every architecture it takes, never code from a checkpoint")
    group.add_argument("--runner", choices=RUNNERS, default="auto",
                       help="taken so that vLLM command lines run (`--runner pooling` for an embedding model); it "
                            "selects nothing: one engine both generates and embeds (/v1/embeddings), and classifies "
                            "(/classify) when the checkpoint has a classification head")
    group.add_argument("--convert", choices=CONVERTS, default="auto",
                       help="as --runner (`--convert embed`): embeddings are always served, by LAST pooling")
    group.add_argument("--tokenizer-mode", choices=TOKENIZER_MODES, default="auto",
                       help="taken so that vLLM command lines run: the checkpoint's own fast tokenizer "
                            "(transformers'); pagedllm has no slow or mistral mode")
    group.add_argument("--revision", default=None,
                       help="taken so that vLLM command lines run: a Hugging Face hub commit, which pagedllm never "
                            "fetches; one given is logged, and the files on disk are read")
    group.add_argument("--tokenizer-revision", default=None, help="as --revision, for the tokenizer")
    group.add_argument("--download-dir", default=None,
                       help="taken so that vLLM command lines run: pagedllm never downloads; one given is logged")
    group.add_argument("--hf-token", nargs="?", const=True, default=None,
                       help="taken so that vLLM command lines run: pagedllm never contacts the Hugging Face hub; one "
                            "given is logged (never the token)")
    group.add_argument("--enable-sleep-mode", action="store_true",
                       help="taken so that vLLM command lines run: the sleep endpoints are served with "
                            "VLLM_SERVER_DEV_MODE=1, whatever this says")
    group.add_argument("--tokenizer", default=None,
                       help="a tokenizer (or model) folder, or a .gguf file, whose tokenizer replaces the model's "
                            "own: for a .gguf file without a vocabulary, or one that converts badly (default: the "
                            "model's)")
    group.add_argument("--skip-tokenizer-init", action="store_true",
                       help="load no tokenizer: prompts must be token ids, and completions carry token ids "
                            "(return_token_ids) and no text; chat, /tokenize, stop strings and echo get 400")
    group.add_argument("--max-model-len", type=int, default=None,
                       help="context length cap, prompt + output tokens (default: the model's own)")
    group.add_argument("--device", default="auto",
                       help="auto (CUDA when torch sees a CUDA device, else the CPU), cpu, cuda or cuda:N "
                            "(default: %(default)s)")
    group.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"],
                       help="weight and activation precision; auto is bfloat16 on a GPU and where the CPU supports "
                            "it, float32 otherwise (default: %(default)s)")
    group.add_argument("--quantization", "-q", default=None,
                       choices=["int8", "w8a8", "gguf", "awq", "gptq", "fp8", "compressed-tensors", "mxfp4"],
                       help="int8: linear weights stored as int8 with one scale per output row, quantized at load; "
                            "w8a8: those int8 weights times activations quantized to int8, a scale per 64 values; "
                            "gguf: a .gguf file's Q4_0, Q4_1, Q8_0 and Q4_K linear weights kept in their blocks; "
                            "awq, gptq: an AWQ or GPTQ checkpoint's 4-bit weights kept in 4 bits, and "
                            "compressed-tensors' W4A16 ones; fp8, compressed-tensors: an 8-bit checkpoint's weights, "
                            "dequantised into the dtype; mxfp4: an MXFP4 checkpoint's (gpt-oss's) experts kept in "
                            "their 4 bits on one CPU rank "
                            "(default: the checkpoint's own: its quantization_config, gguf for a .gguf file under "
                            "--dtype auto on one CPU rank; else none: the dtype's weights, so --dtype bfloat16 or "
                            "float32 dequantises a .gguf file)")
    group.add_argument("--enforce-eager", action="store_true",
                       help="run the model's modules one by one from Python: on a GPU instead of replaying CUDA "
                            "graphs captured at start-up, on a CPU instead of running the decoder layers in one C++ "
                            "call")
    group.add_argument("--disable-cascade-attn", action="store_true",
                       help="never run a step's attention as cascade attention over a prefix all its sequences "
                            "share (the kernels do where it pays): a request's attention then does not depend on "
                            "its batch")
    group.add_argument("--generation-config", default="auto", metavar="auto|vllm|FOLDER",
                       help="auto: the model's generation_config.json gives the sampling defaults of requests that "
                            "set none (temperature, top_p, top_k, min_p, repetition_penalty, max_tokens) and its "
                            "other EOS ids end replies; vllm: none of it; or a folder holding such a file "
                            "(default: %(default)s)")
    group.add_argument("--override-generation-config", type=parse_json_object, default=None, metavar="JSON",
                       help="sampling defaults set over --generation-config's (vLLM's), by generation_config.json's "
                            "names, e.g. '{\"temperature\": 0.5, \"max_new_tokens\": 256}'")
    group.add_argument("--pooler-config", type=parse_json_object, default=None,
                       help="how embeddings pool, as JSON (vLLM's): '{\"pooling_type\": \"MEAN\"}' (LAST, MEAN or "
                            "CLS); by default the model's sentence-transformers config says, else LAST")
    group.add_argument("--hf-overrides", type=parse_json_object, default=None,
                       help="JSON fields set on the model's transformers config (vLLM's), e.g. "
                            "'{\"architectures\": [\"Qwen3ForSequenceClassification\"], \"classifier_from_token\": "
                            "[\"no\", \"yes\"], \"is_original_qwen3_reranker\": true}' serves Qwen3-Reranker")
    group.add_argument("--mm-processor-kwargs", type=parse_json_object, default=None,
                       help="JSON arguments for the model's processor on every prompt with images (vLLM's), e.g. "
                            "'{\"do_image_splitting\": false}' for Idefics3 (SmolVLM)")
    group.add_argument("--limit-mm-per-prompt", type=parse_mm_limits, default=None, metavar="JSON",
                       help="the most images one prompt may hold (vLLM's), '{\"image\": 2}' (or image=2); a prompt "
                            "with more gets 400. '{\"image\": 0}' loads no image encoder: a vision-language model "
                            "then serves text only, in less memory. video and audio limits are taken and unused "
                            "(default: no limit)")
    group.add_argument("--language-model-only", action="store_true",
                       help="images off (--limit-mm-per-prompt image=0): a vision-language checkpoint serves text, "
                            "without loading its image encoder")
    group.add_argument("--allowed-local-media-path", default="", metavar="FOLDER",
                       help="let chats name images under FOLDER by file:// URL (any client may then read them)")
    group.add_argument("--allowed-media-domains", nargs="+", default=None, metavar="HOST",
                       help="read http(s) image URLs of these hosts only (default: any)")
    group.add_argument("--disable-sliding-window", action="store_true",
                       help="cap the context at the model's sliding window, every layer attending over all of it")
    group.add_argument("--enable-prompt-embeds", action="store_true",
                       help="take /v1/completions' prompt_embeds: base64 of torch.save'd [tokens, hidden_size] tensors")
    group.add_argument("--logits-processors", nargs="+", default=None, metavar="IMPORT.PATH",
                       help="custom logits processors by import path (package.module.Class), subclasses of "
                            "pagedllm.sample.logits_processor.LogitsProcessor; a request's vllm_xargs reach them")
    group.add_argument("--logprobs-mode", default="raw_logprobs", choices=LOGPROBS_MODES,
                       help="what logprobs hold: the model's (raw_*) or the sampled distribution's, after penalties, "
                            "temperature and filters (processed_*), as log-probabilities or logits "
                            "(default: %(default)s)")
    group.add_argument("--seed", type=int, default=0, help="seed of the engine's random stream (default: 0)")
    group.add_argument("--load-format", default="auto", choices=LOAD_FORMATS,
                       help="where the weights come from: the folder's safetensors or the .gguf file (auto, "
                            "safetensors, gguf), or random ones in the shapes of the folder's config.json (dummy: "
                            "no checkpoint read, to measure a model's speed before its weights are at hand)")


def _add_cache_args(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE,
                       help="tokens per KV-cache block, a power of two (default: %(default)s)")
    group.add_argument("--gpu-memory-utilization", type=float, default=None,
                       help="fraction of device memory for weights, activations and the KV cache; on a CPU, the "
                            "fraction of RAM (default: on a GPU 0.9, on a CPU a 4 GiB KV pool)")
    group.add_argument("--num-gpu-blocks-override", type=int, default=None, metavar="N",
                       help="the KV pool's size in blocks, over what memory would give (vLLM's name; on a CPU as on "
                            "a GPU), e.g. to see preemption with a small pool")
    group.add_argument("--kv-cache-memory", "--kv-cache-memory-bytes", type=parse_bytes, default=None,
                       help="size of the KV pool, e.g. 512MiB or 2GiB; overrides --gpu-memory-utilization")
    group.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8"],
                       help="K/V storage: auto is the model's dtype; int8 stores int8 with a float32 scale per token "
                            "and kv head, ~1.9x the blocks of bfloat16, ~3.8x those of float32 (default: %(default)s)")
    group.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                       help="reuse the KV cache of shared prompt prefixes (default: on)")
    group.add_argument("--swap-space", type=float, default=0.0,
                       help="GiB of the second KV pool that swap preemption moves blocks to (default: 0)")
    group.add_argument("--swap-path", default=None,
                       help="file backing the swap pool on a CPU, deleted on shutdown; refused on a RAM-backed "
                            "filesystem such as /dev/shm (default: an anonymous file in a disk-backed directory)")
    group.add_argument("--kv-cache-metrics", action=argparse.BooleanOptionalAction, default=False,
                       help="KV cache residency metrics on /metrics: how long a sample of the blocks live from "
                            "allocation to reuse, sit unread before it, and go between reads (default: off)")
    group.add_argument("--kv-cache-metrics-sample", type=float, default=0.01, metavar="FRACTION",
                       help="with --kv-cache-metrics, the fraction of allocated blocks followed, in (0, 1] "
                            "(default: %(default)s)")


def _add_scheduler_args(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--max-num-seqs", type=int, default=256,
                       help="most requests in one engine step (default: %(default)s)")
    group.add_argument("--max-num-active-seqs", type=int, default=None, metavar="N",
                       help="the most sequences running at once, below --max-num-seqs: smaller decode batches, each "
                            "token sooner (default: --max-num-seqs)")
    group.add_argument("--max-num-batched-tokens", type=int, default=2048,
                       help="token budget of one engine step; longer prompts are prefilled in chunks "
                            "(default: %(default)s)")
    group.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True,
                       help="prefill a prompt longer than a step's budget in chunks; off: each prompt in one step, "
                            "which needs --max-num-batched-tokens >= --max-model-len (default: on)")
    group.add_argument("--max-num-encoder-input-tokens", type=int, default=None,
                       help="image placeholders one engine step may encode the images of; a prompt's chunk stops "
                            "before an image past them (default: --max-num-batched-tokens)")
    group.add_argument("--long-prefill-token-threshold", type=int, default=0,
                       help="the most tokens one request computes in a step while others wait or run, so that a "
                            "long prompt's chunks leave room for the others (default: 0, no cap)")
    group.add_argument("--long-prefill-token-threshold-adaptive", action="store_true",
                       help="raise that cap to a fair share of the step's budget where that is more")
    group.add_argument("--max-num-queued-reqs", type=int, default=None,
                       help="the most requests the server holds, waiting or running (n completions count n); more "
                            "get 503 at once, for a load balancer or the client's retry to send elsewhere "
                            "(default: no limit)")
    group.add_argument("--max-num-queued-tokens", type=int, default=None,
                       help="the most prompt tokens waiting for their prefill; while the backlog is there, new "
                            "requests get 503: a time-to-first-token budget, its target times the prefill rate "
                            "(default: no limit)")
    group.add_argument("--stream-interval", type=int, default=1, metavar="N",
                       help="a streamed request's chunk once N tokens are new, its first and last at once; more "
                            "than 1 spares the server a chunk a token under heavy load (default: %(default)s)")
    group.add_argument("--scheduler-reserve-full-isl", action=argparse.BooleanOptionalAction, default=True,
                       help="admit a waiting request only while the free KV blocks hold its whole prompt, not only "
                            "its first chunk, so that its later chunks preempt nobody (default: on, as vLLM's)")
    group.add_argument("--watermark", type=float, default=0.0, metavar="FRACTION",
                       help="the fraction of the KV pool an admission leaves free while others run, room for them "
                            "to grow without preemption, in [0, 1) (default: %(default)s)")
    group.add_argument("--preemption-mode", default="recompute", choices=["recompute", "swap", "auto"],
                       help="what to do with a request when KV blocks run out (default: %(default)s)")
    group.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"],
                       help="fcfs: first come first served, a request with a non-zero `priority` gets 400; "
                            "priority: a request's `priority` orders the queue, lower first (default: %(default)s)")
    group.add_argument("--speculative-config", type=parse_json_object, default=None,
                       help='speculative decoding as JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 3, '
                            '"prompt_lookup_max": 3, "prompt_lookup_min": 1}\', or with a draft model '
                            '\'{"model": PATH, "num_speculative_tokens": 4}\' (default: off)')
    group.add_argument("--structured-outputs-config", type=parse_json_object, default=None, metavar="JSON",
                       help='structured outputs as vLLM configures them, e.g. \'{"disable_any_whitespace": false, '
                            '"enable_in_reasoning": true}\': "backend" is taken by name (pagedllm compiles with '
                            'llguidance), JSON is compact unless disable_any_whitespace is false, and with a '
                            'reasoning parser a constraint applies after the thought unless enable_in_reasoning')
    group.add_argument("--profiler-config", type=parse_json_object, default=None, metavar="JSON",
                       help='torch\'s profiler for /start_profile and /stop_profile (served with it), as vLLM '
                            'configures it, e.g. \'{"profiler": "torch", "torch_profiler_dir": "./traces"}\' '
                            '(default: off)')
    group.add_argument("--spec-method", default=None, choices=["ngram", "draft_model"],
                       help="shortcut for --speculative-config's method")
    group.add_argument("--spec-model", default=None, metavar="PATH",
                       help="shortcut for --speculative-config's model (the draft model)")
    group.add_argument("--spec-tokens", type=int, default=None, metavar="K",
                       help="shortcut for --speculative-config's num_speculative_tokens")


def _add_lora_args(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--enable-lora", action="store_true",
                       help="serve LoRA adapters (PEFT's format) beside the base model (default: off)")
    group.add_argument("--lora-modules", nargs="+", type=parse_lora_module, default=None, metavar="NAME=PATH",
                       help='the adapters served, each under its name as `model`: NAME=PATH or \'{"name": ..., '
                            '"path": ..., "base_model_name": ...}\'; needs --enable-lora')
    group.add_argument("--max-loras", type=int, default=1,
                       help="most distinct adapters in one engine step (default: %(default)s)")
    group.add_argument("--max-lora-rank", type=int, default=16,
                       help="the largest adapter rank taken (default: %(default)s)")
    group.add_argument("--max-cpu-loras", type=int, default=None,
                       help="adapters kept loaded; others load again when asked for (default: --max-loras)")


def _add_parallel_args(parallel: argparse._ArgumentGroup) -> None:
    parallel.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                          help="worker processes sharing each layer, joined by torch.distributed (default: 1)")
    parallel.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1, choices=[1],
                          help="taken so that vLLM command lines run: 1 only (pagedllm splits a model by tensor "
                               "parallelism; -tp)")
    parallel.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                          help="engines behind a prefix-aware router, each with its own KV pool of the configured "
                               "size (default: 1)")
    parallel.add_argument("--data-parallel-router", default="prefix_aware", choices=["prefix_aware", "round_robin"],
                          help="send a request to the replica most likely to hold its prefix (else the least "
                               "loaded), or round robin (default: %(default)s)")
    parallel.add_argument("--distributed-executor-backend", default=None, choices=["mp", "ray"],
                          help="start the tensor-parallel workers as local processes (mp, the default) or Ray "
                               "actors; with ray, the data-parallel replicas run in Ray actors too")


def parse_logging_config(text: str) -> dict[str, Any]:
    """--logging-config's JSON: vLLM's LoggingConfig fields, checked."""
    config = parse_json_object(text)
    known = {"log_level": str, "formatter": str, "configure_logging": bool, "pylogging_config_file": str}
    for key, value in config.items():
        if key not in known or not isinstance(value, known[key]):
            raise argparse.ArgumentTypeError(f"--logging-config takes {', '.join(known)} (log_level, formatter and "
                                             f"pylogging_config_file strings, configure_logging a boolean); got "
                                             f"{key!r}: {value!r}")
    if config.get("formatter", "text") not in ("text", "json"):
        raise argparse.ArgumentTypeError(f"--logging-config's formatter is 'text' or 'json', got "
                                         f"{config['formatter']!r}")
    if str(config.get("log_level", "INFO")).upper() not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"--logging-config's log_level is one of {', '.join(LOG_LEVELS)}, got "
                                         f"{config['log_level']!r}")
    return config


def configure_logging(args: argparse.Namespace) -> None:
    """The log of `serve` and `run-batch`: INFO from every library, and pagedllm's at --log-level if given, as text or
    one JSON object a line (--logging-config's formatter); or as a dictConfig file says (--log-config-file, or
    --logging-config's pylogging_config_file), which then decides everything; nothing with configure_logging false.
    Exits on --enable-log-outputs without --enable-log-requests (vLLM's rule), and on a config file that does not
    load."""
    import logging
    import logging.config

    from pagedllm.logger import JsonFormatter

    if args.enable_log_outputs and not args.enable_log_requests:
        raise SystemExit("error: --enable-log-outputs needs --enable-log-requests")
    config = args.logging_config
    if not config.get("configure_logging", True):
        return
    path = args.log_config_file or config.get("pylogging_config_file")
    if path:
        try:
            logging.config.dictConfig(json.loads(Path(path).read_text()))
        except (OSError, ValueError, TypeError, AttributeError, ImportError) as e:
            raise SystemExit(f"error: the logging config file {path} does not load: {e}") from e
        return
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if config.get("formatter") == "json":
        for handler in (*logging.getLogger().handlers, *logging.getLogger("pagedllm").handlers):
            handler.setFormatter(JsonFormatter())
    level = args.log_level or config.get("log_level")
    if level is not None:
        logging.getLogger("pagedllm").setLevel(level.upper())


def model_of(args: argparse.Namespace) -> str | None:
    tag = getattr(args, "model_tag", None)
    if tag is not None and args.model is not None and tag != args.model:
        raise SystemExit(f"error: two models given: {tag!r} and --model {args.model!r}")
    return tag or args.model


def engine_config_from_args(args: argparse.Namespace):
    """The EngineConfig the flags describe. Raises ValueError naming a bad field."""
    from pagedllm.config import (
        CacheConfig,
        EngineConfig,
        LoRAConfig,
        ModelConfig,
        ParallelConfig,
        ProfilerConfig,
        SchedulerConfig,
        SpeculativeConfig,
    )

    if args.lora_modules and not args.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora")
    check_vllm_loading_args(model_of(args), args.tokenizer_mode, args.revision, args.tokenizer_revision,
                            args.download_dir, args.hf_token)
    return EngineConfig(
        model=ModelConfig(model=model_of(args), dtype=args.dtype, max_model_len=args.max_model_len, seed=args.seed,
                          chat_template=args.chat_template, tokenizer=args.tokenizer,
                          skip_tokenizer_init=args.skip_tokenizer_init, quantization=args.quantization,
                          device=args.device, enforce_eager=args.enforce_eager,
                          disable_cascade_attn=args.disable_cascade_attn,
                          generation_config=args.generation_config,
                          override_generation_config=args.override_generation_config, hf_overrides=args.hf_overrides,
                          pooler_config=args.pooler_config, mm_processor_kwargs=args.mm_processor_kwargs,
                          limit_mm_per_prompt=args.limit_mm_per_prompt, logprobs_mode=args.logprobs_mode,
                          load_format=args.load_format,
                          language_model_only=args.language_model_only,
                          disable_sliding_window=args.disable_sliding_window,
                          allowed_local_media_path=args.allowed_local_media_path,
                          allowed_media_domains=args.allowed_media_domains,
                          logits_processors=args.logits_processors, enable_prompt_embeds=args.enable_prompt_embeds),
        cache=CacheConfig(block_size=args.block_size, kv_cache_memory=args.kv_cache_memory,
                          gpu_memory_utilization=args.gpu_memory_utilization, swap_space=args.swap_space,
                          swap_path=args.swap_path, enable_prefix_caching=args.enable_prefix_caching,
                          kv_cache_dtype=args.kv_cache_dtype, num_blocks=args.num_gpu_blocks_override,
                          kv_cache_metrics=args.kv_cache_metrics,
                          kv_cache_metrics_sample=args.kv_cache_metrics_sample),
        scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                                  enable_chunked_prefill=args.enable_chunked_prefill,
                                  max_num_encoder_input_tokens=args.max_num_encoder_input_tokens,
                                  long_prefill_token_threshold=args.long_prefill_token_threshold,
                                  long_prefill_token_threshold_adaptive=args.long_prefill_token_threshold_adaptive,
                                  stream_interval=args.stream_interval,
                                  scheduler_reserve_full_isl=args.scheduler_reserve_full_isl,
                                  watermark=args.watermark, max_num_active_seqs=args.max_num_active_seqs,
                                  preemption_mode=args.preemption_mode, scheduling_policy=args.scheduling_policy),
        speculative=SpeculativeConfig.from_dict(_speculative_config(args)),
        structured_outputs=_structured_outputs_config(args),
        profiler=ProfilerConfig.from_dict(args.profiler_config),
        parallel=ParallelConfig(tensor_parallel_size=args.tensor_parallel_size,
                                data_parallel_size=args.data_parallel_size,
                                distributed_executor_backend=args.distributed_executor_backend,
                                data_parallel_router=args.data_parallel_router),
        lora=LoRAConfig(args.max_loras, args.max_lora_rank, args.max_cpu_loras) if args.enable_lora else None,
    )


def _speculative_config(args: argparse.Namespace) -> dict | None:
    """--speculative-config with the --spec-* shortcuts' fields in it (vLLM's: a field given both ways is an
    error)."""
    config = dict(args.speculative_config or {})
    for flag, key, value in (("--spec-method", "method", args.spec_method), ("--spec-model", "model", args.spec_model),
                             ("--spec-tokens", "num_speculative_tokens", args.spec_tokens)):
        if value is None:
            continue
        if key in config:
            raise ValueError(f"{flag} and --speculative-config's {key!r} are both given: give one")
        config[key] = value
    return config or None


def _structured_outputs_config(args: argparse.Namespace):
    """--structured-outputs-config with --reasoning-parser as its reasoning_parser (as vLLM sets it); the two naming
    different parsers is an error."""
    from pagedllm.config import StructuredOutputsConfig

    config = StructuredOutputsConfig.from_dict(args.structured_outputs_config)
    if args.reasoning_parser is not None:
        if config.reasoning_parser not in ("", args.reasoning_parser):
            raise ValueError(f"--reasoning-parser {args.reasoning_parser} and --structured-outputs-config's "
                             f"reasoning_parser {config.reasoning_parser!r} differ: give one")
        config.reasoning_parser = args.reasoning_parser
    return config
