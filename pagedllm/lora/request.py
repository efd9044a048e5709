"""Which LoRA adapter a request runs with, as vLLM names it (`vllm.lora.request.LoRARequest`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """A PEFT LoRA adapter for one request.

    Args:
        lora_name: the adapter's name (the server's model name for it).
        lora_int_id: its id, unique per adapter and > 0: the engine keeps one loaded copy per id, and the prefix
            cache keeps one adapter's blocks apart from another's by it.
        lora_path: the folder PEFT saved it to (`adapter_config.json` and `adapter_model.safetensors` or `.bin`).
        base_model_name: the model it was trained on, for the server's model list; not checked.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an integer > 0, got {self.lora_int_id!r}")
        if not self.lora_name:
            raise ValueError("lora_name must not be empty")
