"""The peers' side of `pagedllm bench images`, run as a file by a peer's Python: `python images_child.py JOB.json
RESULT.json`. It imports only the standard library, PIL and the peer (vllm, or transformers for "hf"), so that it
runs in vLLM's environment, which has no pagedllm.

JOB.json holds the engine ("vllm" or "hf"), the model folder, the dtype, the prompt (its text, with one `<image>`),
the image files, the output length, the processor's arguments and, for vLLM, the engine sizes. Every request is
greedy to exactly the output length, as on pagedllm's side. RESULT.json gets the start-up time, the warm-up (one
request) and the timed run over every image.
"""

from __future__ import annotations

import json
import sys
import time


def main(job_path: str, result_path: str) -> None:
    with open(job_path, encoding="utf-8") as f:
        job = json.load(f)
    from PIL import Image

    images = [Image.open(path).convert("RGB") for path in job["image_paths"]]
    result = _vllm(job, images) if job["engine"] == "vllm" else _hf(job, images)
    with open(result_path, "w", encoding="utf-8") as f:
        json.dump(result, f)


def _vllm(job: dict, images: list) -> dict:
    start = time.perf_counter()
    from vllm import LLM, SamplingParams

    llm = LLM(model=job["model"], dtype=job["dtype"], max_model_len=job["max_model_len"],
              max_num_seqs=job["max_num_seqs"], max_num_batched_tokens=job["max_num_batched_tokens"],
              seed=job["seed"], limit_mm_per_prompt={"image": 1}, mm_processor_kwargs=job["mm_processor_kwargs"])
    startup_s = time.perf_counter() - start
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=job["output_len"])
    prompts = [{"prompt": job["prompt"], "multi_modal_data": {"image": image}} for image in images]
    start = time.perf_counter()
    llm.generate(prompts[:1], params, use_tqdm=False)
    first_s = time.perf_counter() - start
    start = time.perf_counter()
    outputs = llm.generate(prompts[1:], params, use_tqdm=False)
    return {"startup_s": startup_s, "first_request_s": first_s, "elapsed_time": time.perf_counter() - start,
            "num_output_tokens": sum(len(o.outputs[0].token_ids) for o in outputs),
            "num_prompt_tokens": sum(len(o.prompt_token_ids) for o in outputs),
            "version": sys.modules["vllm"].__version__}


def _hf(job: dict, images: list) -> dict:
    """transformers' generate, the timed images in batches of `hf_batch_size` (every prompt is as long, so no
    padding)."""
    start = time.perf_counter()
    import torch
    import transformers

    model = transformers.AutoModelForImageTextToText.from_pretrained(job["model"],
                                                                     dtype=getattr(torch, job["dtype"])).eval()
    grids = model.config.model_type in ("qwen2_vl", "qwen2_5_vl")
    processor = (_QwenInputs(job["model"], model.config.image_token_id) if grids else
                 transformers.AutoProcessor.from_pretrained(job["model"]))
    startup_s = time.perf_counter() - start

    def run(batch: list) -> tuple[int, int]:
        inputs = processor(text=[job["prompt"]] * len(batch), images=[[image] for image in batch],
                           return_tensors="pt", **job["mm_processor_kwargs"])
        with torch.inference_mode():
            out = model.generate(**inputs, max_new_tokens=job["output_len"], min_new_tokens=job["output_len"],
                                 do_sample=False)
        return (out.shape[1] - inputs["input_ids"].shape[1]) * len(batch), inputs["input_ids"].numel()

    start = time.perf_counter()
    run(images[:1])
    first_s = time.perf_counter() - start
    size, timed = job["hf_batch_size"], images[1:]
    start = time.perf_counter()
    counts = [run(timed[i:i + size]) for i in range(0, len(timed), size)]
    return {"startup_s": startup_s, "first_request_s": first_s, "elapsed_time": time.perf_counter() - start,
            "num_output_tokens": sum(c[0] for c in counts), "num_prompt_tokens": sum(c[1] for c in counts),
            "version": transformers.__version__}


class _QwenInputs:
    """Qwen2-VL's and Qwen2.5-VL's processor, which transformers builds only with torchvision (not installed): their
    image processor and tokenizer, each `<|image_pad|>` expanded into one per 2 x 2 square of the image's patches."""

    def __init__(self, model: str, image_token_id: int) -> None:
        import transformers

        self.images = transformers.AutoImageProcessor.from_pretrained(model)
        self.tokenizer = transformers.AutoTokenizer.from_pretrained(model)
        self.image_token_id = image_token_id

    def __call__(self, text: list, images: list, return_tensors: str, **kwargs: object) -> dict:
        pixels = dict(self.images(images=[image for group in images for image in group], return_tensors=return_tensors,
                                  **kwargs))
        counts = iter([int(grid.prod()) // self.images.merge_size ** 2 for grid in pixels["image_grid_thw"]])
        expanded = ["".join(piece if i == 0 else "<|image_pad|>" * next(counts) + piece
                            for i, piece in enumerate(prompt.split("<|image_pad|>"))) for prompt in text]
        ids = self.tokenizer(expanded, return_tensors=return_tensors)["input_ids"]
        return pixels | {"input_ids": ids, "mm_token_type_ids": (ids == self.image_token_id).int()}


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
