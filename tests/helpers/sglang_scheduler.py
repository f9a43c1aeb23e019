"""SGLang 0.5.23's own scheduler-side weight-update code, loaded from the released wheel on a CPU
machine (issue 30 item 7): `SchedulerWeightUpdaterManager`
(sglang/srt/managers/scheduler_components/weight_updater.py: begin -> buckets -> end, the flush
after the last, the version recording), the model runner's `WeightUpdater`
(sglang/srt/model_executor/model_runner_components/weight_updater.py: the tensor and flattened
bucket loaders, the distributed group and its bucketed receive), the TP worker's methods
between them (sglang/srt/managers/tp_worker.py: `deserialize_own_rank`,
`init_weights_update_group`, `destroy_weights_update_group`) and the scheduler's pause, resume
and flush (sglang/srt/managers/scheduler.py: `pause_generation`, `continue_generation`,
`flush_cache`, `is_fully_idle`). Both updater modules are imported whole; the functions of
tp_worker.py and scheduler.py, whose modules import the GPU stack, are compiled one by one from
the wheel's source (their line numbers kept, so a traceback points at the wheel).

Named stand-ins, for what those files import but cannot be imported on CPU (each real module
pulls in triton kernels, tvm_ffi or torchvision; measured 2026-12-05) and what the checked paths
do not run:
* `sglang.srt.configs`, `sglang.srt.model_loader`: bare packages over the wheel's directories
  (their __init__ import every model config, multimodal ones need torchvision); the real
  `sglang.srt.configs.load_config` is then imported as it is.
* `sglang.srt.disaggregation.utils`: `DisaggregationMode` only (its real module imports
  configs.model_config -> quantization -> triton kernels); the paths here run in NULL mode.
* `sglang.srt.utils.weight_checker`: `overall_checksum`, used by `check_weights` only (the real
  module imports managers.mm_utils -> triton kernels).
* `sglang.srt.model_loader.loader`: `DefaultModelLoader.restore_weights_before_loading` and
  `postprocess_weights`, which walk the modules that have a quantization method; the stand-in
  model has none, so the real ones do nothing, and the stand-ins refuse a module that has one.
  `post_load_weights` is the wheel's own function. `get_model_loader` (disk loads) raises.
* `sglang.srt.model_loader.weight_utils`, `sglang.srt.model_loader.utils`: the wheel's own
  `default_weight_loader` and `set_default_torch_dtype`, compiled alone (their modules import
  model configs and quantization kernels).
* `get_parallel()` / `get_model()` / `get_serving()` in the loaded modules: SGLang's runtime
  context needs a whole ServerArgs; these give the TP rank, the TP CPU group (a gloo group of
  the rank processes), `dp_size`/`pp_size` 1 and `weight_cache_mode` "off".
The model itself (Qwen2ForCausalLM with its TP-sharded weight loaders and kernels) cannot run on
CPU: `tests/helpers/sglang_tp_rank.StandInModel` keeps every tensor whole on each rank and loads
with SGLang's `default_weight_loader`.
"""

from __future__ import annotations

import ast
import enum
import importlib
import sys
import types
from pathlib import Path

from tests.helpers import sglang_modules


def _bare_package(name: str, path: Path) -> None:
    if name not in sys.modules or not hasattr(sys.modules[name], "__file__"):
        package = types.ModuleType(name)
        package.__path__ = [str(path)]
        sys.modules[name] = package


def wheel_function(path: Path, qualname: str, namespace: dict):
    """The function `qualname` ("f" or "Class.f") of the wheel's file `path`, compiled from its
    source with its own line numbers into `namespace` (its globals), decorators left out."""
    tree = ast.parse(path.read_text(), filename=str(path))
    owner, _, name = qualname.rpartition(".")
    body = tree.body
    if owner:
        body = next(n for n in body if isinstance(n, ast.ClassDef) and n.name == owner).body
    node = next(
        n for n in body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and n.name == name
    )
    node.decorator_list = []
    module = ast.Module(body=[node], type_ignores=[])
    exec(compile(module, str(path), "exec"), namespace)  # noqa: S102 (the wheel's own source)
    return namespace[name]


class DisaggregationMode(enum.Enum):
    """Stand-in of sglang.srt.disaggregation.utils.DisaggregationMode (same members)."""

    NULL = "null"
    PREFILL = "prefill"
    DECODE = "decode"


class DefaultModelLoader:
    """Stand-in of the two static methods the model runner's WeightUpdater calls at begin and end
    of a session; the real ones only touch modules with a `quant_method` (none here)."""

    calls: list[str] = []

    @staticmethod
    def _unquantized(model) -> None:
        if any(getattr(m, "quant_method", None) is not None for m in model.modules()):
            raise NotImplementedError("the stand-in loader does not restore quantized modules")

    @staticmethod
    def restore_weights_before_loading(model, target_device) -> None:
        DefaultModelLoader._unquantized(model)
        DefaultModelLoader.calls.append("restore_weights_before_loading")

    @staticmethod
    def postprocess_weights(model, target_device) -> None:
        DefaultModelLoader._unquantized(model)
        DefaultModelLoader.calls.append("postprocess_weights")


def _get_model_loader(*args, **kwargs):
    raise NotImplementedError("disk loads are not part of the stand-in loader")


def load() -> types.SimpleNamespace:
    """The wheel's modules and functions (see the module docstring), loaded once per process:
    scheduler (SchedulerWeightUpdaterManager's module), runner (WeightUpdater's module),
    tp_worker (its three functions), scheduler_methods (pause_generation, continue_generation,
    flush_cache, is_fully_idle), io_struct, plus what sglang_modules.load gives."""
    base = sglang_modules.load()
    root = sglang_modules.wheel_root()
    srt = root / "srt"
    _bare_package("sglang.srt.configs", srt / "configs")
    _bare_package("sglang.srt.model_loader", srt / "model_loader")
    stubs = {
        "sglang.srt.disaggregation.utils": {"DisaggregationMode": DisaggregationMode},
        "sglang.srt.utils.weight_checker": {"overall_checksum": lambda checksums: None},
    }
    import torch  # noqa: F401 (the compiled functions' globals)

    loader_globals = {"torch": torch}
    stubs["sglang.srt.model_loader.loader"] = {
        "DefaultModelLoader": DefaultModelLoader,
        "get_model_loader": _get_model_loader,
        "post_load_weights": wheel_function(
            srt / "model_loader" / "loader.py", "post_load_weights", loader_globals
        ),
    }
    weight_utils_globals = {"torch": torch, "get_parallel": None}
    stubs["sglang.srt.model_loader.weight_utils"] = {
        "default_weight_loader": wheel_function(
            srt / "model_loader" / "weight_utils.py", "default_weight_loader", weight_utils_globals
        ),
        "get_pp_stage_load_group": lambda: None,
    }
    import contextlib

    utils_globals = {"torch": torch, "contextlib": contextlib}
    stubs["sglang.srt.model_loader.utils"] = {
        "set_default_torch_dtype": contextlib.contextmanager(
            wheel_function(
                srt / "model_loader" / "utils.py", "set_default_torch_dtype", utils_globals
            )
        )
    }
    for name, members in stubs.items():
        if name not in sys.modules:
            module = types.ModuleType(name)
            module.__dict__.update(members)
            module.__doc__ = f"stand-in of {name} (tests/helpers/sglang_scheduler.py)"
            sys.modules[name] = module
    scheduler = importlib.import_module("sglang.srt.managers.scheduler_components.weight_updater")
    runner = importlib.import_module(
        "sglang.srt.model_executor.model_runner_components.weight_updater"
    )
    import logging
    import time

    from sglang.srt.platforms import current_platform

    worker_globals = {
        "torch": torch,
        "MultiprocessingSerializer": base.common.MultiprocessingSerializer,
        "monkey_patch_torch_reductions": importlib.import_module(
            "sglang.srt.utils.patch_torch"
        ).monkey_patch_torch_reductions,
        "get_parallel": None,  # set by the rank (`bind_context`)
    }
    tp_worker = types.SimpleNamespace(
        **{
            name: wheel_function(
                srt / "managers" / "tp_worker.py", f"BaseTpWorker.{name}", worker_globals
            )
            for name in (
                "deserialize_own_rank",
                "init_weights_update_group",
                "destroy_weights_update_group",
            )
        },
        globals=worker_globals,
    )
    scheduler_globals = {
        "torch": torch,
        "time": time,
        "logging": logging,
        "logger": logging.getLogger("sglang.srt.managers.scheduler"),
        "DisaggregationMode": DisaggregationMode,
        "current_platform": current_platform,
        "retract_all": None,  # set by the rank: frees a retracted request's KV
        "get_memory": None,
    }
    scheduler_methods = types.SimpleNamespace(
        **{
            name: wheel_function(
                srt / "managers" / "scheduler.py", f"Scheduler.{name}", scheduler_globals
            )
            for name in ("pause_generation", "continue_generation", "flush_cache", "is_fully_idle")
        },
        globals=scheduler_globals,
    )
    return types.SimpleNamespace(
        scheduler=scheduler,
        runner=runner,
        tp_worker=tp_worker,
        scheduler_methods=scheduler_methods,
        io_struct=base.io_struct,
        base=base,
    )


def bind_context(loaded: types.SimpleNamespace, *, tp_rank: int, tp_cpu_group) -> None:
    """Point the loaded modules' runtime-context reads at this rank (the stand-in context of the
    module docstring)."""
    parallel = types.SimpleNamespace(
        tp_rank=tp_rank,
        tp_group=types.SimpleNamespace(cpu_group=tp_cpu_group),
        dp_size=1,
        pp_size=1,
    )
    model = types.SimpleNamespace(weight_cache_mode="off")
    for namespace in (loaded.scheduler.__dict__, loaded.runner.__dict__, loaded.tp_worker.globals):
        namespace["get_parallel"] = lambda: parallel
        namespace["get_model"] = lambda: model
