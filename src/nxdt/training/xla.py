"""The torch-xla (Neuron / TPU / XLA:CPU) side of training: device, graph cuts, step closures, xser.

torch-xla is optional and lives in its own environment (`make test-xla` builds `.venv-xla` with
torch==2.9.0 + torch-xla==2.9.0); nothing here imports it at module import time.

The order of a run on XLA (interface §1, §7):
1. `nxdt.config.env.apply_env(cfg)` sets XLA_USE_BF16 / XLA_DOWNCAST_BF16 /
   NEURON_RT_STOCHASTIC_ROUNDING_EN / NEURON_CC_FLAGS and the Neuron knobs, never overwriting
   the user's, BEFORE torch / torch_xla is imported (they are read at import).
2. On XLA the precision env vars do the casting, so `Precision.from_spec(spec, on_xla=True)`
   leaves dtypes alone except for `autocast` (torch.autocast on the xla device) and fp16
   (loss-scaled fp16 copies); the NaN/inf guard runs in a step closure (no extra graph sync).
3. Each optimizer step ends with `mark_step()` (one graph per step); the module's per-step
   scalars go through `nxdt.observability.step_scalars.StepClosureLogger` (a step closure, run after the graph has executed),
   so logging adds no graph execution (tests/xla/test_xla_logging.py counts them).
4. Checkpoints go through the usual callback and nxdt.checkpoint's writer and reader (the strategy
   below borrows NxdtStrategy's checkpoint methods): DCP, or with `exp_manager.save_xser`
   torch_xla's serialization (nxdt.device's `save_xser` / `load_xser`: one file per tensor, loadable
   without the device that wrote them). Under SPMD the writer and reader take the SPMD planners
   (`dcp_planner`: each shard written once, read into place; docs/xla.md, "Checkpoints").
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.accelerators import XLAAccelerator
from lightning.pytorch.strategies import SingleDeviceXLAStrategy

from nxdt.checkpoint.rank_state import ResumedLoader
from nxdt.device import mark_step
from nxdt.parallel.mesh import build_mesh
from nxdt.parallel.xla_spmd import check_device_count, dcp_planner, is_spmd, process_layout, use_spmd
from nxdt.training.strategy import NxdtStrategy


def lightning_accelerator(cfg: Any):
    """Lightning's XLAAccelerator ('tpu') counts devices by asking the TPU runtime (and GCP's
    metadata server); this subclass asks torch-xla's PJRT runtime instead, so XLA:CPU, Neuron
    and TPU all work."""
    class NxdtXLAAccelerator(XLAAccelerator):
        @staticmethod
        def auto_device_count() -> int:
            import torch_xla.runtime as xr  # torch-xla is optional (its own torch build): only on XLA

            return xr.addressable_runtime_device_count()

        @staticmethod
        def parse_devices(devices: Any) -> int:  # the parent validates against the TPU count
            return int(devices) if str(devices) != "auto" else NxdtXLAAccelerator.auto_device_count()

        @staticmethod
        def get_parallel_devices(devices: Any) -> list:
            return [torch.device("xla", i) for i in range(int(devices))]

        @staticmethod
        def is_available() -> bool:
            try:
                return NxdtXLAAccelerator.auto_device_count() > 0
            except (ValueError, AssertionError, OSError, RuntimeError):
                return False

    return NxdtXLAAccelerator()


class NxdtXLAStrategy(SingleDeviceXLAStrategy):
    """Made by `build_xla_strategy` (below), which says what it is."""

    def __init__(self, layout: Any, spmd: bool) -> None:
        super().__init__(device=0)
        self.xla_layout, self.spmd = layout, spmd
        self.mesh_shape = process_layout(layout) if spmd else layout
        self._device_mesh = None

    def setup_environment(self) -> None:
        if self.spmd:
            check_device_count(self.xla_layout)
        super().setup_environment()
        if not dist.is_initialized():
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        self._device_mesh = build_mesh(self.mesh_shape, "cpu")
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = self._device_mesh

    def on_train_end(self) -> None:
        super().on_train_end()
        mark_step()  # runs the step closures still queued (StepClosureLogger: the last step's scalars)

    @property
    def device_mesh(self):
        return self._device_mesh

    @property
    def dp_rank(self) -> int:
        return 0

    @property
    def dp_size(self) -> int:
        return 1

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": 1, "rank": 0}

    # ---- checkpoints: nxdt.checkpoint's writer and reader, as on CPU/CUDA (NxdtStrategy's methods);
    # one process writes (Lightning's XLACheckpointIO is not used: nxdt.checkpoint writes the files)
    checkpointer = NxdtStrategy.checkpointer
    lightning_module_state_dict = NxdtStrategy.lightning_module_state_dict
    optimizer_state = NxdtStrategy.optimizer_state
    save_checkpoint = NxdtStrategy.save_checkpoint
    load_checkpoint = NxdtStrategy.load_checkpoint
    # the reader loads the model and optimizer itself (after setup: the model sharded, the
    # optimizer made), as under ModelParallelStrategy; Lightning restores the rest of the trainer state
    restore_checkpoint_after_setup = True
    lightning_restore_optimizer = False

    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        pass

    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        pass

    def dcp_planner(self, kind: str):
        """DCP's planner for a save or load ('save' / 'load'): torch-xla's SPMD planners under SPMD
        (the tensors are sharded XLA tensors), DCP's default on one device."""
        return dcp_planner(kind) if self.spmd else None

    def process_dataloader(self, dataloader: object) -> object:
        # torch-xla's MpDeviceLoader (Lightning's), and after a resume NxdtStrategy's ResumedLoader around it
        loader = super().process_dataloader(dataloader)
        skip = getattr(self, "_resume_skip", 0)
        if skip and not self.lightning_module.trainer.sanity_checking:
            self._resume_skip = 0
            return ResumedLoader(loader, skip)
        return loader


def build_xla_strategy(layout: Any) -> NxdtXLAStrategy:
    """A Lightning strategy for one XLA device with nxdt's DeviceMesh bookkeeping.

    Lightning's `SingleDeviceXLAStrategy` runs the device, wraps the data loader with torch-xla's
    MpDeviceLoader and, through its XLA precision plugin, ends every optimizer step with a
    mark_step. nxdt's module and data modules also read a DeviceMesh (dp rank/size, collectives
    over mesh axes): on one device every axis has size 1, so a world-size-1 gloo group and a CPU
    mesh give them the same answers as on CPU without any collective touching the device.
    Several XLA devices (`layout` spans more than one) are one SPMD process (docs/xla.md): torch-xla
    is switched to SPMD before the device is touched, the mesh above is the one-process mesh (every
    axis 1: the module's collectives are no-ops), and the module applies the plan as shardings
    (nxdt.parallel.xla_spmd).
    """
    spmd = is_spmd(layout)
    if spmd:
        use_spmd()  # before any XLA tensor exists
    return NxdtXLAStrategy(layout, spmd)
