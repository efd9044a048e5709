from __future__ import annotations

import pytest

from pagedllm.core.request import FinishReason, Request, RequestStatus
from pagedllm.sampling_params import SamplingParams


def test_counters_and_token_lists() -> None:
    prompt = [1, 2, 3]
    request = Request("r", prompt, SamplingParams(), eos_token_id=2)
    prompt.append(99)  # the request keeps its own copy
    assert request.num_tokens == 3 and request.num_prompt_tokens == 3 and request.num_output_tokens == 0
    request.append_output_token_ids(7)
    request.append_output_token_ids([8, 9])
    assert request.output_token_ids == [7, 8, 9]
    assert request.all_token_ids == [1, 2, 3, 7, 8, 9]
    assert request.num_tokens == 6 and request.num_output_tokens == 3
    assert request.num_computed_tokens == 0 and request.status is RequestStatus.WAITING


def test_finish_reason_prints_openai_value() -> None:
    assert str(FinishReason.STOP) == "stop" and f"{FinishReason.LENGTH}" == "length"
    assert FinishReason.ABORT.value == "abort" and isinstance(FinishReason.ABORT, str)
    assert FinishReason.ABORT.status is RequestStatus.FINISHED_ABORTED
    assert [s.is_finished for s in RequestStatus] == [False, False, False, False, True, True, True]


def test_request_is_slotted() -> None:
    request = Request("r", [1], SamplingParams())
    with pytest.raises(AttributeError):
        request.no_such_field = 1  # type: ignore[attr-defined]
