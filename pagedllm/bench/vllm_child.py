"""The vLLM peer's side of `--compare vllm`, run by the peer environment's Python (it has vllm, not pagedllm).

It imports only the standard library and vllm, so it runs as a file: `python vllm_child.py JOB.json RESULT.json`.
JOB.json holds the model folder, the dtype, the engine sizes (and an n-gram speculative config, if any), the
prompts as token ids with their output lengths and sampling parameters, an optional warm-up prompt (the prefix
bench's system prompt), an optional LoRA adapter every request runs with, and the task: "generate", "embed" (vLLM's
pooling runner, the model converted to embed unless it is an encoder) or "score" (the pooling runner on a
cross-encoder, scoring the job's text pairs, as `LLM.score` takes only text).
RESULT.json gets the timings and token counts (and, to embed or score, the first prompts' vectors or scores, to check
both sides agree; speculating, vLLM's acceptance, read from its metrics, which its statistics keep).
Every request has ignore_eos and the bench's sampling parameters (greedy unless it was given some), as on pagedllm's
side, so both generate exactly the same number of tokens the same way; or, with a JSON schema in the job, every
request is constrained by it and ends where its JSON does (its text and finish reason come back, to validate).
"""

from __future__ import annotations

import json
import statistics
import sys
import time


def main(job_path: str, result_path: str) -> None:
    with open(job_path, encoding="utf-8") as f:
        job = json.load(f)
    start = time.perf_counter()
    from vllm import LLM, SamplingParams

    with_lora, lora = {}, {}      # the engine's LoRA options and each request's adapter, if any
    if job.get("lora_path"):     # every request through one adapter (vLLM's benchmark --lora-path)
        from vllm.lora.request import LoRARequest

        with_lora = {"enable_lora": True, "max_loras": 1, "max_lora_rank": job["max_lora_rank"]}
        lora = {"lora_request": LoRARequest("bench", 1, job["lora_path"])}
    task = job.get("task", "generate")
    pooling = {"runner": "pooling", "convert": job["convert"]} if task != "generate" else {}
    speculative = {"speculative_config": job["speculative_config"]} if job.get("speculative_config") else {}
    if speculative:     # LLM.get_metrics() has the acceptance counters only where the statistics are kept
        speculative["disable_log_stats"] = False
    llm = LLM(model=job["model"], dtype=job["dtype"], max_model_len=job["max_model_len"],
              max_num_seqs=job["max_num_seqs"], max_num_batched_tokens=job["max_num_batched_tokens"],
              enable_prefix_caching=job["enable_prefix_caching"], seed=job["seed"], **with_lora, **pooling,
              **speculative)
    startup_s = time.perf_counter() - start
    prompts = [{"prompt_token_ids": ids} for ids in job["prompt_token_ids"]]
    result = _generate(llm, job, prompts, lora, SamplingParams) if task == "generate" else _pool(llm, job, prompts)
    if speculative:
        result["spec_decoding"] = _acceptance(llm)
    result.update(startup_s=startup_s, vllm_version=sys.modules["vllm"].__version__)
    with open(result_path, "w", encoding="utf-8") as f:
        json.dump(result, f)


def _generate(llm, job: dict, prompts: list[dict], lora: dict, sampling_params) -> dict:
    """Time one greedy warm-up request (constrained, where the job has a schema, so that it compiles), then every
    prompt to its output length with the job's sampling parameters (or to its JSON's end); the job's `repeat` times,
    the prefix cache emptied and the warm-up served again before each run but the first (pagedllm's side:
    `pagedllm.bench.args.run_repeated`): the median run's seconds (the slower middle one of an even number) and
    each run's."""
    constraint = {}
    if job.get("json_schema") is not None:
        from vllm.sampling_params import StructuredOutputsParams

        constraint = {"structured_outputs": StructuredOutputsParams(json=job["json_schema"])}

    def warmup() -> None:
        llm.generate([{"prompt_token_ids": job["warmup_prompt_token_ids"]}],
                     sampling_params(temperature=0, max_tokens=1, **constraint), use_tqdm=False, **lora)

    start = time.perf_counter()
    warmup()
    first_token_s = time.perf_counter() - start
    params = [sampling_params(ignore_eos=not constraint, max_tokens=n, **job["sampling"], **constraint)
              for n in job["output_lens"]]
    seconds = []
    for run in range(job.get("repeat", 1)):
        if run:
            if not llm.reset_prefix_cache():
                raise RuntimeError("vLLM's prefix cache could not be emptied between runs")
            warmup()
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False, **lora)
        seconds.append(time.perf_counter() - start)
    result = {"elapsed_time": statistics.median_high(seconds), "elapsed_times": seconds,
              "first_token_s": first_token_s,
              "num_output_tokens": sum(len(o.outputs[0].token_ids) for o in outputs),
              "prefix_cache_hit_tokens": sum(o.num_cached_tokens or 0 for o in outputs)}
    if constraint:
        result.update(texts=[o.outputs[0].text for o in outputs],
                      finish_reasons=[o.outputs[0].finish_reason for o in outputs])
    return result


def _acceptance(llm) -> dict:
    """vLLM's speculation counters since start-up (the warm-ups and every run, as pagedllm's side counts its own),
    and the acceptance rate and mean accepted length, as pagedllm.metrics.stats.SpecDecodingStats computes them (this
    file cannot import pagedllm)."""
    totals = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0}
    for metric in llm.get_metrics():
        name = metric.name.removeprefix("vllm:spec_decode_")
        if name in totals:      # one series per engine: summed
            totals[name] += metric.value
    drafts, proposed, accepted = totals["num_drafts"], totals["num_draft_tokens"], totals["num_accepted_tokens"]
    return {**totals, "acceptance_rate": accepted / proposed if proposed else 0.0,
            "mean_acceptance_length": 1.0 + accepted / drafts if drafts else 0.0}


def _pool(llm, job: dict, prompts: list[dict]) -> dict:
    """Time one warm-up, then embedding every prompt (task "embed") or scoring every text pair (task "score");
    the first vectors (or scores, one each) come back."""
    if job["task"] == "embed":
        def run(batch: list) -> list:
            return [list(o.outputs.embedding) for o in llm.embed(batch, use_tqdm=False)]
        warmup, timed = [{"prompt_token_ids": job["warmup_prompt_token_ids"]}], prompts
    else:
        def run(batch: list) -> list:
            firsts, seconds = zip(*batch)
            return [[o.outputs.score] for o in llm.score(list(firsts), list(seconds), use_tqdm=False)]
        warmup, timed = job["text_pairs"][:1], job["text_pairs"]
    start = time.perf_counter()
    run(warmup)
    first_token_s = time.perf_counter() - start
    start = time.perf_counter()
    vectors = run(timed)
    return {"elapsed_time": time.perf_counter() - start, "first_token_s": first_token_s,
            "vectors": vectors[:job["num_vectors_back"]]}

if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
