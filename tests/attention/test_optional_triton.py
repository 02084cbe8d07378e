"""triton is optional: tokenmill imports and refuses the triton backend clearly without it."""

from __future__ import annotations

import subprocess
import sys


def test_tokenmill_imports_without_triton() -> None:
    """``import tokenmill`` never imports triton; without it TritonBackend raises a clear ImportError."""
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import tokenmill, tokenmill.engine.engine\n"
        "assert 'tokenmill.attention.triton' not in sys.modules\n"
        "from tokenmill.attention.triton import TRITON_AVAILABLE, TritonBackend\n"
        "assert not TRITON_AVAILABLE\n"
        "try:\n    TritonBackend(4, 2, 16, None)\nexcept ImportError as e:\n    print('refused:', e)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "refused: attention_backend='triton' needs the triton package" in result.stdout
