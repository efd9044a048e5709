"""vLLM's start_profile / stop_profile: torch's profiler over an engine's steps (`ProfilerConfig`).

A session starts at `start`, optionally `delay_iterations` steps later, and ends at `stop` or after `max_iterations`
recorded steps; its trace is written when it ends, by torch's `tensorboard_trace_handler`, as
`{name}.{time_ns}.pt.trace.json[.gz]` in the configured folder. The engine calls `step` after each of its steps,
on the thread that steps it, which is the thread torch records (the engine's, on the server).
"""

from __future__ import annotations

import os

import torch

from pagedllm.config import ProfilerConfig
from pagedllm.logger import init_logger

logger = init_logger(__name__)

_ACTIVITIES = {"CPU": torch.profiler.ProfilerActivity.CPU, "CUDA": torch.profiler.ProfilerActivity.CUDA}
_recording: EngineProfiler | None = None     # the session recording in this process: torch's profiler runs one


class EngineProfiler:
    """One engine's profiling sessions.

    Args:
        config: the engine's profiler_config (its `profiler` set).
        device: the engine's device: CUDA is recorded beside the CPU on a GPU unless the activities say otherwise.
    """

    def __init__(self, config: ProfilerConfig, device: torch.device) -> None:
        self.config = config
        self.directory = os.path.abspath(config.torch_profiler_dir)
        names = config.torch_profiler_activities or (["CPU", "CUDA"] if device.type == "cuda" else ["CPU"])
        self.activities = [_ACTIVITIES[name] for name in names]
        self.active = False         # between start and stop
        self.profile: torch.profiler.profile | None = None      # recording (after the delay)
        self._name = ""
        self._delay = self._limit = self._steps = self._recorded = 0

    @property
    def running(self) -> bool:
        return self.profile is not None

    def start(self, profile_prefix: str | None = None, delay_iterations: int | None = None,
              max_iterations: int | None = None) -> None:
        """Begin a session (a second start while one is active is ignored, as vLLM's); `profile_prefix` names its
        trace (default "pagedllm_<pid>"), the iteration counts override the config's for it."""
        for name, value in (("delay_iterations", delay_iterations), ("max_iterations", max_iterations)):
            if value is not None and (not isinstance(value, int) or value < 0):
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        if self.active:
            logger.info("start_profile: a profiling session is already active")
            return
        self.active, self._steps, self._recorded = True, 0, 0
        self._name = profile_prefix or f"pagedllm_{os.getpid()}"
        self._delay = self.config.delay_iterations if delay_iterations is None else delay_iterations
        self._limit = self.config.max_iterations if max_iterations is None else max_iterations
        if self._delay == 0:
            self._record()

    def step(self) -> None:
        """After each engine step: start recording once the delay is over; stop after max_iterations."""
        if not self.active:
            return
        self._steps += 1
        if self.profile is None:
            if self._steps == self._delay:
                self._record()
            return
        if self.config.wait_iterations or self.config.warmup_iterations:
            self.profile.step()
        self._recorded += 1
        if self._limit and self._recorded >= self._limit:
            logger.info("profiling: %d steps recorded (max_iterations), the session ends", self._recorded)
            self.stop()

    def stop(self) -> None:
        """End the session and write its trace (a stop without a session is ignored, as vLLM's)."""
        if not self.active:
            return
        self.active = False
        if self.profile is not None:
            global _recording
            profile, self.profile, _recording = self.profile, None, None
            profile.stop()
            logger.info("profiling: the trace of %d steps is in %s", self._recorded, self.directory)

    def _record(self) -> None:
        global _recording
        if _recording is not None and _recording is not self:
            self.active = False
            raise RuntimeError("another engine in this process is being profiled: torch's profiler records one "
                               "session a process")
        _recording = self
        config = self.config
        schedule = torch.profiler.schedule(wait=config.wait_iterations, warmup=config.warmup_iterations,
                                           active=config.active_iterations, repeat=1) \
            if config.wait_iterations or config.warmup_iterations else None
        self.profile = torch.profiler.profile(
            activities=self.activities, schedule=schedule, record_shapes=config.torch_profiler_record_shapes,
            profile_memory=config.torch_profiler_with_memory, with_stack=config.torch_profiler_with_stack,
            with_flops=config.torch_profiler_with_flops,
            on_trace_ready=torch.profiler.tensorboard_trace_handler(self.directory, worker_name=self._name,
                                                                    use_gzip=config.torch_profiler_use_gzip))
        self.profile.start()
