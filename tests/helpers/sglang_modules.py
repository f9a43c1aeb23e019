"""Import SGLang 0.5.23's own request structs and decoders on a CPU machine without its GPU
packages (the released wheel, installed `--no-deps` by `make setup`).

What is imported is SGLang's code, file by file, never a re-implementation; three things stand in
for what those files import but our checks never run (measured in
../shared/reference/sglang_conformance.md section 5):
* `sglang` and `sglang.srt` are registered as bare packages over the wheel's directories: their
  `__init__.py` apply transformers patches and import the frontend language API (torchvision and
  more), which no decoder needs.
* `triton`, where it is not installed, is a stub only while `sglang.srt.utils.common`
  (MultiprocessingSerializer, SafeUnpickler) is imported: it imports triton at module level (line
  91) and uses it on no path called here. The stub is removed right after, so torch does not
  believe triton is installed.
* `sglang.srt.managers.schedule_batch` is a stub holding the five names `io_struct` imports from
  it: the real module imports model configs, quantization and triton kernels. None of the request
  classes checked here (UpdateWeights*, InitWeightsUpdateGroup*, Pause/Continue, AbortReq, ...)
  uses those names.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from pathlib import Path

SCHEDULE_BATCH_NAMES = (
    "Modality",
    "MultimodalProcessorOutput",
    "ReturnHiddenStatesMode",
    "SamplingLogprobsMode",
    "get_return_hidden_states_mode",
)


def wheel_root() -> Path:
    """The installed wheel's `sglang` directory; read from the bare package an earlier `load` in
    this process registered (it has no __spec__, so find_spec raises on it)."""
    registered = sys.modules.get("sglang")
    if registered is not None and registered.__spec__ is None:
        return Path(registered.__path__[0])
    return Path(importlib.util.find_spec("sglang").origin).parent


def installed() -> bool:
    """Whether the wheel is installed (also after `load` registered its bare package)."""
    try:
        wheel_root()
    except (AttributeError, TypeError, ValueError):
        return False
    return True


def load() -> types.SimpleNamespace:
    """SGLang's modules: common (MultiprocessingSerializer), tensor_bucket (FlattenedTensorBucket),
    io_struct (request structs), api_types (GenerateRequest), sampling_params (SamplingParams)."""
    root = wheel_root()
    for name, path in (("sglang", root), ("sglang.srt", root / "srt")):
        if name not in sys.modules or not hasattr(sys.modules[name], "__file__"):
            package = types.ModuleType(name)
            package.__path__ = [str(path)]
            sys.modules[name] = package
    if "sglang.srt.utils.common" not in sys.modules:
        # a stub only where triton is missing (CPU machines): where it is installed (the GPU host)
        # torch's CUDA initialisation inspects it, and a stub without a spec breaks that
        had_triton = "triton" in sys.modules or importlib.util.find_spec("triton") is not None
        if not had_triton:
            sys.modules["triton"] = types.ModuleType("triton")
        try:
            importlib.import_module("sglang.srt.utils.common")
        finally:
            if not had_triton:
                del sys.modules["triton"]
    if "sglang.srt.managers.schedule_batch" not in sys.modules:
        stub = types.ModuleType("sglang.srt.managers.schedule_batch")
        for name in SCHEDULE_BATCH_NAMES:
            setattr(stub, name, type(name, (), {}))
        sys.modules[stub.__name__] = stub
    return types.SimpleNamespace(
        common=importlib.import_module("sglang.srt.utils.common"),
        tensor_bucket=importlib.import_module("sglang.srt.weight_sync.tensor_bucket"),
        io_struct=importlib.import_module("sglang.srt.managers.io_struct"),
        api_types=importlib.import_module("sglang.api.v1.api_types"),
        sampling_params=importlib.import_module("sglang.srt.sampling.sampling_params"),
        version=importlib.import_module("sglang.version").__version__,
    )
