"""Copy the SGLang 0.5.23 files that tests/helpers/sglang_modules.py imports (and the ones SGLang's
own deserializer imports in the GPU tests' second process) from this machine's installed wheel into
benchmarks/out/gpu/site, for a device without network (`benchmarks/run_gpu.sh`, carry that folder).

    .venv/bin/python -m benchmarks.gpu_sglang_site        # -> 97 files, 1.7 MB

The device's Python also needs pybase64, pyzmq, psutil, requests, pillow and packaging where its
image lacks them (download them with `pip download --no-deps --only-binary=:all: --python-version
3.12 ...` into benchmarks/out/gpu/extra and put it last on PYTHONPATH, as benchmarks/run_gpu.sh does).
"""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path

OUT = Path("benchmarks/out/gpu/site")
# imported by SGLang's rebuild of CUDA IPC tensors (MultiprocessingSerializer's load path), which
# the CPU loader never runs
EXTRA = ("sglang/srt/utils/patch_torch.py",)


def main() -> int:
    from tests.helpers import sglang_modules

    sglang_modules.load()
    # the wheel's root: sglang_modules registers `sglang` as a bare package (no __spec__)
    root = Path(importlib.util.find_spec("sglang.srt.utils.common").origin).resolve().parents[3]
    files = {
        Path(m.__file__).resolve().relative_to(root)
        for name, m in list(sys.modules.items())
        if name.startswith("sglang") and getattr(m, "__file__", None)
    } | {Path(p) for p in EXTRA}
    if OUT.exists():
        shutil.rmtree(OUT)
    for rel in sorted(files):
        for i in range(1, len(rel.parts)):  # every package __init__.py on the way
            init = Path(*rel.parts[:i]) / "__init__.py"
            if (root / init).exists():
                (OUT / init).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(root / init, OUT / init)
        (OUT / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(root / rel, OUT / rel)
    count = sum(1 for _ in OUT.rglob("*.py"))
    print(f"{count} files in {OUT}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
