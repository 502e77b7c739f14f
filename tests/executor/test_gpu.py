"""On real GPUs (`@pytest.mark.gpus(n)`: skipped, with the reason, where CUDA sees fewer): the toy engine on
CUDA through MultiprocExecutor, a CUDA tensor returned by a worker, and TP=2 over NCCL beside gloo. The same
suite runs on 0, 1 and N GPUs; everything else in it is about no GPU in particular (`make test-topologies`)."""

from __future__ import annotations

import pytest

from rayfree import ClusterConfig, MultiprocExecutor, ParallelConfig

TOY = "rayfree.cli.toy_engine:ToyWorker"


def cuda_tensor(worker):
    import torch

    return torch.arange(4, device=worker.device) * (worker.rank + 1)


def nccl_sum(worker) -> tuple[str, float]:
    import torch
    import torch.distributed as dist

    from rayfree.cluster.parallel_state import get_tp_group

    g = get_tp_group()
    t = torch.ones(1, device=worker.device) * (worker.rank + 1)
    dist.all_reduce(t, group=g.device_group)
    return dist.get_backend(g.device_group), float(t.item())


@pytest.mark.gpus(1)
@pytest.mark.timeout(300)
def test_the_toy_engine_runs_on_cuda_and_a_worker_returns_a_cuda_tensor() -> None:
    from rayfree.cli.toy_engine import make_batch, reference_forward

    config = ClusterConfig(parallel=ParallelConfig(tensor_parallel_size=1), device="cuda")
    with MultiprocExecutor(config, TOY) as ex:
        for step in range(5):
            batch = make_batch(step)
            ex.collective_rpc("execute_model", args=(batch,), timeout=120)
            tokens = ex.collective_rpc("sample_tokens", timeout=120, unique_reply_rank=0)
            assert tokens == reference_forward(batch["x"]).argmax(dim=-1).tolist(), step
        t = ex.collective_rpc(cuda_tensor, timeout=120, unique_reply_rank=0)
    assert t.device.type == "cuda" and t.tolist() == [0, 1, 2, 3], t


@pytest.mark.gpus(2)
@pytest.mark.timeout(300)
def test_tp2_sums_over_nccl_beside_the_gloo_control_plane() -> None:
    config = ClusterConfig(parallel=ParallelConfig(tensor_parallel_size=2), device="cuda")
    with MultiprocExecutor(config, TOY) as ex:
        got = ex.collective_rpc(nccl_sum, timeout=120)
    assert got == [("nccl", 3.0), ("nccl", 3.0)], got
