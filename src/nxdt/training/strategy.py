"""NxdtStrategy: Lightning's ModelParallelStrategy with nxdt's own DeviceMesh.

Lightning's ModelParallelStrategy already does what we need and nothing we don't: it starts
the process group (gloo on CPU, NCCL on CUDA; nxdt passes TorchNeuron's `neuron` backend on its
native device), does not wrap the model (the LightningModule's
`configure_model` applies parallelism), and saves checkpoints with torch.distributed.checkpoint.
Its own mesh is 2-D (data_parallel, tensor_parallel); we pass it a consistent (world // tp, tp)
split so its checks pass, then replace the mesh with nxdt's 5-D one
(pp, dp_replicate, dp_shard, cp, tp) — see `nxdt.parallel.mesh`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.strategies import ModelParallelStrategy

from nxdt.checkpoint.checkpointer import Checkpointer, load_checkpoint, use_xser
from nxdt.checkpoint.rank_state import ResumedLoader, batches_done_in_epoch

from nxdt.device import device_count, memory_stats, process_group_backend, set_device
from nxdt.parallel.mesh import build_mesh, dp_rank_and_size
from nxdt.spec.layout import Layout


class NeuronAccelerator(Accelerator):
    """Lightning's accelerator for TorchNeuron's native `neuron` device (trainer.accelerator neuron
    where torch_neuronx provides it: nxdt.device.neuron_device). Lightning has none of its own; the
    device calls are nxdt.device's, by device type (torch.accelerator)."""

    def setup_device(self, device: torch.device) -> None:
        if device.type != "neuron":
            raise ValueError(f"NeuronAccelerator: expected a neuron device, got {device}")
        set_device(device.index or 0)

    def teardown(self) -> None:
        pass

    def get_device_stats(self, device: Any) -> dict[str, Any]:
        return memory_stats(torch.device(device))

    @staticmethod
    def parse_devices(devices: Any) -> list[int]:
        if isinstance(devices, list):
            return [int(d) for d in devices]
        count = device_count() if str(devices) in ("auto", "-1") else int(devices)
        return list(range(count))

    @staticmethod
    def get_parallel_devices(devices: Any) -> list[torch.device]:
        return [torch.device("neuron", i) for i in devices]

    @staticmethod
    def auto_device_count() -> int:
        return device_count()

    @staticmethod
    def is_available() -> bool:
        return device_count() > 0

    @staticmethod
    def name() -> str:
        return "neuron"


def native_neuron_strategy(mesh_shape: Layout) -> "NxdtStrategy":
    """NxdtStrategy on TorchNeuron's native device: the process group on its `neuron` backend."""
    return NxdtStrategy(mesh_shape, process_group_backend=process_group_backend("neuron"))


class NxdtStrategy(ModelParallelStrategy):
    def __init__(self, mesh_shape: Layout, **kwargs: Any) -> None:
        super().__init__(
            data_parallel_size=mesh_shape.world_size // mesh_shape.tp,
            tensor_parallel_size=mesh_shape.tp,
            save_distributed_checkpoint=True,
            **kwargs,
        )
        self.mesh_shape = mesh_shape
        # nxdt.training.evaluate runs trainer.validate, then trainer.test, on one model: between
        # the two, the process group, the mesh the model was parallelized on and the model's device
        # stay as they are (Lightning would tear them down after each); `release()` ends them.
        self.keep_alive = False
        self._nxdt_mesh = None  # the DeviceMesh this strategy built (what keep_alive keeps)

    def setup_environment(self) -> None:
        if self.keep_alive and dist.is_initialized() and self._nxdt_mesh is not None:
            self.accelerator.setup_device(self.root_device)
            self._device_mesh = self.lightning_module._device_mesh = self._nxdt_mesh
            return
        # A process group the caller started (a notebook, a sweep driving several runs in one
        # process) is the caller's to end; one Lightning starts for this run is ours.
        self._owns_process_group = not dist.is_initialized()
        super().setup_environment()  # process group + Lightning's 2-D mesh
        self._device_mesh = self._nxdt_mesh = build_mesh(self.mesh_shape, self.root_device.type)
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = self._device_mesh

    def teardown(self) -> None:
        if self.keep_alive:
            return
        super().teardown()
        # Destroy every process group (the default one, the mesh's, the checkpointer's) while the
        # interpreter is still whole: left to interpreter exit, a gloo thread can abort a rank
        # ("terminate called without an active exception") after a successful run.
        if dist.is_initialized() and getattr(self, "_owns_process_group", True):
            dist.destroy_process_group()

    def release(self) -> None:
        """End what `keep_alive` kept: Lightning's teardown, and the process groups if this run started them."""
        self.keep_alive = False
        self.teardown()

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        rank, size = dp_rank_and_size(self.device_mesh)
        return {"num_replicas": size, "rank": rank}

    @property
    def dp_rank(self) -> int:
        return dp_rank_and_size(self.device_mesh)[0]

    @property
    def dp_size(self) -> int:
        return dp_rank_and_size(self.device_mesh)[1]

    # ---- checkpoints: written and read by nxdt.checkpoint.checkpointer (sharded DCP, atomic, maybe async) ----
    @property
    def checkpointer(self):
        if getattr(self, "_checkpointer", None) is None:
            exp = self.lightning_module.cfg.exp_manager
            self._checkpointer = Checkpointer(bool(exp.async_checkpointing),
                                              use_xser(exp.save_xser, self.root_device.type))
        return self._checkpointer

    def lightning_module_state_dict(self) -> dict[str, Any]:
        return {}  # model and optimizer tensors are collected by nxdt.checkpoint.checkpointer

    def optimizer_state(self, optimizer) -> dict[str, Any]:
        return {}

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Any = None) -> None:
        self.checkpointer.save(self, checkpoint, Path(filepath), self.lightning_module.cfg)

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(self.broadcast(str(checkpoint_path)))
        state = load_checkpoint(self, path, self.lightning_module.cfg)
        self._resume_skip = batches_done_in_epoch(state)
        return state

    def process_dataloader(self, dataloader: object) -> object:
        # After a resume, the first training loader starts at consumed_samples while Lightning
        # counts the epoch's batches from its start: make the two agree (see ResumedLoader).
        skip = getattr(self, "_resume_skip", 0)
        if skip and not self.lightning_module.trainer.sanity_checking:
            self._resume_skip = 0
            return ResumedLoader(dataloader, skip)
        return dataloader
