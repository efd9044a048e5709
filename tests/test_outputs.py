"""outputs.py: vLLM-shaped plain dataclasses that import without torch."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from pagedllm.outputs import CompletionOutput, Logprob, RequestOutput

ROOT = Path(__file__).resolve().parents[1]


def test_shapes_and_defaults() -> None:
    logprobs = [{5: Logprob(-0.1, 1, "a"), 6: Logprob(-2.5, 2, "b")}]
    completion = CompletionOutput(0, "a", [5], -0.1, logprobs)
    assert not completion.finished() and completion.stop_reason is None
    completion.finish_reason = "stop"
    assert completion.finished()
    out = RequestOutput("r1", "hi", [1, 2], [completion], finished=True)
    assert out.num_cached_tokens == 0 and out.metrics is None
    assert out.outputs[0].logprobs[0][6].rank == 2
    assert Logprob(-1.0).rank is None and Logprob(-1.0).decoded_token is None


def test_outputs_and_sampling_params_need_no_torch() -> None:
    code = (
        "import sys\n"
        "sys.modules['torch'] = None\n"
        "from pagedllm.outputs import RequestOutput\n"
        "from pagedllm.sampling_params import SamplingParams\n"
        "SamplingParams(stop='x')\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
