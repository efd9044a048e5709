"""`pagedllm simulate`: each policy's figures on hand-computed traces, and the orderings on the shipped ones."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from pagedllm.memory.simulate import SimConfig, simulate
from pagedllm.memory.traces import TraceRequest, load_trace
from pagedllm.metrics.stats import SchedulerStats

# Two requests at t=0, prompt 3 and output 2 each. Step 1 prefills both (3 tokens computed each) and samples
# their first tokens; step 2 computes the 4th token and samples the last, and both finish. So the only step
# with running requests after it holds 2 x 3 = 6 computed tokens.
TWO = [TraceRequest(0.0, 3, 2), TraceRequest(0.0, 3, 2)]
SMALL = SimConfig(num_slots=32, max_model_len=16)


@pytest.mark.parametrize(("policy", "slots_per_request"), [
    ("max", 16),      # max_model_len
    ("pow2", 8),      # the final length 5, rounded up to a power of two
    ("oracle", 5),    # the final length
    ("paged-4", 4),   # 3 computed tokens in one block of 4
    ("paged-1", 3),
])
def test_token_state_share_on_a_hand_computed_trace(policy: str, slots_per_request: int) -> None:
    result = simulate(TWO, policy, SMALL)
    assert result.num_steps == 2 and result.max_batch == 2 and result.num_preemptions == 0
    assert result.token_state_pct == pytest.approx(100 * 6 / (2 * slots_per_request))


def test_reservations_admit_fcfs_while_their_slots_remain() -> None:
    trace = [TraceRequest(0.0, 3, 2)] * 3
    assert simulate(trace, "max", SimConfig(num_slots=32, max_model_len=16)).max_batch == 2
    assert simulate(trace, "max", SimConfig(num_slots=31, max_model_len=16)).max_batch == 1
    assert simulate(trace, "oracle", SimConfig(num_slots=16, max_model_len=16)).max_batch == 3


def test_arrivals_wait_for_the_clock() -> None:
    trace = [TraceRequest(0.0, 3, 2), TraceRequest(1.0, 3, 2)]
    result = simulate(trace, "paged-1", SimConfig(num_slots=32, max_model_len=16, step_seconds=0.1))
    assert result.max_batch == 1 and result.num_steps == 4   # the idle clock jumps to the second arrival


@pytest.fixture(scope="module")
def sharegpt() -> list[TraceRequest]:
    return load_trace("sharegpt")[:60]


@pytest.mark.parametrize("block_size", [1, 16, 128])
def test_paged_waste_is_under_a_block_per_running_request(sharegpt: list[TraceRequest], block_size: int) -> None:
    config = SimConfig(num_slots=6000)
    steps: list[SchedulerStats] = []
    result = simulate(sharegpt, f"paged-{block_size}", config, on_step=steps.append)
    assert len(steps) == result.num_steps and max(s.num_running for s in steps) >= 10
    for stats in steps:
        waste = stats.num_kv_slots_running - stats.num_kv_slots_filled
        assert 0 <= waste <= (block_size - 1) * stats.num_running
    assert (result.token_state_pct == 100.0) == (block_size == 1)


def test_oracle_beats_pow2_beats_max_and_paging_beats_them_all(sharegpt: list[TraceRequest]) -> None:
    config = SimConfig(num_slots=6000)
    results = {policy: simulate(sharegpt, policy, config) for policy in ("max", "pow2", "oracle", "paged-16")}
    shares = [results[p].token_state_pct for p in ("max", "pow2", "oracle", "paged-16")]
    batches = [results[p].max_batch for p in ("max", "pow2", "oracle", "paged-16")]
    assert shares == sorted(shares) and len(set(shares)) == 4
    assert batches == sorted(batches) and batches[0] == 6000 // 2048


def test_bad_configs_and_policies_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="at least one request of max_model_len"):
        SimConfig(num_slots=100, max_model_len=2048)
    with pytest.raises(ValueError, match="unknown policy 'paged-3'"):
        simulate(TWO, "paged-3", SMALL)
    with pytest.raises(ValueError, match="longer than max_model_len"):
        simulate([TraceRequest(0.0, 10, 10)], "oracle", SMALL)


def test_the_simulator_runs_without_torch() -> None:
    code = """
        import sys
        sys.modules["torch"] = None
        from pagedllm.memory.simulate import SimConfig, simulate
        from pagedllm.memory.traces import load_trace
        assert simulate(load_trace("alpaca")[:20], "paged-16", SimConfig()).max_batch > 1
    """
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, result.stderr
