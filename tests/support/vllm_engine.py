"""vLLM's engine in a process of its own, for tests/vllm/test_vllm.py and bench/vllm.py: prints `TAG:{json}` lines.

    python -m tests.support.vllm_engine MODEL BACKEND MODE [--tp 2]

BACKEND: mp (vLLM's own executor) or rayfree. MODE:
- generate: greedy tokens of PROMPTS, twice (the second call reuses the engine)
- kill-worker: steps requests, SIGKILLs the worker of TP rank 1 between two steps, reports when and how
  the engine failed
- wait-kill: steps requests, says STEPPING and steps on until the engine fails (the test takes a node)
- bench: with vLLM's worker timed (tests/support/vllm_timed.py), a warm-up, then greedy generation of --prompts
  prompts x --tokens tokens; reports tokens/s and the step time outside the workers
Rayfree across nodes reads RAYFREE_* from the environment, as any engine on rayfree does.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from typing import Any

PROMPTS = ["w1 w2 w3 w4", "w10 w20 w30", "w5 w5 w5 w5 w5"]
#: how long vLLM's client gives its engine process to stop before it kills it
SHUTDOWN_S = 30.0
#: what the engines need on this CPU-only machine (see docs/vllm.md)
ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}


def say(tag: str, **kw: Any) -> None:
    sys.stdout.write(f"{tag}:" + json.dumps(kw) + "\n")  # one write: no log line lands inside it
    sys.stdout.flush()


def make_llm(model: str, backend: str, tp: int, **extra: Any):
    """The engine; mp across nodes takes vLLM's own nnodes/node_rank/master_* (VLLM_NNODES etc. here)."""
    from vllm import LLM

    if backend == "rayfree":
        from rayfree.integrations.vllm import RayfreeExecutor

        backend = RayfreeExecutor  # type: ignore[assignment]
    return LLM(
        model=model,
        tensor_parallel_size=tp,
        distributed_executor_backend=backend,
        enforce_eager=True,
        dtype="float32",
        max_model_len=256,
        max_num_seqs=8,
        seed=0,
        **extra,
    )


def greedy(llm: Any, prompts: list[str], max_tokens: int = 16) -> list[list[int]]:
    """The greedy tokens `llm` generates for each prompt."""
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=max_tokens)
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, sp, use_tqdm=False)]


def engine_args(model: str) -> dict[str, Any]:
    """The same engine arguments, for a `rayfree node --headless` follower's --worker-kwargs."""
    return {
        "model": model,
        "enforce_eager": True,
        "dtype": "float32",
        "max_model_len": 256,
        "max_num_seqs": 8,
        "seed": 0,
    }


def _children(pid: int) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(d))
            except (OSError, IndexError, ValueError):
                continue
    return out


def _title(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def _descendants(pid: int) -> list[int]:
    todo, seen = [pid], []
    while todo:
        kids = _children(todo.pop())
        seen += kids
        todo += kids
    return seen


TIMED_WORKER = "tests.support.vllm_timed.TimedCPUWorker"
TIMED_GPU_WORKER = "tests.support.vllm_timed_gpu.TimedGPUWorker"
ROUNDS = 5


def _bench(llm, n_prompts: int, n_tokens: int) -> dict[str, Any]:
    from vllm import SamplingParams

    prompts = [" ".join(f"w{(7 * i + j) % 990 + 3}" for j in range(8)) for i in range(n_prompts)]
    sp = SamplingParams(temperature=0, max_tokens=n_tokens, ignore_eos=True)
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)  # warm-up
    rounds = []
    for _ in range(ROUNDS):
        llm.collective_rpc("bench_reset")
        t = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        wall = time.perf_counter() - t
        timing = min(llm.collective_rpc("bench_timing"), key=lambda x: x["rank"])  # rank 0: the output rank
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        steps = timing["steps"]
        rounds.append(
            {
                "tokens": tokens,
                "wall_s": wall,
                "tokens_per_s": tokens / wall,
                "steps": steps,
                "step_us": wall / steps * 1e6,
                "model_us": timing["model_s"] / steps * 1e6,
                "outside_us": (wall - timing["model_s"]) / steps * 1e6,
            }
        )
    return {"rounds": rounds}


def _step_until_dead(llm, t0: float, limit_s: float = 60.0) -> dict[str, Any]:
    """Step the engine until it raises; how long after t0, and what."""
    engine = llm.llm_engine
    steps = 0
    while time.monotonic() - t0 < limit_s:
        try:
            engine.step()
        except Exception as e:  # noqa: BLE001 - what the engine raises is the result
            return {
                "after_s": time.monotonic() - t0,
                "error": type(e).__name__,
                "message": str(e)[:500],
                "steps": steps,
            }
        steps += 1
        if not engine.has_unfinished_requests():
            _add(llm, 1000 + steps)
    return {"after_s": None, "error": "", "message": "still running", "steps": steps}


def _add(llm, n: int) -> None:
    from vllm import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    for i, p in enumerate(PROMPTS):
        llm.llm_engine.add_request(f"r{n}-{i}", p, sp)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("backend", choices=["mp", "rayfree"])
    ap.add_argument("mode", choices=["generate", "kill-worker", "wait-kill", "bench"])
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--pp", type=int, default=1, help="pipeline-parallel size")
    ap.add_argument("--async-scheduling", action="store_true", help="vLLM's async scheduling (steps overlap)")
    ap.add_argument("--nnodes", type=int, default=1, help="mp only: vLLM's own multi-node (node 0 here)")
    ap.add_argument("--master-addr", default="127.0.0.1")
    ap.add_argument("--master-port", type=int, default=29500)
    ap.add_argument("--gpu", action="store_true", help="vLLM's CUDA build on GPUs (bench/gpu_check.py)")
    a = ap.parse_args()
    for k, v in ENV.items():
        if not a.gpu or k == "HF_HUB_OFFLINE":  # (the rest is for vLLM's CPU build)
            os.environ.setdefault(k, v)
    t = time.monotonic()
    extra: dict[str, Any] = {}
    if a.mode == "bench":
        extra.update(worker_cls=TIMED_GPU_WORKER if a.gpu else TIMED_WORKER, async_scheduling=False)
    if a.async_scheduling:
        extra["async_scheduling"] = True
    if a.pp > 1:
        extra["pipeline_parallel_size"] = a.pp
    if a.nnodes > 1:
        extra.update(nnodes=a.nnodes, node_rank=0, master_addr=a.master_addr, master_port=a.master_port)
    llm = make_llm(a.model, a.backend, a.tp, **extra)
    say("READY", start_s=time.monotonic() - t, pid=os.getpid())
    if a.mode == "bench":
        say("BENCH", **_bench(llm, a.prompts, a.tokens))
    elif a.mode == "generate":
        from vllm import SamplingParams

        sp = SamplingParams(temperature=0, max_tokens=16)
        calls = [[o.outputs[0].token_ids for o in llm.generate(PROMPTS, sp, use_tqdm=False)] for _ in range(2)]
        say("TOKENS", calls=[[list(ids) for ids in c] for c in calls])
    else:
        _add(llm, 0)
        llm.llm_engine.step()  # requests in flight: generation has begun
        if a.mode == "kill-worker":
            workers = [p for p in _descendants(os.getpid()) if "Worker_TP1" in _title(p)]
            assert len(workers) == 1, (
                f"no single TP1 worker among {[(p, _title(p)) for p in _descendants(os.getpid())]}"
            )
            t0 = time.monotonic()
            os.kill(workers[0], signal.SIGKILL)
            say("DEAD", victim=workers[0], **_step_until_dead(llm, t0))
        else:
            say("STEPPING", t=time.monotonic())
            r = _step_until_dead(llm, time.monotonic())
            say("DEAD", t_dead=time.monotonic(), **r)
    try:  # vLLM's default deadline for its engine process is 5 s, which a starved CI machine can miss
        llm.llm_engine.engine_core.shutdown(timeout=SHUTDOWN_S)
    except Exception:  # noqa: BLE001 - a dead engine may already be gone
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
