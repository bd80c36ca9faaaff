"""Per-GPU memory of the trainer for the Qwen3-30B-A3B shape at trainer EP 8, computed (not
measured) from the parameter shapes, with and without trainer.shard_dense.

    python experiments/train/memory_qwen3_30b.py [--model qwen3-30b-a3b-shape] [--ep 8] [--tokens 2048]
        [--micro-batches 1]

The shapes come from configs/model/qwen3-30b-a3b-shape.yaml built on the meta device (no memory);
the dense share of the most loaded rank from the trainer's own unit rule (dense_units,
assign_units at the default trainer.shard_unit_numel). Writes results/memory_qwen3_30b.json.

What is counted, per rank (bytes):
  persistent   bf16 model (dense whole, this rank's experts), fp32 masters, AdamW exp_avg and
               exp_avg_sq, fp32 gradients kept between steps (sharded: dense only for own units)
  step peak    at the grad norm: the whole dense fp32 gradient total (every rank finishes it) +
               the first level of the norm's tree (sum_of_squares) ; at AdamW: the clipped copy of
               every held gradient (grads * coef) ; sharded: the all-gather buffers (W x the largest
               share, bf16)
  backward     (the same with or without dense sharding; NOT addressed by it) during the backward:
               activations (bf16 tensors saved for `tokens` tokens on this rank, no activation
               checkpointing (the model has none), expert rows at balanced routing (T*k), fp32
               logits) + bf16 autograd gradients (dense; the per-source expert path gives every source
               rank its own view, so its own gradient, of this rank's experts, but a hook moves each
               into the expert tree as autograd produces it: one layer's leaves at a time) + the
               expert tree's nodes; after it: the dense gradient tree (a rank's own leaves, one per
               micro-batch it ran, waiting in bf16 — the trainer deals micro-batches strided, so a
               rank's own are never siblings — plus the O(log) fp32 nodes reduce_nodes holds while it
               merges all ranks' nodes in leaf order) and the expert tree (the ranks' i-th
               micro-batches are consecutive indices, so the W source leaves of one lockstep step
               merge at once: one fp32 node per set bit of the steps done, at most
               max popcount(1..M) copies of the rank's experts, M = micro-batches per rank)
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # experiments/: record.py

import record  # noqa: E402

from rlalign.config import load_config, model_args  # noqa: E402
from rlalign.model.model import build_model  # noqa: E402
from rlalign.parallel.ep import is_expert_param  # noqa: E402
from rlalign.training.shards import DEFAULT_UNIT_NUMEL, assign_units, dense_units  # noqa: E402

GIB = 1024**3
H200_GIB = 139.0  # usable device memory the device tool reports for one H200 (about 139 GiB)


def activations_per_token(a) -> dict[str, int]:
    """bf16 elements saved for backward per token and layer (a rough, stated count)."""
    d, q, kv = a.hidden_size, a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
    m, k = a.moe_intermediate_size, a.top_k
    return {
        "attention (norm in/out, q/k/v, q/k norm, rope, attention out, o_proj out)": 2 * d + (q + 2 * kv) + 2 * (q + kv)
        + q + d,
        "moe (norm in/out, fp32 router logits+probs, output)": 2 * d + 4 * a.num_experts + d,
        "experts per routed row x top_k (row in, gate_up out, swiglu out, fp32 combine input)": k * (d + 3 * m + 2 * d),
    }


def model_shapes(model: str, ep: int) -> tuple:
    """(ModelArgs, dense parameter shapes {name: shape}, expert parameter count) of configs/model/MODEL.yaml,
    built on the meta device (no memory)."""
    cfg = load_config([f"model={model}", f"trainer.ep_size={ep}"])
    args = model_args(cfg)
    params = dict(build_model(args, "bfloat16", seed=None, device="meta").named_parameters())
    dense = {n: tuple(p.shape) for n, p in params.items() if not is_expert_param(n)}
    return args, dense, sum(p.numel() for n, p in params.items() if is_expert_param(n))


def trainer_memory(args, dense: dict, E: int, ep: int, tokens: int, micro_batches: int, world: int | None = None,
                   dense_leaves_held: bool = True) -> dict:
    """Bytes per trainer rank (the most loaded one) with the experts split over `ep` ranks and the dense state
    (data parallel, sharded with trainer.shard_dense) over `world` ranks (default ep; world = ep x dp when each
    expert has dp replicas, whose expert gradient nodes meet once per step). dense_leaves_held=False: a proposed
    reduction that sends each dense leaf's slices to their owners as the leaf is made (each owner runs the tree
    of its slice), instead of keeping a rank's own leaves until every rank broadcasts its nodes."""
    W = world or ep
    D = sum(math.prod(s) for s in dense.values())
    E_loc = E // ep
    units = dense_units(list(dense.items()), DEFAULT_UNIT_NUMEL)
    owners = assign_units([u.numel for u in units], W)
    shares = [sum(u.numel for u, r in zip(units, owners) if r == k) for k in range(W)]
    D_share = max(shares)

    per_tok = activations_per_token(args)
    act_layer = sum(per_tok.values())
    act_bytes = tokens * (act_layer * args.num_layers * 2 + args.vocab_size * 4)

    def budget(shard: bool) -> dict:
        held = D_share if shard else D
        persistent = {
            "bf16 model (dense whole + own experts)": (D + E_loc) * 2,
            "fp32 masters": (held + E_loc) * 4,
            "AdamW exp_avg + exp_avg_sq (fp32)": (held + E_loc) * 8,
            "fp32 gradients kept between steps": (held + E_loc) * 4,
        }
        step = {
            "whole dense fp32 gradient total until the norm": (D - held) * 4,  # the held part is counted above
            "first level of the norm's tree (sum_of_squares)": (1 << (D - 1).bit_length()) // 2 * 4,
            "clipped gradient copies at AdamW (grads * coef)": (held + E_loc) * 4,
            "all-gather of updated dense weights (bf16)": (W + 1) * D_share * 2 if shard else 0,
        }
        M = micro_batches
        streamed = (W * M).bit_length() + 1  # reduce_nodes: maximal subtrees + the one arriving
        expert_tree = max(bin(i).count("1") for i in range(1, M + 1)) * E_loc * 4
        layer_leaves = ep * (E_loc // args.num_layers) * 2  # one MoE layer's per-source bf16 gradients
        backward = {
            "during backward: bf16 autograd gradients (dense + one layer's per-source expert leaves)":
                D * 2 + layer_leaves,
            "during backward: activations": act_bytes,
            "during backward: expert gradient tree (fp32 nodes of the steps and layers done)": expert_tree,
            "during backward: dense gradient tree (own bf16 leaves of the earlier micro-batches)":
                (M - 1) * D * 2 if dense_leaves_held else 0,
            "after backward: dense gradient tree (own bf16 leaves + reduce_nodes' streamed fp32 nodes)":
                M * D * 2 + streamed * D * 4 if dense_leaves_held else D * 2 + streamed * D * 4 // W,
            "after backward: expert gradient tree (fp32; = the expert gradients at 1 micro-batch per rank)":
                expert_tree,
        }
        if W > ep:
            backward["after backward: a replica's expert tree node, received to merge (fp32)"] = E_loc * 4
        p = sum(persistent.values())
        base = p - persistent["fp32 gradients kept between steps"]  # replaced at the next forward_backward
        during = sum(v for k, v in backward.items() if k.startswith("during"))
        after = sum(v for k, v in backward.items() if k.startswith("after"))
        out = {"persistent": persistent, "step_transient": step, "backward_transient": backward,
               "persistent_gib": p / GIB,
               "peak_at_optimizer_step_gib": (p + max(step["whole dense fp32 gradient total until the norm"]
                                                      + step["first level of the norm's tree (sum_of_squares)"],
                                                      step["clipped gradient copies at AdamW (grads * coef)"]
                                                      + step["all-gather of updated dense weights (bf16)"])) / GIB,
               "peak_in_backward_gib": (base + max(during, after)) / GIB}
        out["fits_h200"] = max(out["peak_at_optimizer_step_gib"], out["peak_in_backward_gib"]) <= H200_GIB
        return out

    return {
        "params": {"total": D + E, "dense": D, "expert": E, "expert_per_rank": E_loc},
        "dense_sharding": {"unit_numel": DEFAULT_UNIT_NUMEL, "units": len(units), "share_per_rank": shares,
                           "max_share_fraction": D_share / D, "ideal_fraction": 1 / W},
        "micro_batch": {"tokens_per_rank": tokens, "micro_batches_per_rank": micro_batches,
                        "activation_elements_per_token_per_layer": per_tok,
                        "activation_gib": act_bytes / GIB},
        "unsharded": budget(False),
        "sharded": budget(True),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3-30b-a3b-shape", help="a configs/model option")
    ap.add_argument("--ep", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=2048, help="tokens of one micro-batch on one rank")
    ap.add_argument("--micro-batches", type=int, default=1, help="micro-batches per rank per optimizer step")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    W = a.ep
    args, dense, E = model_shapes(a.model, W)
    mem = trainer_memory(args, dense, E, W, a.tokens, a.micro_batches)
    result = {
        "model": f"configs/model/{a.model}.yaml",
        "trainer_ep": W,
        **mem,
        "h200_usable_gib": H200_GIB,
        "note": "computed from shapes, not measured; bytes per rank of the most loaded rank. Dense sharding "
                "saves 16 bytes per dense parameter held elsewhere (master, 2 moments, kept gradient); the "
                "backward's gradient trees are unchanged by it (per-source expert leaves enter the tree during "
                "the backward, one layer at a time; reduce_nodes streams the ranks' dense nodes)",
    }
    for k in ("unsharded", "sharded"):
        b = result[k]
        print(f"{k:10s} persistent {b['persistent_gib']:7.1f} GiB  optimizer-step peak "
              f"{b['peak_at_optimizer_step_gib']:7.1f} GiB  backward peak {b['peak_in_backward_gib']:7.1f} GiB  "
              f"fits one H200 ({H200_GIB:.0f} GiB): {b['fits_h200']}")
    p, sh = mem["params"], mem["dense_sharding"]
    print(f"dense {p['dense'] / 1e9:.3f} B params, experts {p['expert'] / 1e9:.2f} B "
          f"({p['expert_per_rank'] / 1e9:.2f} B per rank); max dense share {sh['max_share_fraction']:.4f} of the "
          f"dense state (ideal {1 / W:.4f}) in {sh['units']} units")
    name = "memory_qwen3_30b" if a.model == "qwen3-30b-a3b-shape" else f"memory_{a.model}_ep{W}"
    print("wrote", record.write(name, {"result": result}, a.out))


if __name__ == "__main__":
    main()
