"""`pagedllm plan` agrees with what the engine allocates, reads no weights, and compares MHA/GQA/MQA."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from pagedllm import LLM
from pagedllm.entrypoints.cli import main
from pagedllm.memory.plan import make_plan
from tests.models.tiny import save_tiny_model

BUDGET = 1 << 20


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "m", "llama-gqa")[0]


@pytest.mark.parametrize("block_size", [4, 16])
def test_plan_matches_the_engines_pool(folder: Path, block_size: int) -> None:
    engine = LLM(model=str(folder), dtype="float32", block_size=block_size, kv_cache_memory=BUDGET,
                 max_model_len=64).engine
    plan = make_plan(str(folder), BUDGET, block_size, max_model_len=64, dtype="float32")
    assert plan.capacity == engine.capacity
    assert plan.capacity.bytes_per_token == engine.runner.layout.bytes_per_token


def test_plan_reads_the_config_not_the_weights(folder: Path, tmp_path: Path) -> None:
    config_only = tmp_path / "config-only"
    shutil.copytree(folder, config_only, ignore=shutil.ignore_patterns("*.safetensors*"))
    without_weights = make_plan(str(config_only), BUDGET, dtype="float32")
    assert without_weights.capacity == make_plan(str(folder), BUDGET, dtype="float32").capacity


def test_variants_and_sequence_counts_by_hand(folder: Path) -> None:
    # 2 layers, 4 query heads, 2 KV heads, head_dim 16, float32: 2 x 2 x 2 x 16 x 4 = 512 bytes per token.
    plan = make_plan(str(folder), 512 * 4 * 100, block_size=4, context_len=10, max_model_len=64, dtype="float32")
    assert (plan.num_heads, plan.num_kv_heads, plan.head_dim, plan.context_len) == (4, 2, 16, 10)
    rows = {v.name: (v.num_kv_heads, v.bytes_per_token, v.num_blocks, v.paged_seqs, v.contiguous_seqs)
            for v in plan.variants}
    # GQA: 100 blocks, 99 usable (396 slots); a 10-token sequence takes 3 blocks -> 33; 396 // 64 = 6 reserved.
    assert rows == {"MHA": (4, 1024, 50, 16, 3), "GQA": (2, 512, 100, 33, 6), "MQA": (1, 256, 200, 66, 12)}
    assert plan.capacity.num_blocks == 100 and plan.capacity.bytes_per_token == 512


def test_an_mha_model_has_no_gqa_row(tmp_path: Path) -> None:
    folder = save_tiny_model(tmp_path / "mha", "llama-mha", with_tokenizer=False)[0]
    plan = make_plan(str(folder), BUDGET, dtype="float32")
    assert [v.name for v in plan.variants] == ["MHA", "MQA"]


def test_plan_command_prints_json_and_a_table(folder: Path, capsys: pytest.CaptureFixture[str]) -> None:
    main(["plan", str(folder), "--kv-cache-memory", "200KiB", "--block-size", "4", "--dtype", "float32", "--json"])
    report = json.loads(capsys.readouterr().out)
    assert report["capacity"]["num_blocks"] == 100 and report["budget_bytes"] == 200 * 1024
    main(["plan", str(folder), "--kv-cache-memory", "200KiB", "--block-size", "4", "--dtype", "float32"])
    out = capsys.readouterr().out
    assert "KV bytes per token: 2 x 2 layers x 2 KV heads x 16 x 4 bytes = 512" in out and "GQA *" in out
    main(["plan", str(folder), "--kv-cache-memory", "200KiB", "--block-size", "4", "--dtype", "float32",
          "--kv-cache-dtype", "int8"])
    out = capsys.readouterr().out
    assert "KV bytes per token: 2 x 2 layers x 2 KV heads x (16 int8 + a 4-byte scale) = 160" in out
    assert "-> KV cache: 320 blocks of 4 tokens" in out  # 200 KiB // (4 x 160 bytes)


@pytest.mark.parametrize(("argv", "message"), [
    (["--context-len", "999"], "context_len must be in"),
    (["--kv-cache-memory", "1KiB"], "fewer than 2 blocks"),
    (["--max-model-len", "100000"], "larger than the model's context length"),
])
def test_plan_bad_input_is_a_clear_error(folder: Path, argv: list[str], message: str) -> None:
    with pytest.raises(SystemExit, match=message):
        main(["plan", str(folder), "--dtype", "float32", *argv])


def test_plan_of_a_missing_model_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="GGUF file not found"):
        main(["plan", str(tmp_path / "nope.gguf")])
