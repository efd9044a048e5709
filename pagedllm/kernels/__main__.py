"""`python -m pagedllm.kernels`: build the kernels at every -march this CPU runs, so no test or request waits."""

from __future__ import annotations

import sys

from pagedllm.kernels import build_kernels, kernel_marches

if __name__ == "__main__":
    failed = [march for march in kernel_marches() if build_kernels(march) is None]
    if failed:
        sys.exit(f"the kernels did not build for -march={', '.join(failed)}")
    print(f"pagedllm kernels built for -march={', '.join(kernel_marches())}")
