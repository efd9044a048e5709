"""The llama.cpp peer's side of `--compare llamacpp`, run by the peer environment's Python (it has
llama-cpp-python, not pagedllm).

It imports only the standard library and llama_cpp, so it runs as a file: `python llamacpp_child.py JOB.json
RESULT.json`. JOB.json holds the GGUF file, the context and batch sizes, the thread count, the prompts as token ids
with their output lengths, and a warm-up prompt. llama-cpp-python's `Llama` runs one sequence at a time, so the
requests run one after the other, each greedy with EOS ignored: exactly its output length in tokens, as on
pagedllm's side. A request reuses the KV of the longest prefix it shares with the one before (`Llama.generate`'s
own prefix reuse). RESULT.json gets the timings and token counts.
"""

from __future__ import annotations

import json
import sys
import time


def generate(llm, prompt_token_ids: list[int], max_tokens: int) -> list[int]:
    """`max_tokens` greedy tokens after the prompt, EOS or not (`Llama.generate` yields until the caller stops)."""
    tokens: list[int] = []
    for token in llm.generate(prompt_token_ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0,
                              reset=True):
        tokens.append(token)
        if len(tokens) == max_tokens:
            break
    return tokens


def main(job_path: str, result_path: str) -> None:
    with open(job_path, encoding="utf-8") as f:
        job = json.load(f)
    start = time.perf_counter()
    import llama_cpp

    llm = llama_cpp.Llama(model_path=job["model_path"], n_ctx=job["n_ctx"], n_batch=job["n_batch"],
                          n_ubatch=job["n_batch"], n_threads=job["n_threads"], n_threads_batch=job["n_threads"],
                          seed=job["seed"], verbose=False)
    startup_s = time.perf_counter() - start
    start = time.perf_counter()
    generate(llm, job["warmup_prompt_token_ids"], 1)
    first_token_s = time.perf_counter() - start

    start = time.perf_counter()
    outputs = [generate(llm, ids, n) for ids, n in zip(job["prompt_token_ids"], job["output_lens"])]
    elapsed = time.perf_counter() - start
    result = {"elapsed_time": elapsed, "startup_s": startup_s, "first_token_s": first_token_s,
              "num_output_tokens": sum(len(tokens) for tokens in outputs),
              "llama_cpp_version": llama_cpp.__version__}
    with open(result_path, "w", encoding="utf-8") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
