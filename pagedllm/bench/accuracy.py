"""`pagedllm bench accuracy`: what each weight quantization and KV-cache dtype costs in accuracy, measured against
the unquantized model in the same dtype, in one run, through the engine users run.

Two figures per configuration (weights x KV cache, e.g. `int8/auto`):
- *Perplexity* on a fixed text: exp of the mean negative log-likelihood of its tokens, each scored by
  `LLM.generate` with `SamplingParams(prompt_logprobs=0, max_tokens=1)`. The text is cut into windows of `--window`
  tokens, each starting `--stride` tokens after the one before; a window scores only the tokens no earlier window
  scored, so every token after the first is scored once, with at least `window - stride` tokens of context (the
  first window's tokens with what precedes them):

      tokens   0 ............................................ n
      window 0 [0 ............. W)                            scores 1 .. W-1
      window 1         [S ............. S+W)                  scores W .. S+W-1
      window 2                 [2S ............. 2S+W)        scores S+W .. 2S+W-1

- *Greedy agreement* on a workload's prompts (the mixed workload's 50 by default), `--max-tokens` greedy tokens
  each (ignore_eos): the share of output tokens equal to the reference's up to each request's first divergence,
  and the share equal at the same position overall.

The default text is the English translation of Natsume Soseki's *Botchan* (Yasotaro Morri, 1919; Project
Gutenberg eBook #8868, public domain), taken from `test/botchan.txt` in sentencepiece 0.2.3's source distribution
on PyPI (see `pagedllm/bench/data/README.md`). `--hf-check` adds transformers' perplexity of the unquantized
float32 model on the same windows, as the oracle.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import hashlib
import json
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pagedllm.bench.args import (
    add_dataset_args,
    add_engine_args,
    bench_tokenizer,
    engine_kwargs,
    requests_from_args,
)
from pagedllm.cpu import cpu_info

if TYPE_CHECKING:   # both are slow to import; the CLI imports this module to build its parser
    from transformers import PreTrainedModel

    from pagedllm import LLM

TEXT_PATH = Path(__file__).parent / "data" / "botchan.txt"
WEIGHT_QUANTIZATIONS = ("none", "int8", "w8a8", "gguf")  # "none": the checkpoint's weights in --dtype; "gguf":
                                                        # a .gguf file's blocks kept (quantization="gguf")
KV_CACHE_DTYPES = ("auto", "int8")                  # "auto": the KV cache in --dtype


@dataclass(frozen=True)
class AccuracyConfig:
    """One configuration to measure: a weight quantization and a KV-cache dtype."""

    quantization: str | None = None
    kv_cache_dtype: str = "auto"

    @property
    def name(self) -> str:
        return f"{self.quantization or 'none'}/{self.kv_cache_dtype}"

    def llm_kwargs(self) -> dict[str, Any]:
        """`LLM(...)` keyword arguments; kv_cache_dtype only when it is not the default, so that a build whose LLM
        has no such argument still runs the configurations it can."""
        kwargs: dict[str, Any] = {"quantization": self.quantization}
        if self.kv_cache_dtype != "auto":
            kwargs["kv_cache_dtype"] = self.kv_cache_dtype
        return kwargs


REFERENCE = AccuracyConfig()


def parse_config(text: str) -> AccuracyConfig:
    """'WEIGHTS[/KV]', e.g. 'none', 'int8', 'int8/int8' -> AccuracyConfig (argparse reports a bad one)."""
    weights, _, kv_cache_dtype = text.strip().partition("/")
    kv_cache_dtype = kv_cache_dtype or "auto"
    if weights not in WEIGHT_QUANTIZATIONS:
        raise argparse.ArgumentTypeError(f"config {text!r}: weights must be one of {', '.join(WEIGHT_QUANTIZATIONS)}"
                                         f" (the form is WEIGHTS[/KV], e.g. int8/auto)")
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise argparse.ArgumentTypeError(f"config {text!r}: the KV cache dtype must be one of "
                                         f"{', '.join(KV_CACHE_DTYPES)} (the form is WEIGHTS[/KV], e.g. int8/auto)")
    return AccuracyConfig(None if weights == "none" else weights, kv_cache_dtype)


def llm_accepts_kv_cache_dtype() -> bool:
    from pagedllm import EngineArgs

    return "kv_cache_dtype" in {f.name for f in dataclasses.fields(EngineArgs)}


def default_configs(gguf_model: bool) -> list[AccuracyConfig]:
    """Every weights x KV-cache combination this build's LLM accepts for the model (gguf for a .gguf file only)."""
    kv_dtypes = KV_CACHE_DTYPES if llm_accepts_kv_cache_dtype() else ("auto",)
    weights = [w for w in WEIGHT_QUANTIZATIONS if gguf_model or w != "gguf"]
    return [parse_config(f"{w}/{kv}") for w in weights for kv in kv_dtypes]


def check_supported(configs: Sequence[AccuracyConfig], gguf_model: bool) -> None:
    """Refuse, before anything runs, a KV-cache dtype this build's LLM does not take, and gguf weights for a model
    that is not a .gguf file."""
    unsupported = [c.name for c in configs if c.kv_cache_dtype != "auto"]
    if unsupported and not llm_accepts_kv_cache_dtype():
        raise ValueError(f"--config {', '.join(unsupported)}: this build's LLM has no kv_cache_dtype argument; "
                         f"only KV cache dtype 'auto' can be measured")
    gguf = [c.name for c in configs if c.quantization == "gguf"]
    if gguf and not gguf_model:
        raise ValueError(f"--config {', '.join(gguf)}: gguf weights need a .gguf model (--model); this one is not")


# ---- perplexity ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Window:
    """Tokens [start, end) of the text run as one prompt; those in [score_from, end) are scored, the earlier
    ones are context only."""

    start: int
    end: int
    score_from: int


def plan_windows(num_tokens: int, window: int, stride: int) -> list[Window]:
    """Windows of `window` tokens, `stride` apart, scoring every token once (see the module docstring). With
    stride == window a window's first token has no context and is not scored."""
    if not 0 < stride <= window:
        raise ValueError(f"stride must be in [1, window={window}], got {stride}")
    if num_tokens < 2:
        raise ValueError(f"the text needs at least 2 tokens to score one, got {num_tokens}")
    windows, scored_to = [], 1
    for start in range(0, num_tokens - 1, stride):
        end = min(start + window, num_tokens)
        windows.append(Window(start, end, max(scored_to, start + 1)))
        scored_to = end
        if end == num_tokens:
            break
    return windows


def num_scored_tokens(windows: Sequence[Window]) -> int:
    return sum(w.end - w.score_from for w in windows)


@dataclass(frozen=True)
class Perplexity:
    nll_sum: float          # natural log, summed over the scored tokens
    num_scored_tokens: int

    @property
    def value(self) -> float:
        return math.exp(self.nll_sum / self.num_scored_tokens)


def engine_perplexity(llm: LLM, token_ids: list[int], windows: Sequence[Window]) -> Perplexity:
    """Score the windows with the engine's prompt logprobs (one request per window, max_tokens=1)."""
    from pagedllm import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    outputs = llm.generate([token_ids[w.start:w.end] for w in windows], params, use_tqdm=len(windows) > 1)
    nll_sum = 0.0
    for w, output in zip(windows, outputs):
        assert output.prompt_logprobs is not None, "prompt_logprobs=0 gives every prompt token's logprob"
        for pos in range(w.score_from, w.end):
            entry = output.prompt_logprobs[pos - w.start]
            assert entry is not None     # only a window's first token has none, and it is never scored
            nll_sum -= entry[token_ids[pos]].logprob
    return Perplexity(nll_sum, num_scored_tokens(windows))


def hf_perplexity(model: PreTrainedModel, token_ids: list[int], windows: Sequence[Window]) -> Perplexity:
    """The same with a transformers model: log_softmax of its logits, one forward pass per window."""
    import torch

    nll_sum = 0.0
    with torch.inference_mode():
        for w in windows:
            ids = torch.tensor([token_ids[w.start:w.end]])
            logprobs = torch.log_softmax(model(ids).logits[0, :-1].double(), dim=-1)   # row i predicts token i+1
            picked = logprobs.gather(1, ids[0, 1:, None])[:, 0]                        # [window - 1]
            nll_sum -= picked[w.score_from - w.start - 1:].sum().item()
    return Perplexity(nll_sum, num_scored_tokens(windows))


# ---- greedy agreement ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Agreement:
    prefix_share: float     # tokens equal to the reference's before each request's first divergence, over all
    overall_share: float    # tokens equal to the reference's at the same position, over all
    num_tokens: int         # the reference's output tokens (a longer candidate's extra tokens count as unequal)
    num_identical_requests: int


def greedy_agreement(reference: Sequence[Sequence[int]], candidate: Sequence[Sequence[int]]) -> Agreement:
    """How far each candidate output follows the reference output of the same request."""
    if len(reference) != len(candidate):
        raise ValueError(f"{len(reference)} reference outputs against {len(candidate)} candidate outputs")
    num_tokens = num_prefix = num_equal = num_identical = 0
    for ref, got in zip(reference, candidate):
        equal = [a == b for a, b in zip(ref, got)]
        num_prefix += equal.index(False) if False in equal else len(equal)
        num_equal += sum(equal)
        num_tokens += max(len(ref), len(got))
        num_identical += list(ref) == list(got)
    if num_tokens == 0:
        raise ValueError("no output tokens to compare")
    return Agreement(num_prefix / num_tokens, num_equal / num_tokens, num_tokens, num_identical)


# ---- the command ---------------------------------------------------------------------------------------------------
def add_cli_args(parser: argparse.ArgumentParser) -> None:
    add_dataset_args(parser)
    add_engine_args(parser, quantization_flag=False)
    parser.add_argument("--config", dest="configs", type=parse_config, action="append", default=None,
                        help="a configuration to measure, WEIGHTS[/KV]: weights "
                             f"{'|'.join(WEIGHT_QUANTIZATIONS)}, KV cache {'|'.join(KV_CACHE_DTYPES)} (auto if "
                             "left out); repeat for more; none given: every combination this build takes. The "
                             "reference, none/auto, always runs")
    parser.add_argument("--text-path", default=str(TEXT_PATH), help="the text to score (UTF-8)")
    parser.add_argument("--num-text-tokens", type=int, default=None,
                        help="score only the text's first N tokens (None: all of it)")
    parser.add_argument("--window", type=int, default=1024, help="tokens per perplexity window")
    parser.add_argument("--stride", type=int, default=512, help="tokens between the starts of two windows")
    parser.add_argument("--max-tokens", type=int, default=64, help="greedy tokens per agreement request")
    parser.add_argument("--hf-check", action="store_true",
                        help="also compute transformers' perplexity of the unquantized float32 model (the oracle)")
    parser.add_argument("--output-json", default=None, help="write the results to this file")
    parser.set_defaults(func=main)


def main(args: argparse.Namespace) -> dict[str, Any]:
    from pagedllm.loader import resolve_dtype
    from pagedllm.loader.resolve import resolve_model

    resolved = resolve_model(args.model)
    # "none" is the checkpoint's weights in a dtype named outright: under "auto" a .gguf file would keep its blocks.
    args.dtype = str(resolve_dtype(args.dtype)).removeprefix("torch.")
    gguf_model = resolved.gguf_file is not None
    configs = list(dict.fromkeys([REFERENCE, *(args.configs or default_configs(gguf_model))]))
    check_supported(configs, gguf_model)
    if args.max_tokens < 1:
        raise ValueError(f"--max-tokens must be at least 1, got {args.max_tokens}")
    if args.num_text_tokens is not None and args.num_text_tokens < 2:
        raise ValueError(f"--num-text-tokens must be at least 2 (one token of context, one scored), got "
                         f"{args.num_text_tokens}")
    tokenizer = bench_tokenizer(args)
    text_bytes = Path(args.text_path).read_bytes()
    token_ids = tokenizer.encode(text_bytes.decode("utf-8"), add_special_tokens=False)[:args.num_text_tokens]
    windows = plan_windows(len(token_ids), args.window, args.stride)
    prompts = [r.prompt_token_ids for r in requests_from_args(tokenizer, args)]
    result: dict[str, Any] = {
        "model": resolved.name, "cpu": cpu_info().describe(),
        "text": {"path": args.text_path, "sha256": hashlib.sha256(text_bytes).hexdigest(),
                 "num_tokens": len(token_ids), "num_scored_tokens": num_scored_tokens(windows),
                 "num_windows": len(windows), "window": args.window, "stride": args.stride},
        "agreement_workload": {"dataset": args.dataset, "num_requests": len(prompts), "max_tokens": args.max_tokens,
                               "ignore_eos": True},
        "configs": [],
    }
    reference_outputs: list[list[int]] = []
    for config in configs:
        row, outputs = _measure(args, config, token_ids, windows, prompts)
        reference_outputs = reference_outputs or outputs
        result["configs"].append(row)
        row.update(asdict(greedy_agreement(reference_outputs, outputs)))
        row["perplexity_change_pct"] = 100 * (row["perplexity"] / result["configs"][0]["perplexity"] - 1)
    result["dtype"] = result["configs"][0]["dtype"]
    if args.hf_check:
        from pagedllm.bench.hf_baseline import load_hf_model

        model = load_hf_model(resolved, "float32")
        result["hf_float32_perplexity"] = hf_perplexity(model, token_ids, windows).value
    print_report(result)
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return result


def _measure(args: argparse.Namespace, config: AccuracyConfig, token_ids: list[int], windows: list[Window],
             prompts: list[list[int]]) -> tuple[dict[str, Any], list[list[int]]]:
    """One engine with `config`: its perplexity, and its greedy output tokens for each prompt."""
    from pagedllm import LLM, SamplingParams

    start = time.perf_counter()
    with LLM(**engine_kwargs(args, **config.llm_kwargs())) as llm:
        perplexity = engine_perplexity(llm, token_ids, windows)
        params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
        outputs = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=True)]
        dtype = str(llm.engine.dtype).removeprefix("torch.")
    del llm
    gc.collect()     # free this engine's weights and KV pool before the next one is built
    row = {"config": config.name, **asdict(config), "dtype": dtype, "perplexity": perplexity.value,
           "nll_sum": perplexity.nll_sum, "elapsed_s": time.perf_counter() - start}
    return row, outputs


def print_report(result: dict[str, Any]) -> None:
    """The run's description, then a markdown table, one row per configuration."""
    text = result["text"]
    print(f"CPU: {result['cpu']}")
    print(f"Model: {result['model']}, dtype {result['dtype']}")
    print(f"Text: {Path(text['path']).name} (sha256 {text['sha256'][:16]}...), {text['num_tokens']} tokens, "
          f"{text['num_scored_tokens']} scored in {text['num_windows']} windows of {text['window']} "
          f"(stride {text['stride']})")
    workload = result["agreement_workload"]
    print(f"Greedy agreement: {workload['num_requests']} {workload['dataset']} prompts, {workload['max_tokens']} "
          f"tokens each, against none/auto")
    print("| config (weights/KV) | perplexity | vs none/auto | agreement to first divergence | agreement overall "
          "| identical requests |")
    print("| --- | --- | --- | --- | --- | --- |")
    for row in result["configs"]:
        print(f"| {row['config']} | {row['perplexity']:.3f} | {row['perplexity_change_pct']:+.2f}% "
              f"| {100 * row['prefix_share']:.1f}% | {100 * row['overall_share']:.1f}% "
              f"| {row['num_identical_requests']} of {workload['num_requests']} |")
    if "hf_float32_perplexity" in result:
        print(f"transformers, unquantized float32, same windows: perplexity {result['hf_float32_perplexity']:.3f}")
