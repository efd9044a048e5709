"""preemption_mode="auto" decides from measured costs: a start-up prefill and block copy, then the engine's own
step timings (an exponential moving average), not fixed device constants."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.config import SchedulerConfig
from pagedllm.engine.llm_engine import follow_step_costs
from pagedllm.runner.model_runner import ModelRunner, StepTimings
from tests.models.tiny import save_tiny_model

SWAP_BLOCKS_GIB = 64 * 2048 / 2**30     # 64 swap blocks of the tiny model's 4-token blocks (2 KiB each)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    return str(save_tiny_model(tmp_path_factory.mktemp("tiny") / "m", "llama-gqa", seed=5)[0])


def _llm(folder: str, mode: str = "auto", **kw) -> LLM:
    return LLM(model=folder, dtype="float32", block_size=4, max_model_len=128, swap_space=SWAP_BLOCKS_GIB,
               preemption_mode=mode, **kw)


def _measured(monkeypatch, recompute_seconds_per_token: float, swap_seconds_per_block: float) -> None:
    """Make the start-up measurement report these rates."""
    monkeypatch.setattr(ModelRunner, "measure_prefill_seconds_per_token", lambda self, n: recompute_seconds_per_token)
    monkeypatch.setattr(ModelRunner, "measure_swap_seconds_per_block", lambda self, n: swap_seconds_per_block)


def _overload(llm: LLM) -> dict[str, int]:
    """Eight requests that want far more than a 24-block pool holds; returns the preemptions by mode."""
    prompts = [[3 + (i * 7 + j) % 250 for j in range(6 + 5 * i)] for i in range(8)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 24 for o in outputs)
    llm.engine.kv_cache_manager.check_integrity()
    return dict(llm.engine.scheduler.num_preemptions_by_mode)


def test_the_average_follows_big_steps_and_swaps_only() -> None:
    sched = SchedulerConfig(recompute_seconds_per_token=1.0, swap_seconds_per_block=1.0)
    follow_step_costs(sched, StepTimings(forward_seconds=0.5, num_tokens=10))      # too small a step to count
    assert (sched.recompute_seconds_per_token, sched.swap_seconds_per_block) == (1.0, 1.0)
    follow_step_costs(sched, StepTimings(forward_seconds=0.064, num_tokens=64, swap_seconds=0.02,
                                         num_swapped_blocks=10))
    assert sched.recompute_seconds_per_token == pytest.approx(0.8 * 1.0 + 0.2 * 0.001)
    assert sched.swap_seconds_per_block == pytest.approx(0.8 * 1.0 + 0.2 * 0.002)


def test_auto_measures_plausible_costs_at_start_up(folder: str) -> None:
    sched = _llm(folder, num_kv_blocks=64).engine.config.scheduler
    defaults = _llm(folder, mode="swap", num_kv_blocks=64).engine.config.scheduler
    for measured, default in ((sched.recompute_seconds_per_token, defaults.recompute_seconds_per_token),
                              (sched.swap_seconds_per_block, defaults.swap_seconds_per_block)):
        assert 1e-9 < measured < 0.1 and measured != default


def test_the_measurement_is_used_and_followed_by_the_steps(folder: str, monkeypatch) -> None:
    _measured(monkeypatch, recompute_seconds_per_token=0.125, swap_seconds_per_block=0.25)
    llm = _llm(folder, num_kv_blocks=64)
    sched = llm.engine.scheduler.config
    assert (sched.recompute_seconds_per_token, sched.swap_seconds_per_block) == (0.125, 0.25)
    llm.generate([list(range(3, 103))], SamplingParams(max_tokens=1), use_tqdm=False)   # one 100-token step
    assert 0 < sched.recompute_seconds_per_token < 0.8 * 0.125 + 0.2 * 0.01     # the step took under 10 ms/token
    assert sched.swap_seconds_per_block == 0.25                                  # nothing swapped


def test_auto_recomputes_when_the_measured_recompute_is_cheaper(folder: str, monkeypatch) -> None:
    _measured(monkeypatch, recompute_seconds_per_token=1e-9, swap_seconds_per_block=1.0)
    by_mode = _overload(_llm(folder, num_kv_blocks=24, max_num_batched_tokens=32))
    assert by_mode["recompute"] > 0 and by_mode["swap"] == 0


def test_auto_swaps_when_the_measured_swap_is_cheaper(folder: str, monkeypatch) -> None:
    # Steps of 32 tokens stay under the 64 the average needs, so the recompute cost stays as measured.
    _measured(monkeypatch, recompute_seconds_per_token=1.0, swap_seconds_per_block=1e-9)
    by_mode = _overload(_llm(folder, num_kv_blocks=24, max_num_batched_tokens=32))
    assert by_mode["swap"] > 0
