"""The extension lends nothing to the libraries loaded after it: it exports its entry point only,
and importing flexattn before torch leaves torch working."""

import shutil
import subprocess
import sys

import pytest

import flexattn
from flexattn import _flexattn


def test_extension_exports_only_its_entry_point():
    if sys.platform != "linux":
        pytest.skip("the symbol list is checked on Linux (python/module.map)")
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("no nm (binutils) on this machine")
    listed = subprocess.run([nm, "-D", "--defined-only", _flexattn.__file__], check=True,
                            capture_output=True, text=True).stdout.split("\n")
    names = sorted(line.split()[-1] for line in listed if line.strip())
    assert names == ["PyInit__flexattn"], names[:20]


def test_flexattn_imported_before_torch():
    # In a fresh interpreter, so that torch is not loaded yet (conftest imports it here).
    script = ("import flexattn\n"
              "import torch\n"
              "q = torch.randn(1, 2, 8, 16)\n"
              "out = flexattn.attention(q, q, q, engine='cpu')\n"
              "assert torch.allclose(out, torch.nn.functional.scaled_dot_product_attention(q, q, q),"
              " atol=1e-5)\n"
              "print('ok')\n")
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0 and run.stdout.strip() == "ok", (run.returncode, run.stderr[-2000:])
