"""The device meshes the mesh strategies build (fsdp, fsdp_tp, pp, nd), every one in `loom.layout`'s
rank order (dp, pp, cp, tp: tensor-parallel peers consecutive). Lightning's own (data_parallel,
tensor_parallel) mesh serves plain fsdp / fsdp_tp; HSDP, expert and context parallelism and pipelines
build theirs here, each with a `data_parallel` dim (flattened where it spans several) that FSDP2
shards over. `loom plan --rehearse` builds the same meshes over torch's fake process group."""

from __future__ import annotations

from loom.layout import ParallelLayout


def hybrid_mesh(device_type: str, lay: ParallelLayout):
    """HSDP's (replicate, shard, tensor_parallel) mesh, (replicate, shard) flattened as data_parallel."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device_type, (lay.dp_replicate, lay.dp_shard, lay.tp),
                            mesh_dim_names=("replicate", "shard", "tensor_parallel"))
    mesh["replicate", "shard"]._flatten("data_parallel")
    return mesh


def context_mesh(device_type: str, lay: ParallelLayout):
    """Context parallelism's (dp, cp, tensor_parallel) mesh in `loom.layout`'s rank order, (dp, cp)
    flattened as data_parallel: FSDP2 shards over every rank holding other tokens (torchtitan's
    dp_shard_cp), and gradients average over them."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device_type, (lay.dp, lay.cp, lay.tp), mesh_dim_names=("dp", "cp", "tensor_parallel"))
    mesh["dp", "cp"]._flatten("data_parallel")
    return mesh


def mesh_of(device_type: str, lay: ParallelLayout):
    """The device mesh the strategy of `lay` builds (pp == 1): HSDP's, expert or context
    parallelism's, else Lightning's own (data_parallel, tensor_parallel) one. `loom plan
    --rehearse` builds it over a fake group."""
    if lay.hybrid:
        return hybrid_mesh(device_type, lay)
    if lay.cp > 1:
        return context_mesh(device_type, lay)
    if lay.ep > 1:
        return expert_mesh(device_type, lay)
    import torch
    from lightning_fabric.strategies.model_parallel import _setup_device_mesh

    return _setup_device_mesh(lay.dp, lay.tp, lay.world, torch.device(device_type))


def expert_mesh(device_type: str, lay: ParallelLayout):
    """Expert parallelism's (shard_mod_ep, ep, tensor_parallel) mesh: the data-parallel shard dim
    split into `ep` consecutive ranks that exchange tokens and hold different experts, and the
    ranks holding the same experts (`shard_mod_ep`, over which FSDP2 shards them); the two
    flattened back as data_parallel for everything else (torchtitan's dp_shard_mod_ep)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device_type, (lay.dp_shard // lay.ep, lay.ep, lay.tp),
                            mesh_dim_names=("shard_mod_ep", "ep", "tensor_parallel"))
    mesh["shard_mod_ep", "ep"]._flatten("data_parallel")
    return mesh


def pipeline_mesh(device_type: str, lay: ParallelLayout):
    """The (data_parallel, pipeline, tensor_parallel) mesh in `loom.layout`'s rank order; with
    dp_replicate > 1 data_parallel is (replicate, shard) flattened, FSDP2's HSDP mesh."""
    from torch.distributed.device_mesh import init_device_mesh

    if lay.cp > 1:  # (dp, cp) flattened: FSDP2 shards each stage over every rank holding other tokens
        mesh = init_device_mesh(device_type, (lay.dp, lay.pp, lay.cp, lay.tp),
                                mesh_dim_names=("dp", "pipeline", "cp", "tensor_parallel"))
        mesh["dp", "cp"]._flatten("data_parallel")
        return mesh
    if lay.dp_replicate == 1:
        return init_device_mesh(device_type, (lay.dp, lay.pp, lay.tp),
                                mesh_dim_names=("data_parallel", "pipeline", "tensor_parallel"))
    mesh = init_device_mesh(device_type, (lay.dp_replicate, lay.dp_shard, lay.pp, lay.tp),
                            mesh_dim_names=("replicate", "shard", "pipeline", "tensor_parallel"))
    mesh["replicate", "shard"]._flatten("data_parallel")
    return mesh
