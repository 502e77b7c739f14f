"""`make gpu-check`: rayfree on this machine's NVIDIA GPUs, in under five minutes; on a machine without one it
says so and exits 0 having run nothing.

What it runs (docs/gpu.md): the toy engine through MultiprocExecutor at TP=1 and, with two or more GPUs, TP=2,
on CUDA (its tensors over NCCL device groups, its control plane over gloo), checked against the one-process
reference; an NCCL all-reduce on the world's device group; per-step latency against the same run on the CPU;
with two GPUs, DP=2 coupled replicas whose all-reduce across them runs on NCCL groups made on the store, as at
every shrink and grow; and, as root, two simulated nodes (network namespaces) sharing the GPUs, one GPU each.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

STEPS = 200


def cuda_devices() -> int:
    """How many GPUs CUDA sees, asked in a child (this process must not initialise CUDA: its workers would
    inherit a broken context)."""
    from rayfree import settings
    from rayfree.cluster.devices import Topology

    if not Topology.read(settings.get("RAYFREE_TOPOLOGY_ROOT")).gpus:
        return 0
    code = "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    return int(out.stdout.strip() or 0) if out.returncode == 0 else 0


def nccl_all_reduce(worker) -> tuple[str, float]:
    import torch
    import torch.distributed as dist

    from rayfree.cluster.parallel_state import get_world_group

    g = get_world_group()
    t = torch.ones(1, device=worker.device) * (worker.rank + 1)
    dist.all_reduce(t, group=g.device_group)
    return dist.get_backend(g.device_group), float(t.item())


def run(tp: int, gpu: bool) -> list[float]:
    """Per-step seconds of STEPS toy steps at `tp`, on the GPUs or the CPU; the tokens checked on each."""
    from rayfree import ClusterConfig, MultiprocExecutor, ParallelConfig
    from rayfree.cli.toy_engine import make_batch, reference_forward

    saved = os.environ.get("CUDA_VISIBLE_DEVICES")
    if not gpu:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the same engine on the CPU path
    try:
        config = ClusterConfig(parallel=ParallelConfig(tensor_parallel_size=tp), numa_bind="auto" if gpu else "none")
        with MultiprocExecutor(config, "rayfree.cli.toy_engine:ToyWorker") as ex:
            if gpu:
                backend, total = ex.collective_rpc(nccl_all_reduce, timeout=120)[0]
                assert backend == "nccl" and total == tp * (tp + 1) / 2, (backend, total)
                print(f"  TP={tp}: NCCL all-reduce on the device group beside gloo's control plane: ok")
            times = []
            for step in range(STEPS):
                batch = make_batch(step)
                t0 = time.perf_counter()
                ex.collective_rpc("execute_model", args=(batch,), timeout=120)
                tokens = ex.collective_rpc("sample_tokens", timeout=120, unique_reply_rank=0)
                times.append(time.perf_counter() - t0)
                want = reference_forward(batch["x"]).argmax(dim=-1).tolist()
                assert tokens == want, (step, tokens, want)
        return times
    finally:
        if saved is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = saved


def across_halves(worker) -> str:
    """The backend of the device half of this rank's DP group across coupled replicas (NCCL on a GPU)."""
    import torch.distributed as dist

    from rayfree.cluster.parallel_state import get_dp_group

    return str(dist.get_backend(get_dp_group().device_group))


def coupled(gpu: bool) -> None:
    """DP=2 coupled replicas of TP=1 on this node (one GPU each): the toy's all-reduce across replicas runs on their
    groups across replicas' device half, made on the rendezvous store as at every shrink and grow; both replicas
    step side by side (the all-reduce needs both), every output and every sum across replicas checked."""
    import threading

    from rayfree import ClusterConfig, NodeReplicas, ParallelConfig
    from rayfree.cli.toy_engine import dp_sum, make_batch, reference_forward
    from rayfree.transport import get_open_port

    saved = os.environ.get("CUDA_VISIBLE_DEVICES")
    if not gpu:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    par = ParallelConfig(data_parallel_size=2, replica_coupling="coupled", master_port=get_open_port("127.0.0.1"))
    reps = NodeReplicas(
        ClusterConfig(parallel=par, numa_bind="auto" if gpu else "none"), "rayfree.cli.toy_engine:ToyWorker"
    )
    wrong: list = []
    try:
        kinds = {ex.dp_rank: ex.collective_rpc(across_halves, timeout=120)[0] for ex in reps.leaders}

        def steps(ex) -> None:
            for step in range(20):
                batch = make_batch(step, replica=ex.dp_rank)
                out = ex.execute_model(batch)
                total = ex.collective_rpc("step_report", unique_reply_rank=0, timeout=120)["dp_sum"]
                if not (torch_equal(out, reference_forward(batch["x"])) and total == dp_sum(step, 2)):
                    wrong.append((ex.dp_rank, step))

        threads = [threading.Thread(target=steps, args=(ex,)) for ex in reps.leaders]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
    finally:
        reps.shutdown()
        if saved is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = saved
    assert not wrong and not any(t.is_alive() for t in threads), wrong
    if gpu:
        assert set(kinds.values()) == {"nccl"}, kinds
    print(f"  DP=2 coupled replicas: 20 steps each, the all-reduce across them on {kinds[0]}, every sum right")


def torch_equal(a, b) -> bool:
    import torch

    return a is not None and torch.equal(a, b)


def two_nodes(n_gpus: int) -> None:
    from rayfree.testing import simulated_cluster

    per_node = {k: {"CUDA_VISIBLE_DEVICES": str(k % n_gpus)} for k in range(2)}  # (ignored on a node without GPUs)
    with simulated_cluster(
        2,
        worker="rayfree.cli.toy_engine:ToyWorker",
        entry="bench.gpu_check_entries:drive",
        tp=2,
        cwd=ROOT,
        node_env=per_node,
    ) as c:
        codes = c.wait(timeout=180)
        assert codes == [0, 0] and "20 steps checked" in c.nodes[0].text(), c.output()
    print("  two simulated nodes, TP=2 across them, one GPU each: 20 steps, tokens equal the reference")


def replicas_on_one_gpu() -> None:
    """Two simulated nodes as two independent DP replicas of TP=1, both on GPU 0 (no NCCL between them: a world
    each): replica 1's node is killed while replica 0 steps, and started again it rejoins in epoch 1."""
    import json

    from rayfree.testing import simulated_cluster

    t0 = time.monotonic()
    one = {k: {"CUDA_VISIBLE_DEVICES": "0"} for k in range(2)}  # (ignored on a node without GPUs)
    with simulated_cluster(
        2, worker="rayfree.cli.toy_engine:ToyWorker", entry="bench.gpu_check_entries:replica_steps", dp=2, cwd=ROOT,
        node_env=one, env={"RAYFREE_LOG_LEVEL": "INFO"},
    ) as c:  # fmt: skip
        for node in c.nodes:
            node.expect(r"^STEPPING:", 180)
        t_kill = time.monotonic()
        c.nodes[1].kill()
        c.nodes[0].expect(r"DP replica 1 was lost", 60)
        lost = time.monotonic() - t_kill
        again = c.restart(1)
        r1 = json.loads(again.expect(r"^RESULT:(.*)$", 180).group(1))
        r0 = json.loads(c.nodes[0].expect(r"^RESULT:(.*)$", 180).group(1))
        codes = c.wait(timeout=120)
    assert codes == [0, 0] and r1["epoch"] == 1 and r1["steps"] == 20, (codes, r1, c.output())
    assert "1:lost:0" in r0["seen"] and "1:serving:1" in r0["seen"], r0
    print(
        f"  two simulated nodes as DP=2 replicas of TP=1 sharing one GPU: replica 1's node killed, known lost "
        f"after {lost:.2f}s while replica 0 stepped on ({r0['steps']} steps, tokens checked, none failed); started "
        f"again it rejoined in epoch 1 (20 steps); {time.monotonic() - t0:.0f}s"
    )


def hf_worker_class():  # noqa: ANN201 - the class is made where transformers imports
    from rayfree import WorkerBase

    class HfLlamaWorker(WorkerBase):
        """A tiny random Hugging Face Llama, one step a call: the next token for each sequence (greedy), and the
        worker's own compute time for it (the step's cost outside it is the call's wall time minus this)."""

        def load_model(self) -> None:
            from transformers import LlamaForCausalLM

            self.model = LlamaForCausalLM.from_pretrained(self.kwargs["path"]).to(self.device).eval()

        def execute_model(self, ids):  # noqa: ANN001, ANN201
            import torch

            t0 = time.perf_counter()
            with torch.no_grad():
                logits = self.model(ids.to(self.device)).logits[:, -1]
                nxt = logits.argmax(dim=-1, keepdim=True)
            if nxt.is_cuda:
                torch.cuda.synchronize()
            return nxt.cpu(), time.perf_counter() - t0

        def cuda_tensor(self):  # noqa: ANN201
            import torch

            return torch.arange(4, device=self.device) * (self.rank + 1)

    return HfLlamaWorker


def hf_llama(gpu: bool, steps: int = 32) -> None:
    """A tiny random Llama (transformers, made here) through MultiprocExecutor at TP=1: greedy tokens equal to
    generate() in one process; per step, the cost outside the worker (the call's wall time minus the worker's own
    compute), p50 and p99, beside a direct call of the same step in one process; a CUDA tensor returned."""
    try:
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError:
        print("  tiny Llama: transformers is not installed here: skipped")
        return
    import tempfile

    from rayfree import ClusterConfig, MultiprocExecutor, ParallelConfig

    with tempfile.TemporaryDirectory(prefix="rayfree-gpu-check-llama-") as d:
        torch.manual_seed(0)
        cfg = LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                          num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128)  # fmt: skip
        LlamaForCausalLM(cfg).save_pretrained(d)
        prompt = torch.tensor([[1, 5, 9, 17, 33, 2, 7, 11]])
        device = "cuda" if gpu else "cpu"
        ref = LlamaForCausalLM.from_pretrained(d).to(device).eval()
        with torch.no_grad():
            want = ref.generate(prompt.to(device), max_new_tokens=steps, do_sample=False)[0, prompt.shape[1] :]
        direct = []
        ids = prompt.to(device)
        with torch.no_grad():
            for _ in range(steps):
                t0 = time.perf_counter()
                nxt = ref(ids).logits[:, -1].argmax(dim=-1, keepdim=True)
                if gpu:
                    torch.cuda.synchronize()
                direct.append(time.perf_counter() - t0)
                ids = torch.cat([ids, nxt], dim=1)
        del ref
        config = ClusterConfig(parallel=ParallelConfig(tensor_parallel_size=1), device=device)
        outside, got = [], []
        with MultiprocExecutor(config, hf_worker_class(), {"path": d}) as ex:
            ids = prompt
            for _ in range(steps):
                t0 = time.perf_counter()
                nxt, inside = ex.collective_rpc("execute_model", args=(ids,), timeout=120, unique_reply_rank=0)
                outside.append(time.perf_counter() - t0 - inside)
                got.append(int(nxt[0, 0]))
                ids = torch.cat([ids, nxt], dim=1)
            t = ex.collective_rpc("cuda_tensor", timeout=120, unique_reply_rank=0)
    assert got == want.cpu().tolist(), (got, want)
    assert str(t.device).startswith(device) and t.tolist() == [0, 1, 2, 3], t
    o, dr = sorted(outside[4:]), sorted(direct[4:])

    def pct(xs: list[float], q: float) -> float:
        return xs[min(len(xs) - 1, int(q * len(xs)))] * 1e6

    print(
        f"  tiny Llama (4 layers, hidden 256) on {device} through MultiprocExecutor: {steps} greedy tokens equal "
        f"generate()'s; per step outside the worker p50 {pct(o, 0.5):.0f} us, p99 {pct(o, 0.99):.0f} us (the "
        f"step itself in one process: p50 {pct(dr, 0.5):.0f} us); a {t.device} tensor returned by the worker"
    )


def _vllm(model: str, backend: str, mode: str, tp: int, gpu: bool) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "tests.support.vllm_engine", model, backend, mode, "--tp", str(tp)]
        + (["--gpu"] if gpu else []),
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, f"vLLM ({backend}, {mode}) failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out.stdout


def _tagged(out: str, tag: str) -> dict:
    import json

    line = next((ln for ln in out.splitlines() if ln.startswith(tag + ":")), None)
    assert line, f"no {tag} line:\n{out[-3000:]}"
    return json.loads(line[len(tag) + 1 :])


def vllm_compare(tp: int, gpu: bool = True) -> None:
    """With vLLM (CUDA build) installed: greedy tokens of a tiny local Llama through RayfreeExecutor and through
    vLLM's own mp executor (tests/support/vllm_engine.py, as `make test-vllm` runs it on CPUs), equal; then each
    engine's step time outside its workers (engine + executor; the workers timed by tests/support/vllm_timed_gpu.py),
    as `make bench-vllm` measures it on CPUs: medians of 5 rounds each."""
    probe = "import torch, vllm; print(torch.cuda.is_available())"
    has = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    if has.returncode != 0 or has.stdout.strip() != str(gpu):
        print("  vLLM with CUDA is not installed here: its comparison skipped")
        return
    import tempfile

    with tempfile.TemporaryDirectory(prefix="rayfree-gpu-check-") as d:
        model = os.path.join(d, "tiny-llama")
        subprocess.run(
            [sys.executable, "-m", "tests.support.vllm_tiny_model", model], cwd=ROOT, check=True, timeout=300
        )
        tokens = {b: _tagged(_vllm(model, b, "generate", tp, gpu), "TOKENS")["calls"] for b in ("mp", "rayfree")}
        assert tokens["mp"] == tokens["rayfree"], tokens
        print(f"  vLLM TP={tp}: RayfreeExecutor's tokens equal vLLM's mp executor's")
        rounds: dict[str, list[dict]] = {"mp": [], "rayfree": []}
        for backend in ("mp", "rayfree"):  # (five rounds each; a vLLM start costs more than the rounds)
            rounds[backend] += _tagged(_vllm(model, backend, "bench", tp, gpu), "BENCH")["rounds"]
    med = {b: {k: statistics.median(r[k] for r in rs) for k in ("step_us", "outside_us")} for b, rs in rounds.items()}
    print(
        f"  vLLM TP={tp}, per step (p50 of {len(rounds['mp'])} rounds): outside the workers "
        f"{med['rayfree']['outside_us']:.0f} us with rayfree vs {med['mp']['outside_us']:.0f} us with mp "
        f"({med['rayfree']['outside_us'] / med['mp']['outside_us']:.2f}x); whole step "
        f"{med['rayfree']['step_us']:.0f} vs {med['mp']['step_us']:.0f} us"
    )


def main() -> int:
    t0 = time.monotonic()
    if "--vllm-on-cpu" in sys.argv:  # the vLLM comparison's plumbing, with vLLM's CPU build (by hand: minutes)
        vllm_compare(2, gpu=False)
        return 0
    if "--on-cpu" in sys.argv:  # the script's own plumbing, on the CPU path (its test runs this)
        global STEPS
        STEPS = 30
        print(f"gpu-check --on-cpu: TP=2 per step p50 {statistics.median(run(2, False)) * 1e6:.0f} us")
        coupled(False)
        hf_llama(False, steps=8)
        two_nodes(1)  # (network namespaces where root and `ip` are here; else loopback, said so)
        replicas_on_one_gpu()
        return 0
    n = cuda_devices()
    if n == 0:
        print("gpu-check: no NVIDIA GPU on this machine (the driver lists none, or CUDA sees none): nothing run")
        return 0
    print(f"gpu-check: {n} GPU(s)")
    for tp in [1, 2] if n >= 2 else [1]:
        gpu, cpu = run(tp, True), run(tp, False)
        g, c = statistics.median(gpu[20:]) * 1e6, statistics.median(cpu[20:]) * 1e6
        print(f"  TP={tp}: per step (execute + sample, p50) {g:.0f} us on CUDA, {c:.0f} us on the CPU path")
    hf_llama(True)
    if n >= 2:
        coupled(True)
    two_nodes(n) if n >= 2 else replicas_on_one_gpu()  # (TP=2 across two nodes needs a GPU each: NCCL)
    vllm_compare(min(n, 2))
    print(f"gpu-check: done in {time.monotonic() - t0:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
