"""The server's flags -> EngineConfig: --speculative-config takes vLLM's JSON (and its --spec-* shortcuts);
--stream-interval; --logprobs-mode; --enforce-eager,
--disable-cascade-attn, --generation-config, --mm-processor-kwargs, --limit-mm-per-prompt,
--[no-]enable-chunked-prefill; the CORS flags take JSON lists; uvicorn's access log; --help's groups."""

from __future__ import annotations

import argparse

import pytest

from pagedllm.entrypoints.openai.api_server import uvicorn_config
from pagedllm.entrypoints.openai.cli_args import add_server_args, engine_config_from_args


def _config(*argv: str):
    parser = add_server_args(argparse.ArgumentParser(), positional_model=True)
    return engine_config_from_args(parser.parse_args(list(argv)))


def test_speculative_config_json() -> None:
    assert _config().speculative is None
    config = _config("--speculative-config", '{"method": "ngram", "num_speculative_tokens": 5, '
                                             '"prompt_lookup_max": 4, "prompt_lookup_min": 2}')
    spec = config.speculative
    assert (spec.method, spec.num_speculative_tokens, spec.prompt_lookup_max, spec.prompt_lookup_min) == \
        ("ngram", 5, 4, 2)
    draft = _config("--speculative-config", '{"model": "/models/draft", "num_speculative_tokens": 4}').speculative
    assert (draft.method, draft.model, draft.num_speculative_tokens, draft.num_lookahead_tokens) == \
        ("draft_model", "/models/draft", 4, 4)


def test_the_spec_shortcuts_fill_the_speculative_config_as_in_vllm() -> None:
    spec = _config("--spec-method", "ngram", "--spec-tokens", "5").speculative
    assert (spec.method, spec.num_speculative_tokens) == ("ngram", 5)
    draft = _config("--spec-model", "/models/draft",
                    "--speculative-config", '{"num_speculative_tokens": 2}').speculative
    assert (draft.method, draft.model, draft.num_speculative_tokens) == ("draft_model", "/models/draft", 2)
    with pytest.raises(ValueError, match="--spec-tokens and --speculative-config's 'num_speculative_tokens'"):
        _config("--spec-tokens", "4", "--speculative-config", '{"num_speculative_tokens": 2}')


def test_the_structured_outputs_config_takes_the_reasoning_parser_as_vllm_does() -> None:
    assert _config().structured_outputs.reasoning_parser == ""
    config = _config("--structured-outputs-config", '{"disable_any_whitespace": false, "backend": "guidance"}',
                     "--reasoning-parser", "qwen3").structured_outputs
    assert (config.disable_any_whitespace, config.backend, config.reasoning_parser) == (False, "guidance", "qwen3")
    assert _config("--structured-outputs-config", '{"reasoning_parser": "qwen3"}').structured_outputs \
        .reasoning_parser == "qwen3"
    with pytest.raises(ValueError, match="differ: give one"):
        _config("--structured-outputs-config", '{"reasoning_parser": "qwen3"}', "--reasoning-parser", "mistral")


def test_prompt_embeds_are_taken_where_the_flag_says() -> None:
    assert (_config().model.enable_prompt_embeds, _config("--enable-prompt-embeds").model.enable_prompt_embeds) == \
        (False, True)


def test_the_logits_processors_reach_the_model_config_by_import_path() -> None:
    assert _config().model.logits_processors is None
    assert _config("--logits-processors", "a.b.C", "d.E").model.logits_processors == ["a.b.C", "d.E"]


def test_the_logprobs_mode_reaches_the_model_config() -> None:
    assert _config().model.logprobs_mode == "raw_logprobs"
    assert _config("--logprobs-mode", "processed_logits").model.logprobs_mode == "processed_logits"
    with pytest.raises(SystemExit):
        _config("--logprobs-mode", "cooked")


def test_the_stream_interval_reaches_the_scheduler_config() -> None:
    assert _config().scheduler.stream_interval == 1
    assert _config("--stream-interval", "8").scheduler.stream_interval == 8
    with pytest.raises(ValueError, match="stream_interval"):
        _config("--stream-interval", "0")


@pytest.mark.parametrize("text", ["{not json", "[1, 2]"])
def test_speculative_config_that_is_not_a_json_object_is_a_usage_error(text: str) -> None:
    with pytest.raises(SystemExit):
        _config("--speculative-config", text)


def test_bad_speculative_config_names_the_field() -> None:
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        _config("--speculative-config", '{"num_speculative_tokens": 0}')


def test_enforce_eager_reaches_the_model_config() -> None:
    assert _config().model.enforce_eager is False
    assert _config("--enforce-eager", "--device", "cuda").model.enforce_eager is True


def test_disable_cascade_attn_reaches_the_model_config() -> None:
    assert _config().model.disable_cascade_attn is False
    assert _config("--disable-cascade-attn").model.disable_cascade_attn is True


def test_chunked_prefill_is_on_unless_turned_off_as_in_vllm() -> None:
    assert _config().scheduler.enable_chunked_prefill is True
    assert _config("--enable-chunked-prefill").scheduler.enable_chunked_prefill is True
    assert _config("--no-enable-chunked-prefill").scheduler.enable_chunked_prefill is False


def _args(*argv: str) -> argparse.Namespace:
    return add_server_args(argparse.ArgumentParser(), positional_model=True).parse_args(list(argv))


def test_cors_flags_take_json_lists_as_vllms_do() -> None:
    default = _args()
    assert (default.allowed_origins, default.allowed_methods, default.allowed_headers) == ([], ["*"], ["*"])
    given = _args("--allowed-origins", '["http://localhost:3000"]', "--allow-credentials")
    assert given.allowed_origins == ["http://localhost:3000"] and given.allow_credentials
    for text in ("http://localhost:3000", '{"a": 1}', "[1]"):
        with pytest.raises(SystemExit):
            _args("--allowed-origins", text)


def test_generation_config_reaches_the_model_config() -> None:
    assert _config().model.generation_config == "auto"
    assert _config("--generation-config", "vllm").model.generation_config == "vllm"


def test_mm_processor_kwargs_reach_the_model_config() -> None:
    assert _config().model.mm_processor_kwargs is None
    assert _config("--mm-processor-kwargs", '{"do_image_splitting": false}').model.mm_processor_kwargs == \
        {"do_image_splitting": False}


def test_override_generation_config_reaches_the_model_config() -> None:
    assert _config().model.override_generation_config is None
    assert _config("--override-generation-config", '{"temperature": 0.5}').model.override_generation_config == \
        {"temperature": 0.5}


def test_the_long_prefill_cap_reaches_the_scheduler_config() -> None:
    assert _config().scheduler.long_prefill_token_threshold == 0
    scheduler = _config("--long-prefill-token-threshold", "512", "--long-prefill-token-threshold-adaptive").scheduler
    assert (scheduler.long_prefill_token_threshold, scheduler.long_prefill_token_threshold_adaptive) == (512, True)


def test_language_model_only_turns_images_off_and_the_sliding_window_flag_reaches_the_model_config() -> None:
    assert (_config().model.image_limit, _config().model.disable_sliding_window) == (None, False)
    assert _config("--language-model-only").model.image_limit == 0
    assert _config("--disable-sliding-window").model.disable_sliding_window is True


def test_the_kv_budget_takes_vllms_flag_and_the_log_level_sets_pagedllms(monkeypatch) -> None:
    import logging

    from pagedllm.entrypoints.openai.cli_args import configure_logging

    assert _config("--kv-cache-memory-bytes", "64MiB").cache.kv_cache_memory == 64 << 20
    root = logging.getLogger("pagedllm")
    monkeypatch.setattr(root, "level", root.level)       # put back after the test
    configure_logging(_args("--log-level", "debug"))
    assert root.level == logging.DEBUG
    with pytest.raises(SystemExit):
        _args("--log-level", "chatty")


@pytest.fixture
def logging_restored():
    """The root and pagedllm loggers' handlers, levels and formatters put back after the test."""
    import logging

    loggers = [logging.getLogger(), logging.getLogger("pagedllm")]
    saved = [(lg, list(lg.handlers), lg.level, [h.formatter for h in lg.handlers]) for lg in loggers]
    yield
    for lg, handlers, level, formatters in saved:
        lg.handlers[:] = handlers
        lg.setLevel(level)
        for handler, formatter in zip(handlers, formatters):
            handler.setFormatter(formatter)


def test_logging_config_json_lines_a_dictconfig_file_or_none(tmp_path, logging_restored) -> None:
    """vLLM's --logging-config: its formatter "json" writes one JSON object a line; a dictConfig file
    (pylogging_config_file, or --log-config-file) decides everything; configure_logging false leaves logging alone;
    a bad config is refused before the model loads."""
    import io
    import json
    import logging

    from pagedllm.entrypoints.openai.cli_args import configure_logging

    pagedllm_log = logging.getLogger("pagedllm")
    configure_logging(_args("--logging-config", '{"formatter": "json", "log_level": "debug"}'))
    stream = io.StringIO()
    pagedllm_log.handlers[0].stream = stream
    logging.getLogger("pagedllm.test").debug("a %s", "line")
    entry = json.loads(stream.getvalue())
    assert (entry["level"], entry["logger"], entry["message"]) == ("DEBUG", "pagedllm.test", "a line")
    assert pagedllm_log.level == logging.DEBUG

    log_file = tmp_path / "out.log"
    config = {"version": 1, "disable_existing_loggers": False,
              "handlers": {"file": {"class": "logging.FileHandler", "filename": str(log_file)}},
              "loggers": {"pagedllm": {"handlers": ["file"], "level": "WARNING", "propagate": False}}}
    (tmp_path / "logging.json").write_text(json.dumps(config))
    for flags in (["--log-config-file", str(tmp_path / "logging.json")],
                  ["--logging-config", json.dumps({"pylogging_config_file": str(tmp_path / "logging.json")})]):
        configure_logging(_args(*flags))
        logging.getLogger("pagedllm.x").warning("to the file")
        logging.getLogger("pagedllm.x").info("not at INFO")
    assert log_file.read_text().splitlines() == ["to the file", "to the file"]
    handlers = list(pagedllm_log.handlers)
    configure_logging(_args("--logging-config", '{"configure_logging": false, "formatter": "json"}'))
    assert pagedllm_log.handlers == handlers and handlers[0].formatter is None      # not made JSON
    assert pagedllm_log.level == logging.WARNING
    with pytest.raises(SystemExit, match="does not load"):
        configure_logging(_args("--log-config-file", str(tmp_path / "missing.json")))
    for bad in ('{"formatter": "xml"}', '{"log_level": "chatty"}', '{"colour": true}', '{"configure_logging": 1}'):
        with pytest.raises(SystemExit):
            _args("--logging-config", bad)


def test_the_media_flags_make_the_models_media_access(tmp_path) -> None:
    access = _config("--allowed-local-media-path", str(tmp_path), "--allowed-media-domains", "a.com", "b.org"
                     ).model.media_access
    assert (access.local_path, access.domains) == (str(tmp_path), ("a.com", "b.org"))
    assert (_config().model.media_access.local_path, _config().model.media_access.domains) == ("", None)
    with pytest.raises(ValueError, match="allowed_local_media_path must be an existing folder"):
        _config("--allowed-local-media-path", str(tmp_path / "nowhere"))


def test_a_block_count_overrides_the_kv_pools_size() -> None:
    assert _config().cache.num_blocks is None
    assert _config("--num-gpu-blocks-override", "64").cache.num_blocks == 64
    assert _args("-pp", "1").pipeline_parallel_size == 1
    with pytest.raises(SystemExit):          # pipeline parallelism: not taken, said at once
        _args("--pipeline-parallel-size", "2")


def test_limit_mm_per_prompt_takes_vllms_two_forms() -> None:
    assert _config().model.image_limit is None
    for text in ('{"image": 2, "video": 0}', "image=2,video=0", '{"image": {"count": 2, "width": 512}}'):
        assert _config("--limit-mm-per-prompt", text).model.image_limit == 2, text
    for text in ("image", "image=two", "{not json"):
        with pytest.raises(SystemExit):
            _config("--limit-mm-per-prompt", text)
    for text in ('{"image": -1}', '{"picture": 1}', "image=1,smell=2"):
        with pytest.raises(ValueError, match="limit_mm_per_prompt"):
            _config("--limit-mm-per-prompt", text)


@pytest.mark.parametrize(("flags", "access_log"), [((), True), (("--disable-uvicorn-access-log",), False)])
def test_uvicorn_access_log_follows_the_flag(flags, access_log) -> None:
    config = uvicorn_config(object(), _args("--port", "8123", *flags))
    assert config.access_log is access_log and config.port == 8123 and config.host == "127.0.0.1"


def test_a_vllm_command_line_parses() -> None:
    args = _args("--trust-remote-code", "--disable-log-stats", "--disable-uvicorn-access-log", "--max-model-len",
                 "4096", "--gpu-memory-utilization", "0.5", "--served-model-name", "smol", "--enable-prefix-caching",
                 "--generation-config", "vllm", "--allowed-origins", '["*"]')
    assert args.trust_remote_code and args.max_model_len == 4096 and args.served_model_name == ["smol"]


def test_vllms_tokenizer_mode_revisions_and_hub_flags_are_taken_and_logged(caplog) -> None:
    caplog.set_level("WARNING", logger="pagedllm")
    _config("--tokenizer-mode", "hf", "--revision", "v1.0", "--tokenizer-revision", "main", "--download-dir", "/m",
            "--hf-token", "--enable-sleep-mode")
    assert [r.getMessage().split(" is not used")[0] for r in caplog.records] == \
        ["revision='v1.0'", "tokenizer_revision='main'", "download_dir='/m'", "hf_token"]
    with pytest.raises(SystemExit):
        _args("--tokenizer-mode", "mistral")


def test_help_groups_the_engine_flags_as_vllm_does() -> None:
    parser = add_server_args(argparse.ArgumentParser(), positional_model=True)
    groups = {group.title: {option for action in group._group_actions for option in action.option_strings}
              for group in parser._action_groups}
    assert {"--dtype", "--quantization", "--max-model-len", "--enforce-eager"} <= groups["model"]
    assert {"--block-size", "--kv-cache-dtype", "--enable-prefix-caching", "--swap-space"} <= groups["KV cache"]
    assert {"--max-num-seqs", "--max-num-batched-tokens", "--preemption-mode"} <= groups["scheduler"]
    assert {"--enable-lora", "--max-loras", "--max-lora-rank"} <= groups["LoRA adapters"]
    assert "engine" not in groups


def test_the_encoder_budget_reaches_the_scheduler_config() -> None:
    assert _config().scheduler.max_num_encoder_input_tokens is None
    assert _config("--max-num-encoder-input-tokens", "512").scheduler.max_num_encoder_input_tokens == 512
    with pytest.raises(ValueError, match="max_num_encoder_input_tokens"):
        _config("--max-num-encoder-input-tokens", "0")


def test_a_yaml_config_file_gives_flags_under_the_command_lines(tmp_path, monkeypatch) -> None:
    """vLLM's --config: keys with dashes or underscores, booleans, lists and mappings; the command line wins, and
    the file's model gives way to one given on the command line."""
    from pagedllm.entrypoints.cli import main as cli_main
    from pagedllm.entrypoints.openai.cli_args import with_config_file

    config = tmp_path / "serve.yaml"
    config.write_text("model: /models/a\nport: 9000\nmax_model_len: 1024\nenable-prefix-caching: false\n"
                      "trust-remote-code: true\nserved-model-name: [x, y]\n"
                      "speculative-config:\n  method: ngram\n  num_speculative_tokens: 2\n")
    parser = add_server_args(argparse.ArgumentParser(), positional_model=True)
    args = parser.parse_args(with_config_file(["--config", str(config), "--port", "9001"], parser))
    assert (args.model, args.port, args.max_model_len, args.served_model_name) == ("/models/a", 9001, 1024, ["x", "y"])
    assert args.enable_prefix_caching is False and args.trust_remote_code is True
    assert engine_config_from_args(args).speculative.num_speculative_tokens == 2
    positional = parser.parse_args(with_config_file(["/models/b", f"--config={config}"], parser))
    assert (positional.model_tag, positional.model) == ("/models/b", None)      # the command line's model wins
    for text, error in (("port: [", "--config"), ("- a list", "not a YAML mapping"), ("colour: blue", "'colour'")):
        config.write_text(text)
        with pytest.raises(SystemExit, match=error):
            with_config_file(["--config", str(config)], parser)
    with pytest.raises(SystemExit, match="needs a YAML file"):
        with_config_file(["--config"], parser)
    config.write_text("input-file: in.jsonl\noutput-file: out.jsonl\n")
    seen = {}
    monkeypatch.setattr("pagedllm.entrypoints.cli._run_batch", lambda args: seen.update(vars(args)))
    cli_main(["run-batch", "--config", str(config), "--max-num-seqs", "4"])
    assert (seen["input_file"], seen["output_file"], seen["max_num_seqs"]) == ("in.jsonl", "out.jsonl", 4)


def test_the_admission_flags_make_the_scheduler_config() -> None:
    scheduler = _config("--max-num-active-seqs", "2", "--watermark", "0.05", "--no-scheduler-reserve-full-isl"
                        ).scheduler
    assert (scheduler.max_num_active_seqs, scheduler.watermark, scheduler.scheduler_reserve_full_isl) == \
        (2, 0.05, False)
    assert _config().scheduler.scheduler_reserve_full_isl is True and _config().scheduler.max_running_seqs == 256
