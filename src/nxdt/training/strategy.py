"""NxdtStrategy: Lightning's ModelParallelStrategy with nxdt's own DeviceMesh.

Lightning's ModelParallelStrategy already does what we need and nothing we don't: it starts
the process group (gloo on CPU, NCCL on CUDA), does not wrap the model (the LightningModule's
`configure_model` applies parallelism), and saves checkpoints with torch.distributed.checkpoint.
Its own mesh is 2-D (data_parallel, tensor_parallel); we pass it a consistent (world // tp, tp)
split so its checks pass, then replace the mesh with nxdt's 5-D one
(pp, dp_replicate, dp_shard, cp, tp) — see `nxdt.parallel.mesh`.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.strategies import ModelParallelStrategy

from nxdt.parallel.mesh import MeshShape, build_mesh, dp_rank_and_size


class NxdtStrategy(ModelParallelStrategy):
    def __init__(self, mesh_shape: MeshShape, **kwargs: Any) -> None:
        super().__init__(
            data_parallel_size=mesh_shape.world_size // mesh_shape.tp,
            tensor_parallel_size=mesh_shape.tp,
            save_distributed_checkpoint=True,
            **kwargs,
        )
        self.mesh_shape = mesh_shape

    def setup_environment(self) -> None:
        super().setup_environment()  # process group + Lightning's 2-D mesh
        self._device_mesh = build_mesh(self.mesh_shape, self.root_device.type)
        assert self.lightning_module is not None
        self.lightning_module._device_mesh = self._device_mesh

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
