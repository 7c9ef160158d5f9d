"""``python -m deep_ep env``: one line per item of what the machine gives deep_ep, every item there
(an item that cannot be found says why), exit status 0, on this GPU-less machine too."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LABELS = ("deep_ep", "python", "torch", "torch's NCCL", "GPUs", "JIT compiler", "JIT target arch", "CUDA headers",
          "CCCL headers", "NCCL headers", "libnccl loaded", "JIT cache", "deep_ep variables")


def test_env_reports_every_item(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), EP_JIT_CACHE_DIR=str(tmp_path), EP_JIT_ARCH="sm_100")
    out = subprocess.run([sys.executable, "-m", "deep_ep", "env"], env=env, capture_output=True, text=True,
                         timeout=120, check=True).stdout
    lines = dict(line.split(":", 1) for line in out.splitlines())
    assert tuple(lines) == LABELS
    values = {label: value.strip() for label, value in lines.items()}
    assert values["deep_ep"].endswith(str(ROOT / "deep_ep"))
    assert values["JIT cache"] == f"{tmp_path} (0 kernel modules)"
    assert f"EP_JIT_CACHE_DIR={tmp_path}" in values["deep_ep variables"] and "EP_JIT_ARCH=sm_100" in \
        values["deep_ep variables"]
    import torch
    if not torch.cuda.is_available():
        assert values["GPUs"] == "none visible to torch" and values["JIT target arch"].startswith("sm_100")
