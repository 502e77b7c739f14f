"""A Hugging Face Llama, tensor-parallel across rayfree's workers, two ways (docs/workers.md walks through it):

- ``auto``: `from_pretrained(path, tp_plan="auto")`. transformers finds the world from RANK / LOCAL_RANK /
  WORLD_SIZE, which every rayfree worker carries for the world it joined; this works when the world is the TP
  group (no DP, no PP).
- ``mesh``: a DeviceMesh built from the worker's own TP group, and the model's plan (`base_model_tp_plan`)
  applied with torch's `parallelize_module`: works inside any shape (DP replicas, pipeline stages).

    python examples/hf_llama_tp.py [auto|mesh] [TP]    # needs transformers and accelerate

It builds a tiny random Llama, saves it, generates greedily with the one-process model and with TP ranks,
and prints whether the tokens are equal and how each rank's attention weight was split.
"""

from __future__ import annotations

import sys
import tempfile

import torch

from rayfree import ClusterConfig, MultiprocExecutor, ParallelConfig, WorkerBase, get_tp_group

PROMPT = [[1, 5, 9, 17]]


def save_tiny_llama(path: str) -> torch.nn.Module:
    """A random two-layer Llama (4 attention heads, 2 KV heads), saved to `path`; the unsharded model."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(path)
    return model


class HFLlamaWorker(WorkerBase):
    def load_model(self) -> None:
        from transformers import LlamaForCausalLM

        path, how = self.kwargs["path"], self.kwargs.get("how", "mesh")
        if how == "auto":  # the world is the TP group: transformers reads it from the environment
            self.model = LlamaForCausalLM.from_pretrained(path, tp_plan="auto")
        else:  # the TP group's own mesh, whatever else the world holds
            from torch.distributed.device_mesh import DeviceMesh
            from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

            mesh = DeviceMesh.from_group(get_tp_group().device_group, "cpu")
            self.model = LlamaForCausalLM.from_pretrained(path)
            styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
            plan = {f"model.{name}": styles[s]() for name, s in self.model.config.base_model_tp_plan.items()}
            parallelize_module(self.model, mesh, plan)
        self.model.eval()

    def q_proj_shape(self) -> tuple[int, ...]:
        """This rank's part of the first attention layer's query weight (half of it at TP=2)."""
        w = self.model.model.layers[0].self_attn.q_proj.weight
        return tuple(getattr(w, "_local_tensor", w).shape)

    def generate(self, ids: torch.Tensor, new_tokens: int = 8) -> list[list[int]]:
        with torch.no_grad():
            return self.model.generate(ids, max_new_tokens=new_tokens, do_sample=False).tolist()


def main(how: str = "mesh", tp: int = 2) -> dict:
    with tempfile.TemporaryDirectory() as path:
        reference = save_tiny_llama(path)
        ids = torch.tensor(PROMPT)
        with torch.no_grad():
            want = reference.generate(ids, max_new_tokens=8, do_sample=False).tolist()
        config = ClusterConfig(parallel=ParallelConfig(tensor_parallel_size=tp))
        with MultiprocExecutor(config, HFLlamaWorker, {"path": path, "how": how}) as ex:
            shapes = ex.collective_rpc("q_proj_shape")
            got = ex.collective_rpc("generate", args=(ids,))
    full = tuple(reference.model.layers[0].self_attn.q_proj.weight.shape)
    return {"equal": all(g == want for g in got), "tokens": want, "full": full, "shards": shapes}


if __name__ == "__main__":
    result = main(sys.argv[1] if len(sys.argv) > 1 else "mesh", int(sys.argv[2]) if len(sys.argv) > 2 else 2)
    print(
        f"HF Llama TP: tokens equal to the one-process model: {result['equal']} {result['tokens']}; q_proj "
        f"{result['full']} split as {result['shards']}"
    )
    sharded = all(s[0] * len(result["shards"]) == result["full"][0] for s in result["shards"])
    sys.exit(0 if result["equal"] and sharded else 1)
