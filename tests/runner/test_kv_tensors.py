import os
import tempfile

import pytest
import torch

from pagedllm.runner import kv_tensors

LAYOUT = kv_tensors.KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16)


def test_bytes_per_token_counts_k_and_v_of_every_layer():
    assert LAYOUT.bytes_per_token == 2 * 3 * 2 * 8 * 2


def test_pool_is_sized_from_the_budget_and_zeroed():
    num_blocks = kv_tensors.num_blocks_for(10 * LAYOUT.bytes_per_token * 16 + 5, LAYOUT.bytes_per_token, block_size=16)
    assert num_blocks == 10
    kv = kv_tensors.allocate_kv(LAYOUT, num_blocks, 16, torch.device("cpu"))
    assert kv.shape == (3, 2, 10, 16, 2, 8) and kv.dtype == torch.bfloat16
    assert not kv.any()
    k_cache, v_cache = kv_tensors.layer_caches(kv)[1]
    assert k_cache.data_ptr() == kv[1, 0].data_ptr() and v_cache.shape == (10, 16, 2, 8)


def test_a_cpu_pool_keeps_a_kv_heads_rows_of_a_block_together(disk_tmp_path):
    """Each block is stored head-major (`pool_view`), the pool's and the swap file's alike, under the logical shape
    [layers, 2, blocks, block_size, kv_heads, row]: attention reads a block's rows of one kv head as one run."""
    pool = kv_tensors.allocate_kv(LAYOUT, 10, 16, torch.device("cpu"))
    swap = kv_tensors.SwapSpace(LAYOUT, 4, 16, torch.device("cpu"), str(disk_tmp_path / "swap"))
    try:
        for kv in (pool, swap.kv):
            k_cache = kv_tensors.layer_caches(kv)[2][0]
            assert k_cache.stride() == (2 * 16 * 8, 8, 16 * 8, 1)   # token t of kv head h at h * 16 * 8 + t * 8
            assert k_cache[3, :, 1].is_contiguous()
        offset = (pool[2, 1, 5, 7, 1].data_ptr() - pool.data_ptr()) // pool.element_size()
        assert offset == ((2 * 2 + 1) * 10 + 5) * 16 * 2 * 8 + (1 * 16 + 7) * 8   # layer 2's V, block 5, head 1
    finally:
        swap.close()


def _vm_flags(address: int) -> list[str]:
    """The VmFlags of this process's mapping that holds `address` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            fields = line.split()
            if "-" in fields[0] and len(fields) >= 5:
                low, high = (int(bound, 16) for bound in fields[0].split("-"))
                inside = low <= address < high
            elif inside and fields[0] == "VmFlags:":
                return fields[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="reads Linux's /proc/self/smaps")
def test_the_pool_is_not_advised_for_huge_pages():
    """numpy.zeros would advise the pool's aligned middle for transparent huge pages ("hg"), whose first touches
    stall in compaction (kv_tensors.allocate_kv); a 64 MiB pool must have no such part."""
    layout = kv_tensors.KVLayout(num_layers=2, num_kv_heads=4, head_dim=64, dtype=torch.bfloat16)
    num_blocks = (64 << 20) // (layout.bytes_per_token * 16)
    kv = kv_tensors.allocate_kv(layout, num_blocks, 16, torch.device("cpu"))
    for offset in range(0, kv.numel() * kv.element_size(), 4 << 20):
        assert "hg" not in _vm_flags(kv.data_ptr() + offset), offset
    kv[1, 1, -1].fill_(1.0)       # writable, and zero elsewhere
    assert kv.sum().item() == kv[1, 1, -1].numel()


def test_a_budget_under_two_blocks_is_a_clear_error():
    with pytest.raises(ValueError, match="fewer than 2 blocks"):
        kv_tensors.num_blocks_for(LAYOUT.bytes_per_token * 16, LAYOUT.bytes_per_token, block_size=16)


def test_copy_blocks_copies_every_layer_bit_for_bit():
    kv = torch.randn(3, 2, 6, 4, 2, 8).to(torch.bfloat16)
    before = kv.clone()
    kv_tensors.copy_blocks(kv, [(1, 4), (2, 5)])
    assert torch.equal(kv[:, :, 4], before[:, :, 1]) and torch.equal(kv[:, :, 5], before[:, :, 2])
    assert torch.equal(kv[:, :, :4], before[:, :, :4])


def test_capacity_report_states_blocks_bytes_and_concurrency():
    report = kv_tensors.CapacityReport(num_blocks=129, block_size=16, bytes_per_token=100, max_model_len=512)
    assert report.max_concurrent_seqs == 4.0
    assert "129 blocks" in str(report) and "100 bytes per token" in str(report) and "4.0x" in str(report)
    # with a sliding window a sequence holds at most the 5 blocks that 64 keys span
    windowed = kv_tensors.CapacityReport(num_blocks=129, block_size=16, bytes_per_token=100, max_model_len=512,
                                         window=64)
    assert windowed.max_concurrent_seqs == 25.6 and "64-token sliding window" in str(windowed)


def test_swap_space_on_a_cpu_is_a_memory_mapped_file_deleted_on_close(disk_tmp_path):
    path = disk_tmp_path / "swap.bin"
    swap = kv_tensors.SwapSpace(LAYOUT, num_blocks=5, block_size=4, device=torch.device("cpu"), path=str(path))
    assert swap.is_memory_mapped and swap.kv.shape == (3, 2, 5, 4, 2, 8) and swap.kv.dtype == torch.bfloat16
    assert path.stat().st_size == 5 * 4 * LAYOUT.bytes_per_token and not swap.kv.any()
    swap.close()
    assert not path.exists()
    anonymous = kv_tensors.SwapSpace(LAYOUT, num_blocks=5, block_size=4, device=torch.device("cpu"))
    assert anonymous.is_memory_mapped
    anonymous.close()


def test_swap_out_and_in_round_trip_bit_for_bit():
    kv = torch.randn(3, 2, 6, 4, 2, 8).to(torch.bfloat16)
    before = kv.clone()
    swap = kv_tensors.SwapSpace(LAYOUT, num_blocks=5, block_size=4, device=torch.device("cpu"))
    kv_tensors.swap_blocks(kv, swap.kv, [(1, 3), (4, 1)])
    kv[:, :, 1] = 0
    kv_tensors.swap_blocks(swap.kv, kv, [(3, 5), (1, 2)])
    assert torch.equal(kv[:, :, 5], before[:, :, 1]) and torch.equal(kv[:, :, 2], before[:, :, 4])
    swap.close()


def _tmpfs_dir() -> str:
    if not kv_tensors.is_ram_backed("/dev/shm"):
        pytest.skip("no tmpfs at /dev/shm on this machine")
    return "/dev/shm"


def test_the_filesystem_type_comes_from_the_deepest_mount():
    assert kv_tensors.filesystem_type(f"{_tmpfs_dir()}/not/yet/there") == "tmpfs"
    assert kv_tensors.filesystem_type("/proc/self") == "proc"


def test_a_swap_file_on_tmpfs_is_refused_with_a_clear_message():
    path = f"{_tmpfs_dir()}/pagedllm-test-swap.bin"
    with pytest.raises(ValueError, match="RAM-backed filesystem.*no capacity"):
        kv_tensors.SwapSpace(LAYOUT, num_blocks=5, block_size=4, device=torch.device("cpu"), path=path)
    assert not os.path.exists(path)


def test_the_anonymous_swap_file_leaves_a_ram_backed_tmpdir_for_the_cache_dir(disk_tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", _tmpfs_dir())
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(disk_tmp_path / "cache"))
    swap = kv_tensors.SwapSpace(LAYOUT, num_blocks=5, block_size=4, device=torch.device("cpu"))
    assert swap.location == f"an anonymous file in {disk_tmp_path / 'cache'}"
    swap.close()
    monkeypatch.setattr(tempfile, "tempdir", str(disk_tmp_path))
    swap = kv_tensors.SwapSpace(LAYOUT, num_blocks=5, block_size=4, device=torch.device("cpu"))
    assert swap.location == f"an anonymous file in {disk_tmp_path}"
    swap.close()


# ---- kv_cache_dtype="int8" -------------------------------------------------------------------------------------
INT8_LAYOUT = kv_tensors.KVLayout(num_layers=3, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16, kv_cache_dtype="int8")


@pytest.mark.parametrize(("dtype", "ratio"), [(torch.float32, 4 * 64 / 68), (torch.bfloat16, 2 * 64 / 68)])
def test_an_int8_row_is_head_dim_bytes_and_a_float32_scale(dtype, ratio):
    assert INT8_LAYOUT.bytes_per_token == 2 * 3 * 2 * (8 + 4)
    plain = kv_tensors.KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, dtype=dtype)  # SmolLM2-135M's shape
    int8 = kv_tensors.KVLayout(num_layers=30, num_kv_heads=3, head_dim=64, dtype=dtype, kv_cache_dtype="int8")
    assert int8.bytes_per_token == 2 * 30 * 3 * 68
    assert plain.bytes_per_token / int8.bytes_per_token == pytest.approx(ratio)  # 3.76x float32, 1.88x bf16
    budget = 1 << 30
    assert kv_tensors.num_blocks_for(budget, int8.bytes_per_token, 16) == budget // (16 * 2 * 30 * 3 * 68)


def test_an_int8_head_dim_must_keep_the_scales_aligned():
    with pytest.raises(ValueError, match="kv_cache_dtype 'int8' needs a head_dim that is a multiple of 4"):
        kv_tensors.KVLayout(num_layers=1, num_kv_heads=1, head_dim=6, dtype=torch.float32, kv_cache_dtype="int8")


def test_int8_blocks_move_with_their_scales_through_copy_and_swap():
    """The scales sit in each row's last 4 bytes, so a block copy or a swap round trip moves them too."""
    from pagedllm.attention.torch_ref import dequantize_kv, quantize_kv

    kv = kv_tensors.allocate_kv(INT8_LAYOUT, 6, 4, torch.device("cpu"))
    assert kv.shape == (3, 2, 6, 4, 2, 12) and kv.dtype == torch.int8
    values = torch.randn(3, 2, 6, 4, 2, 8) * torch.arange(1.0, 7.0)[:, None, None, None]  # a scale per block
    kv.copy_(quantize_kv(values))
    before = dequantize_kv(kv)
    kv_tensors.copy_blocks(kv, [(1, 4)])
    assert torch.equal(dequantize_kv(kv[:, :, 4]), before[:, :, 1])
    swap = kv_tensors.SwapSpace(INT8_LAYOUT, num_blocks=5, block_size=4, device=torch.device("cpu"))
    assert swap.kv.shape == kv.shape[:2] + (5,) + kv.shape[3:] and swap.kv.dtype == torch.int8
    kv_tensors.swap_blocks(kv, swap.kv, [(2, 3)])
    kv_tensors.swap_blocks(swap.kv, kv, [(3, 5)])
    assert torch.equal(dequantize_kv(kv[:, :, 5]), before[:, :, 2])
    swap.close()


def test_the_gpu_pool_is_the_engines_share_less_weights_and_activation_peak() -> None:
    GiB = kv_tensors.GiB
    # 0.9 x 80 GiB = 72 GiB, less 16 GiB of weights and a 2 GiB activation peak
    assert kv_tensors.gpu_kv_budget_bytes(80 * GiB, 64 * GiB, None, 16 * GiB, 2 * GiB) == 54 * GiB
    assert kv_tensors.gpu_kv_budget_bytes(80 * GiB, 64 * GiB, 0.5, 16 * GiB, 2 * GiB) == 22 * GiB
    # another process holds 30 GiB: only what is free now, less the peak
    assert kv_tensors.gpu_kv_budget_bytes(80 * GiB, 34 * GiB, None, 16 * GiB, 2 * GiB) == 32 * GiB
