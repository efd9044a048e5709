"""`python -m pagedllm.kernels [MARCH ...]`: build the kernels at every -march this CPU runs (or at those named:
`native` alone is what serving uses), so that no test or request waits."""

from __future__ import annotations

import sys

from pagedllm.kernels import build_kernels, kernel_marches

if __name__ == "__main__":
    runnable = kernel_marches()
    marches = sys.argv[1:] or runnable
    unknown = [march for march in marches if march not in runnable]
    if unknown:
        sys.exit(f"this CPU runs the kernels at -march={', '.join(runnable)}, not {', '.join(unknown)}")
    failed = [march for march in marches if build_kernels(march) is None]
    if failed:
        sys.exit(f"the kernels did not build for -march={', '.join(failed)}")
    print(f"pagedllm kernels built for -march={', '.join(marches)}")
