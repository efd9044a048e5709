import torch

from pagedllm.core.sched.output import ScheduledRequest
from pagedllm.runner.input_batch import build_model_inputs


def _sched(request_id, block_ids, num_computed, token_ids, sample):
    return ScheduledRequest(request_id=request_id, block_ids=block_ids, num_computed_tokens=num_computed,
                            token_ids=token_ids, sample=sample)


def test_flat_batch_positions_slots_and_sampled_rows():
    # A: a prefill chunk at positions 2..4 crossing from block 7 into block 3 (block_size 4);
    # B: one decode token at position 9 in its third block; C: a fresh prompt that is not finished (no sample).
    scheduled = [
        _sched("A", [7, 3], 2, [10, 11, 12], True),
        _sched("B", [1, 2, 5], 9, [20], True),
        _sched("C", [4], 0, [30, 31], False),
    ]
    inputs = build_model_inputs(scheduled, block_size=4, device=torch.device("cpu"))
    # The decode (B) moves to the front; the others keep their order.
    assert inputs.input_ids.tolist() == [20, 10, 11, 12, 30, 31]
    assert inputs.positions.tolist() == [9, 2, 3, 4, 0, 1]
    assert inputs.meta.slot_mapping.tolist() == [5 * 4 + 1, 7 * 4 + 2, 7 * 4 + 3, 3 * 4 + 0, 4 * 4, 4 * 4 + 1]
    assert inputs.meta.query_start_loc.tolist() == [0, 1, 4, 6]
    assert inputs.meta.seq_lens.tolist() == [10, 5, 2]
    assert inputs.meta.block_tables.tolist() == [[1, 2, 5], [7, 3, 0], [4, 0, 0]]
    assert (inputs.meta.max_query_len, inputs.meta.max_seq_len, inputs.meta.num_decodes) == (3, 10, 1)
    assert inputs.logits_indices.tolist() == [0, 3]
    assert inputs.sample_request_ids == ["B", "A"]
