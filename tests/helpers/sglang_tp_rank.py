"""One TP rank of an SGLang 0.5.23 engine on CPU, running the wheel's own scheduler-side weight
update code (tests/helpers/sglang_scheduler.py says what is SGLang's and what stands in): the
conformance harness of issue 30 item 7 starts TP ranks as processes that join a gloo TP group
and answer the requests its HTTP front (tests/fakes/sglang_front.py) fans out, as SGLang's
tokenizer manager fans a request out to every scheduler.

    python -m tests.helpers.sglang_tp_rank ADDRESS RANK TP_SIZE TP_PORT SHAPES_JSON IN_FLIGHT

ADDRESS: the harness's multiprocessing Listener (a Unix socket; authkey from the environment
variable SGLANG_HARNESS_KEY, hex); TP_PORT: the TCP port of the TP group's rendezvous on
127.0.0.1; SHAPES_JSON: {name: shape} of the model (bfloat16); IN_FLIGHT: how many generations
the scheduler holds in its running batch (what a pause retracts or keeps).
Requests: (op, body) -> reply; ops: the SGLang request names (pause_generation,
continue_generation, begin_weight_update, end_weight_update, update_weights_from_tensor,
update_weights_from_distributed, init_weights_update_group, destroy_weights_update_group,
flush_cache), "digests" (sha256 of every parameter's bytes), "state", "exit".
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import types
from datetime import timedelta
from multiprocessing.connection import Client

import pydantic
import torch

from tests.helpers import sglang_scheduler

STRUCTS = {
    "pause_generation": "PauseGenerationReqInput",
    "continue_generation": "ContinueGenerationReqInput",
    "begin_weight_update": "BeginWeightUpdateReqInput",
    "end_weight_update": "EndWeightUpdateReqInput",
    "update_weights_from_tensor": "UpdateWeightsFromTensorReqInput",
    "update_weights_from_distributed": "UpdateWeightsFromDistributedReqInput",
    "init_weights_update_group": "InitWeightsUpdateGroupReqInput",
    "destroy_weights_update_group": "DestroyWeightsUpdateGroupReqInput",
}


class StandInModel(torch.nn.Module):
    """The served model's parameters by their Hugging Face names, each whole on every rank (SGLang's
    Qwen2ForCausalLM shards them across TP ranks with kernels that need a GPU). `load_weights` is
    what SGLang's model runner calls with the reconstructed tensors: each is copied by SGLang's
    own `default_weight_loader`; `loaded` lists the names loaded since the last `reset_loaded`."""

    def __init__(self, shapes: dict[str, list[int]], dtype: torch.dtype, weight_loader) -> None:
        super().__init__()
        self.by_name = {}
        for i, (name, shape) in enumerate(shapes.items()):
            parameter = torch.nn.Parameter(torch.zeros(shape, dtype=dtype), requires_grad=False)
            self.register_parameter(f"p{i}", parameter)
            self.by_name[name] = parameter
        self.weight_loader, self.loaded = weight_loader, []

    def load_weights(self, weights) -> None:
        for name, tensor in weights:
            self.weight_loader(self.by_name[name], tensor)
            self.loaded.append(name)


class Req:
    """A generation in the running batch (what SGLang's pause and flush look at)."""

    def __init__(self, rid: str) -> None:
        self.rid, self.kv = rid, types.SimpleNamespace(holds_kv=False)

    def finished(self) -> bool:
        return False


class Batch:
    def __init__(self, reqs: list) -> None:
        self.reqs, self.batch_is_full = reqs, False

    def is_empty(self) -> bool:
        return not self.reqs


def _none(*args, **kwargs) -> None:
    return None


class SchedulerState:
    """The scheduler's fields that SGLang's pause_generation, continue_generation, flush_cache and
    is_fully_idle read (NULL disaggregation, no overlap, no hierarchical cache), with those four
    methods bound from the wheel; `record_weight_version_change` stands in for the scheduler's
    (which writes SGLang's runtime context): it records each version with what was loaded and
    whether the engine was paused."""

    def __init__(self, methods, in_flight: int, model: StandInModel) -> None:
        self.model = model
        self._engine_paused, self._pause_started_at, self._pause_intervals = False, None, []
        self.enable_overlap = self.enable_overlap_mlx = False
        self.enable_hisparse = self.enable_hierarchical_cache = self.enable_lmcache = False
        self.last_batch = self.chunked_req = self.cur_batch_for_debug = None
        self.decode_offload_manager = self.hisparse_coordinator = self.draft_worker = None
        self.disagg_decode_prealloc_queue = None
        self.disaggregation_mode = sglang_scheduler.DisaggregationMode.NULL
        self.running_batch = Batch([Req(f"gen-{i}") for i in range(in_flight)])
        self.waiting_queue, self.result_queue = [], []
        self.flushes: list[bool] = []
        pool = types.SimpleNamespace(clear=_none, reset_aux_cache_allocator=_none)
        self.req_to_token_pool = pool
        self.token_to_kv_pool_allocator = types.SimpleNamespace(clear=_none)
        self.tree_cache = types.SimpleNamespace(reset=_none)
        self.grammar_manager = types.SimpleNamespace(grammar_queue=[], clear=_none)
        self.dllm_manager = types.SimpleNamespace(any_staging_reqs=lambda: False)
        self.metrics_reporter = types.SimpleNamespace(
            last_gen_throughput=0.0,
            current_scheduler_metrics_enabled=False,
            reset_metrics=_none,
            is_stats_logging_rank=False,
        )
        self.kv_events_publisher = types.SimpleNamespace(publish_kv_events=_none)
        self.weight_version = "default"
        self.version_records: list[dict] = []
        for name in ("pause_generation", "continue_generation", "is_fully_idle"):
            setattr(self, name, types.MethodType(getattr(methods, name), self))
        self._flush = types.MethodType(methods.flush_cache, self)

    def flush_cache(self, empty_cache: bool = True) -> bool:
        ok = self._flush(empty_cache)
        self.flushes.append(ok)
        return ok

    def _add_request_to_queue(self, req, is_retracted: bool = False) -> None:
        self.waiting_queue.append(req)

    def _pp_microbatches_drained(self) -> bool:
        return True

    def record_weight_version_change(self, new_version) -> None:
        if new_version is None or new_version == self.weight_version:
            return
        self.weight_version = new_version
        self.version_records.append(
            {
                "version": new_version,
                "loaded": len(self.model.loaded),
                "paused": self._engine_paused,
            }
        )

    def finish_running(self) -> int:
        """What SGLang's writer lock waits for without a pause: every generation ends."""
        finished = len(self.running_batch.reqs) + len(self.waiting_queue)
        self.running_batch.reqs, self.waiting_queue = [], []
        return finished


def main(argv: list[str]) -> int:
    address, rank, tp_size, tp_port, shapes_json, in_flight = argv
    rank, tp_size = int(rank), int(tp_size)
    loaded = sglang_scheduler.load()
    torch.distributed.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{tp_port}",
        rank=rank,
        world_size=tp_size,
        timeout=timedelta(seconds=60),
    )
    tp_group = torch.distributed.new_group(backend="gloo")
    sglang_scheduler.bind_context(loaded, tp_rank=rank, tp_cpu_group=tp_group)
    weight_loader = sys.modules["sglang.srt.model_loader.weight_utils"].default_weight_loader
    model = StandInModel(json.loads(shapes_json), torch.bfloat16, weight_loader)
    runner = types.SimpleNamespace(model=model)
    runner.weight_updater = loaded.runner.WeightUpdater(
        tp_rank=rank,
        device="cpu",
        gpu_id=0,
        model_config=types.SimpleNamespace(dtype=torch.bfloat16),
        custom_weight_loaders={},
        get_model=lambda: model,
        update_model_fields=_none,
        recapture_cuda_graph=_none,
        get_model_runner=lambda: runner,
    )
    tp_worker = types.SimpleNamespace(model_runner=runner)
    for name in (
        "deserialize_own_rank",
        "init_weights_update_group",
        "destroy_weights_update_group",
    ):
        setattr(tp_worker, name, types.MethodType(getattr(loaded.tp_worker, name), tp_worker))
    tp_worker.weight_update_runners = lambda: [("target", runner)]
    scheduler = SchedulerState(loaded.scheduler_methods, int(in_flight), model)
    loaded.scheduler_methods.globals["retract_all"] = _none  # frees KV: there is none on CPU
    manager = loaded.scheduler.SchedulerWeightUpdaterManager(
        tp_worker=tp_worker,
        draft_worker=None,
        memory_saver_adapter=None,
        flush_cache=scheduler.flush_cache,
        is_fully_idle=scheduler.is_fully_idle,
        scheduler=scheduler,
    )
    handlers = {
        "pause_generation": scheduler.pause_generation,
        "continue_generation": scheduler.continue_generation,
        "begin_weight_update": manager.begin_weight_update,
        "end_weight_update": manager.end_weight_update,
        "update_weights_from_tensor": manager.update_weights_from_tensor,
        "update_weights_from_distributed": manager.update_weights_from_distributed,
        "init_weights_update_group": manager.init_weights_update_group,
        "destroy_weights_update_group": manager.destroy_weights_update_group,
    }
    conn = Client(
        address, family="AF_UNIX", authkey=bytes.fromhex(os.environ["SGLANG_HARNESS_KEY"])
    )
    conn.send(("ready", rank))
    while True:
        op, body = conn.recv()
        if op == "exit":
            break
        try:
            conn.send(("ok", _answer(op, body, handlers, loaded, scheduler, manager, model)))
        except Exception as exc:  # noqa: BLE001 (reported to the harness, which fails the test)
            conn.send(("error", f"{type(exc).__name__}: {exc}"))
    groups = list(runner.weight_updater._model_update_group)
    conn.send(("bye", {"open_groups": groups, "session_open": manager._session is not None}))
    conn.close()
    torch.distributed.destroy_process_group()
    return 0


def _answer(op, body, handlers, loaded, scheduler, manager, model) -> dict:
    if op == "digests":
        return {
            name: hashlib.sha256(p.detach().reshape(-1).view(torch.uint8).numpy()).hexdigest()
            for name, p in model.by_name.items()
        }
    if op == "state":
        return {
            "paused": scheduler._engine_paused,
            "running": len(scheduler.running_batch.reqs),
            "waiting": len(scheduler.waiting_queue),
            "weight_version": scheduler.weight_version,
            "version_records": scheduler.version_records,
            "flushes": scheduler.flushes,
            "session_open": manager._session is not None,
            "loaded": len(model.loaded),
            "groups": list(model_groups(handlers)),
            "loader_calls": list(sglang_scheduler.DefaultModelLoader.calls),
        }
    if op == "finish_running":
        return {"finished": scheduler.finish_running()}
    if op == "requeue":  # the scheduler's loop: waiting requests run, the batch holds `body`
        scheduler.waiting_queue = []
        scheduler.running_batch.reqs = [Req(f"gen-{i}") for i in range(body)]
        return {}
    if op == "admit":  # a generation admitted while no update holds the lock
        scheduler.running_batch.reqs.append(Req("admitted"))
        return {"loaded": len(model.loaded), "weight_version": scheduler.weight_version}
    if op == "flush_cache":
        return {"success": scheduler.flush_cache()}
    struct = getattr(loaded.io_struct, STRUCTS[op])
    request = pydantic.TypeAdapter(struct).validate_python(body or {})
    if op == "begin_weight_update":
        model.loaded = []
    state = {"paused": scheduler._engine_paused, "running": len(scheduler.running_batch.reqs)}
    out = handlers[op](request)
    reply = {"before": state}
    if out is not None:
        reply.update(success=getattr(out, "success", True), message=getattr(out, "message", ""))
    return reply


def model_groups(handlers) -> list[str]:
    updater = handlers["init_weights_update_group"].__self__.tp_worker.model_runner.weight_updater
    return list(updater._model_update_group)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
