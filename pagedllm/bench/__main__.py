"""`python -m pagedllm.bench throughput|serve|prefix|dashboard ...`"""

from pagedllm.bench.cli import main

if __name__ == "__main__":
    main()
