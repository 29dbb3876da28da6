#!/usr/bin/env bash
# CUDA checks of the parts that run without TorchRec/FBGEMM: the pipeline's streams/events/pinned copies,
# the store's device tier on CUDA slot tensors, and NCCL collectives. Run from the repository root on a
# GPU machine whose Python already has torch, pytest and hypothesis; `lmdb` may be installed from .whl/.
set -uo pipefail
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
nvidia-smi -L
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.get_device_name(0))"
python3 -m pytest -p no:cacheprovider -q -rs tests/pipelines tests/embedding_store/test_store_devices.py 2>&1 | tail -8
python3 - <<'PY'
import os, time, torch, torch.distributed as dist
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29701")
dist.init_process_group("nccl", rank=0, world_size=1)
x = torch.arange(1 << 20, device="cuda", dtype=torch.int64)
out = torch.empty_like(x)
dist.all_to_all_single(out, x)
torch.cuda.synchronize()
print("nccl all_to_all_single world=1 ok:", bool(torch.equal(out, x)))
dist.destroy_process_group()
# pinned host -> device copies, non_blocking vs pageable (the store's host arena path)
rows = 1 << 18
host = torch.randn(rows, 64)
pinned = host.pin_memory()
dev = torch.empty(rows, 64, device="cuda")
for name, src in (("pageable", host), ("pinned", pinned)):
    torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(20):
        dev.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    print(f"h2d {name}: {20 * src.numel() * 4 / (time.perf_counter() - t) / 1e9:.1f} GB/s")
PY
