#!/usr/bin/env bash
# Issue 9 on the lent nvidia-h200-x2 (device tool `run`, carry ["benchmarks/out/gpu"]):
#   bash benchmarks/run_gpu.sh [pytest|bench|all]   -> $OUT/{pytest.log,bench.log,results.json,results.md,topo.txt}
# The device machine has torch but none of fastapi/uvicorn/pydantic-settings/pytest-asyncio and an
# older transformers, and no network: the wheels travel in benchmarks/out/gpu/wheels (gitignored),
# downloaded here with
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux2014_x86_64 -d benchmarks/out/gpu/wheels fastapi==0.165.0 starlette==1.10.0 \
#     pydantic==2.14.4 pydantic_core==2.50.5 pydantic-settings==2.16.3 python-dotenv typing-inspection \
#     annotated-types annotated-doc opentelemetry-api uvicorn==0.54.0 h11 click redis==8.1.0 hiredis \
#     orjson protobuf==7.36.2 prometheus-client anyio idna typing-extensions rich pygments markdown-it-py \
#     mdurl pytest==9.2.0 pluggy iniconfig pytest-asyncio==1.5.0 transformers==5.24.0 \
#     huggingface_hub==2.4.0 httpx2==2.16.2 httpcore2==2.16.2 truststore tokenizers==0.23.3 httptools \
#     aiohttp multidict yarl propcache frozenlist aiosignal aiohappyeyeballs attrs httpx httpcore certifi sniffio
set -u
what=${1:-all}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  benchmarks/out/gpu/wheels/*.whl || exit 1
# extra: what SGLang's own modules import and the device image may lack (pybase64, pyzmq, psutil,
# requests, pillow, packaging; benchmarks/gpu_sglang_site.py says how), last on the path
[ -d benchmarks/out/gpu/extra ] && python3 -m pip install -q --no-index --no-deps --no-compile \
  --no-cache-dir --upgrade --target /tmp/extra benchmarks/out/gpu/extra/*.whl
export PYTHONPATH=/tmp/site:$PWD:$PWD/benchmarks/out/gpu/site:/tmp/extra PYTHONUNBUFFERED=1  # site: the sglang modules tests/helpers/sglang_modules.py imports (python -m benchmarks.gpu_sglang_site copies them from the wheel: 1.7 MB of its 222)
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
{ nvidia-smi topo -m; nvidia-smi --query-gpu=index,name,memory.total,pcie.link.gen.current,pcie.link.width.current --format=csv; } > "$OUT/topo.txt" 2>&1
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, 'gpus', torch.cuda.device_count())"
if [[ $what == all || $what == pytest ]]; then
  timeout ${PYTEST_TIMEOUT_S:-200} python3 -m pytest -q -p no:cacheprovider tests/gpu tests/unit/test_weight_buckets.py \
    tests/unit/test_engine_fp32_lm_head.py 2>&1 | tee "$OUT/pytest.log" | tail -40
fi
if [[ $what == all || $what == bench ]]; then
  timeout ${BENCH_TIMEOUT_S:-360} python3 -m benchmarks.bench_gpu_weight_sync --out "$OUT" ${BENCH_ARGS:-} 2>&1 \
    | tee "$OUT/bench.log" | grep -v "it/s\]" | tail -80
fi
