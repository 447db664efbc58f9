"""Run by the two-node test: two torchrun agents on this machine (``--nnodes 2``, 2 ranks each)
train the fixture zoo with ``shard_size=2`` (shard within a node, replicate across nodes) and
compare with single-process torch AdamW; each rank writes what it found to ``out/rank-<r>.pt``."""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

import zfunc
from tests.helpers import max_param_diff, reference_run, zfunc_run


def main() -> None:
    out, stage = sys.argv[1], int(sys.argv[2])
    cfg = zfunc.Config(stage=stage, grad_accum=2, clip=1.0, shard_size=2,
                       optimizer=zfunc.adamw(lr=1e-2, weight_decay=0.01))
    state, norms = zfunc_run(int(os.environ["RANK"]), "zoo", 4, cfg)
    ref, ref_norms = reference_run("zoo", dist.get_world_size(), 4, grad_accum=2, clip=1.0)
    nodes = zfunc.comm.all_gather_object(os.environ["GROUP_RANK"], state.mesh.shard)  # the agent of each rank
    torch.save({"diff": max_param_diff(state, ref), "norms": norms, "ref_norms": ref_norms,
                "world": dist.get_world_size(), "shard_nodes": nodes, "shard": state.layout.world},
               os.path.join(out, f"rank-{dist.get_rank()}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
