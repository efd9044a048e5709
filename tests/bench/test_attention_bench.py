"""`pagedllm bench attention`: every layer's decode attention timed at each point of the grid, over block tables
that hold each sequence's own blocks of the pool (an int8 pool's rows with their scales), and the rate it reports
is the K/V bytes read over that time."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig

from pagedllm.attention import cpu as attention_cpu
from pagedllm.bench.cli import main


@pytest.mark.parametrize("scatter,kv_cache_dtype", [(False, "auto"), (True, "auto"), (False, "int8")])
def test_each_point_times_every_layer_over_its_own_blocks(tiny_model_dir, monkeypatch, scatter, kv_cache_dtype):
    calls = []
    real = attention_cpu.decode_attention

    def counted(query, k_cache, v_cache, block_tables, seq_lens, scale, window=0):
        calls.append((query.shape[0], block_tables.clone(), seq_lens.clone(), k_cache))
        return real(query, k_cache, v_cache, block_tables, seq_lens, scale, window)

    monkeypatch.setattr(attention_cpu, "decode_attention", counted)
    result = main(["attention", "--model", tiny_model_dir, "--dtype", "float32", "--num-seqs", "1", "3",
                   "--context-len", "20", "--pool-gib", "0.001", "--repeats", "2", "--kv-cache-dtype", kv_cache_dtype]
                  + (["--scatter"] if scatter else []))
    layers, repeats = result["layers"], 2
    if kv_cache_dtype == "int8":      # each int8 row the kernel reads carries its float32 scale after its values
        _, block_tables, _, k_cache = calls[-1]
        rows = k_cache[block_tables.flatten().long()]
        assert (rows[..., -4:].contiguous().view(torch.float32) == 0.01).all() and rows[..., :-4].any()
    assert [(row["num_seqs"], row["context_len"]) for row in result["steps"]] == [(1, 20), (3, 20)]
    assert [c[0] for c in calls] == [1] * layers * (1 + repeats) + [3] * layers * (1 + repeats)
    for num_seqs, block_tables, seq_lens, k_cache in calls:
        num_blocks = k_cache.shape[0]
        assert block_tables.shape == (num_seqs, 3) and seq_lens.tolist() == [20] * num_seqs   # 20 tokens in 8s
        ids = block_tables.flatten().tolist()
        assert len(set(ids)) == len(ids) and all(0 <= i < num_blocks for i in ids)
        if not scatter:
            assert ids == list(range(len(ids)))
    for row in result["steps"]:
        read = row["num_seqs"] * row["context_len"] * result["kv_bytes_per_token"]
        assert row["gb_per_s"] == pytest.approx(read / (row["ms_per_step"] / 1e3) / 1e9)


def test_a_latent_attention_model_is_timed_over_its_pools_rows(tmp_path):
    """DeepSeek's pool holds one row a token a layer (latent + rotary key: 32 + 8 values), which every query head
    reads (the engine's `model_shape`), not rows of its config's head_dim (the rope's 8) for each head."""
    from tests.models.tiny import save_tiny_model

    folder, _ = save_tiny_model(tmp_path / "m", "deepseek-v2", with_tokenizer=False)
    result = main(["attention", "--model", str(folder), "--dtype", "float32", "--num-seqs", "2", "--context-len", "9",
                   "--pool-gib", "0.001", "--repeats", "1"])
    assert result["kv_bytes_per_token"] == 2 * result["layers"] * 1 * 40 * 4


def test_a_shared_prefix_step_runs_paged_attention_over_the_prefixs_blocks(tiny_model_dir, monkeypatch):
    """--shared-prefix: every table starts with the same blocks, then the sequence's own; each layer's call gets
    the last --query-len tokens of every sequence as its queries, as a cascade (16 sequences over 4 chunks of the
    prefix: the kernels' threshold), and the rate counts the keys each query sees."""
    calls = []
    real = attention_cpu.paged_attention

    def counted(query, k_cache, v_cache, meta, scale, *args, **kwargs):
        calls.append((query.shape[0], meta))
        return real(query, k_cache, v_cache, meta, scale, *args, **kwargs)

    monkeypatch.setattr(attention_cpu, "paged_attention", counted)
    result = main(["attention", "--model", tiny_model_dir, "--dtype", "float32", "--num-seqs", "16",
                   "--context-len", "20", "--shared-prefix", "256", "--query-len", "5", "--block-size", "8",
                   "--pool-gib", "0.001", "--repeats", "2"])
    layers = result["layers"]
    assert len(calls) == layers * 3 and {rows for rows, _ in calls} == {16 * 5}
    _, meta = calls[-1]
    tables = meta.block_tables.tolist()
    assert [t[:32] for t in tables] == [tables[0][:32]] * 16                    # the prefix's 32 blocks, shared
    own = [b for t in tables for b in t[32:]]
    assert len(set(own)) == 16 * 3 and not set(own) & set(tables[0][:32])      # 20 own tokens: 3 blocks each
    assert meta.seq_lens.tolist() == [276] * 16 and meta.query_start_loc.tolist() == list(range(0, 81, 5))
    (row,) = result["steps"]
    assert row["cascade_prefix"] == 256
    keys_seen = 16 * sum(276 - 5 + j + 1 for j in range(5))
    config = AutoConfig.from_pretrained(tiny_model_dir)
    head_dim = config.hidden_size // config.num_attention_heads
    flops = 4 * keys_seen * config.num_attention_heads * head_dim * layers
    assert row["gflop_per_s"] == pytest.approx(flops / (row["ms_per_step"] / 1e3) / 1e9)


@pytest.mark.parametrize("flags", [["--shared-prefix", "12"], ["--shared-prefix", "16", "--query-len", "21"]])
def test_a_shared_prefix_of_part_of_a_block_or_more_queries_than_tokens_is_refused(tiny_model_dir, flags):
    with pytest.raises(SystemExit, match="--shared-prefix must be whole blocks|--query-len must be"):
        main(["attention", "--model", tiny_model_dir, "--dtype", "float32", "--num-seqs", "2", "--context-len", "20",
              "--block-size", "8", "--pool-gib", "0.001", "--repeats", "1"] + flags)
