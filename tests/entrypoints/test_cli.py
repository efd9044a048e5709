"""The `pagedllm` command's help comes at once: building its parsers imports neither torch nor transformers (they
take seconds to import, and only the commands that run a model need them)."""

from __future__ import annotations

import subprocess
import sys


def test_help_imports_neither_torch_nor_transformers() -> None:
    code = ("import sys\n"
            "from pagedllm.entrypoints.cli import make_parser\n"
            "for argv in (['--help'], ['serve', '--help'], ['bench', 'throughput', '--help'], ['plan', '--help']):\n"
            "    try:\n"
            "        make_parser().parse_args(argv)\n"
            "    except SystemExit:\n"
            "        pass\n"
            "print(sorted(name for name in ('torch', 'transformers') if name in sys.modules))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.splitlines()[-1] == "[]"
