"""A plan on paper: Qwen3-30B-A3B RL on 2 nodes x 8 H200, from the one-H200 measurements in results/.

    python experiments/plan_multinode.py [--prompts 512] [--samples 8] [--prompt-len 256] [--response-len 1024]
                                         [--micro-batch 2] [--minibatches 8] [--out DIR]

Two trainer layouts over the 16 GPUs; the generator is EP 8 on each node (two engines), colocated with the trainer:
  ep8_dp2  trainer EP 8 inside each node, every expert replicated on the two nodes, the dense parts data
           parallel over all 16 ranks: the MoE all-to-alls stay on NVLink, the experts' gradient nodes cross
           InfiniBand once per optimizer step;
  ep16     trainer EP 16 over both nodes (trainer.ep_size=16): half of every all-to-all crosses InfiniBand.
Per layout: memory per GPU (experiments/train/memory_qwen3_30b.py's model), all-to-all bytes per RL step, the
dense gradient reduction, weight-sync bytes and time over NVLink and InfiniBand, and a step time. Each phase's
work (bytes, FLOPs) comes from the model's shapes, its rate from a one-H200 result (`inputs` names the file and
key of each), the links' rates from ASSUMPTIONS. Phases run one after another, as colocated rlalign runs them, and
no communication overlaps compute. Two variants: `current` (today's mechanisms: the dense tree broadcast node by
node, the decode all-to-all's fixed capacity, the sync broadcast from trainer rank 0) and `proposed` (PROPOSED).
Runs on CPU; writes results/multinode_plan.json.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from types import SimpleNamespace

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE / "train")]
import record  # noqa: E402
from memory_qwen3_30b import H200_GIB, model_shapes, trainer_memory  # noqa: E402
from profile_train import model_flops  # noqa: E402

GIB, GB = 1024**3, 1e9
GPUS_PER_NODE, NODES = 8, 2
W = GPUS_PER_NODE * NODES
# The links: stated, not measured here (no multi-node machine was lent)
NVLINK_GBPS = 450.0  # H200 SXM, NVLink 4: 900 GB/s per GPU both ways together (NVIDIA H200 datasheet): 450 each way
IB_GBPS = 50.0  # one 400 Gb/s NDR InfiniBand NIC per GPU (ConnectX-7, 8 per node): 50 GB/s each way
LINK_EFFICIENCY = 0.8  # the fraction of a link's rate a large NCCL transfer reaches (assumed)
COLLECTIVE_LATENCY_S = 15e-6  # one NCCL collective of small messages (assumed order of magnitude)
CAPACITY_FACTOR = 2.0  # the proposed decode all-to-all capacity, in mean rows per destination
ASSUMPTIONS = {
    "nvlink_GBps_per_gpu_each_way": NVLINK_GBPS, "ib_GBps_per_gpu_each_way": IB_GBPS,
    "link_efficiency": LINK_EFFICIENCY, "collective_latency_s": COLLECTIVE_LATENCY_S,
    "routing": "balanced: every expert gets top_k / num_experts of the rows",
    "lengths": "every prompt and every response of a step the same length (no long tail)",
    "phases": "generate, train and sync one after another (colocated); no communication overlapped with compute",
    "collectives": "a broadcast or all-gather enters a node once, spread over its 8 NICs; an all-to-all leaves "
                   "each GPU through its own NIC",
}
PROPOSED = {
    "dense_reduce": "each rank sends every other rank that rank's units' slice of each dense leaf (bf16) as the "
                    "leaf is made; the owner adds its slice in the same tree over global micro-batches (the same "
                    "bits: the sum is elementwise), runs AdamW on its units, and the weights are all-gathered as "
                    "trainer.shard_dense does today. Replaces the fp32 broadcast of every node to every rank (W x "
                    "the bytes) and the leaves waiting in memory. The grad norm's tree must then be cut at unit "
                    "boundaries",
    "decode_capacity": f"the decode all-to-all's capacity at {CAPACITY_FACTOR} x the mean rows per destination, "
                       "with the overflow flag that exists today re-running the step at exact sizes (the same "
                       "bits: rows only move), instead of rows x min(top_k, experts per rank) (8 x the mean at "
                       "generator EP 8)",
    "weight_sync": "each generator rank takes its own shard from the trainer ranks that hold it (a copy on its own "
                   "GPU where trainer and generator EP match), instead of trainer rank 0 gathering the experts and "
                   "broadcasting the whole model",
}
REQUIRES = {
    "ep8_dp2": ["expert replicas over a data-parallel group (rlalign's trainer has one EP group: "
                "trainer.ep_size ranks, experts split over all of them)",
                "two generator groups, EP 8 each (rlalign runs one generator group)"],
    "ep16": ["two generator groups, EP 8 each (rlalign runs one generator group)"],
}
LAYOUTS = {"ep8_dp2": 8, "ep16": 16}  # trainer EP size


class Inputs:
    """Numbers read from results/*.json, each remembered with the file and key it came from."""

    def __init__(self) -> None:
        self.used: dict[str, dict] = {}

    def get(self, name: str, file: str, *keys):
        value = json.loads((record.RESULTS / file).read_text())
        for k in keys:
            value = value[k]
        self.used[name] = {"value": value, "from": f"results/{file}: " + ".".join(map(str, keys))}
        return value


def linear_bytes(a, dense: dict, E: int) -> int:
    """bf16 bytes of every GEMM weight (the embedding is a lookup)."""
    return (sum(math.prod(s) for s in dense.values()) - a.vocab_size * a.hidden_size + E) * 2


def active_params(a) -> int:
    return model_flops(SimpleNamespace(model=a), [])["active_matmul_params"]


def measured(inp: Inputs, bench) -> dict:
    """The one-H200 rates the plan scales: the native engine's decode replays of bench-moe-large (GEMM weights
    streamed at 256 rows, GEMM FLOP/s at 2,048 rows, the other kernels per layer, the sampler), paged attention's
    key/value stream, prefill FLOP/s, trainer MFU, the colocated weight copy, the separate-GPU sync path, a device
    copy, the colocated RL step over the sum of its phases."""
    a, dense, E = bench
    probe = "probe_rollout_steps_h200.json"
    small = inp.get("decode_replay_256_rows", probe, "results", "256x256", "last_decode_replay")
    large = inp.get("decode_replay_2048_rows", probe, "results", "2048x256", "last_decode_replay")
    top = {name: ms * 1e-3 for name, ms, _ in small["top"]}
    gemm_2048 = {name: ms * 1e-3 for name, ms, _ in large["top"]}["_gemm_kernel"]
    other = small["kernel_ms"] * 1e-3 - top["_gemm_kernel"] - top["_attn_fwd"] - top["gumbel_argmax_kernel"]
    prefill = inp.get("prefill_kernels", probe, "results", "256x256", "prefill_only")
    rows = inp.get("paged_attention", "sweep_decode_attention_heads_h200.json", "rows")
    coloc = "rl_step_colocated_h200.json"
    sync_s = inp.get("colocated_sync_s", coloc, "parts", "median_after_first", "sync_s")
    run = inp.get("colocated_step_phases", coloc, "runs", "rl_q_det_off", "median_after_first")
    return {
        "gemm_stream_Bps": linear_bytes(a, dense, E) / top["_gemm_kernel"],
        "gemm_flops": large["bucket"] * 2 * active_params(a) / gemm_2048,
        "other_s_per_layer": other / a.num_layers,
        "sampler_s_per_vocab_row": top["gumbel_argmax_kernel"] / (a.vocab_size * small["bucket"]),
        "attention": [(r["kv_bytes"], r["kv_bytes"] / (r["heads_minor"]["us"] * 1e-6)) for r in rows],
        "prefill_flops": prefill["prompt_tokens"] * 2 * active_params(a) / (prefill["kernel_ms"] * 1e-3),
        "mfu": inp.get("trainer_mfu", "trainer_mfu_h200.json", "summary", "trainer_mfu"),
        "peak_flops": inp.get("peak_tflops", "trainer_mfu_h200.json", "summary", "peak_tflops") * 1e12,
        "colocated_copy_Bps": inp.get("colocated_sync_bytes", coloc, "parts", "generator_weights_bytes") / sync_s,
        "sync_path_Bps": inp.get("sync_path_GBps", "weight_sync_bench-moe-large_h200x2.json", "results", 0,
                                 "device", "GB_per_s") * GB,
        "device_copy_Bps": inp.get("device_copy_TBps", "decode_bandwidth_h200.json", "summary", "copy_TBps") * 1e12,
        "colocated_overhead": inp.get("step_over_sum_of_phases", coloc, "summary", "step_over_sum_of_phases"),
        "step_other_s": run["reward_s"] + run["compare_s"],
    }


def link_s(nvlink_bytes: float, ib_bytes: float, collectives: float = 0) -> float:
    """Seconds for transfers whose busiest NVLink port moves nvlink_bytes and busiest NIC ib_bytes, both at once."""
    return max(nvlink_bytes / (NVLINK_GBPS * GB * LINK_EFFICIENCY), ib_bytes / (IB_GBPS * GB * LINK_EFFICIENCY)) \
        + collectives * COLLECTIVE_LATENCY_S


def attention_Bps(m: dict, kv_bytes: float) -> float:
    """The measured key/value stream rate of the launch nearest in bytes (log scale)."""
    return min(m["attention"], key=lambda p: abs(math.log(p[0] / kv_bytes)))[1]


def generation(w, a, m: dict) -> dict:
    """One EP-8 engine per node. A generator rank holds the dense weights and 1/8 of the experts and runs its share
    of the sequences, all in flight. A decode step: the GEMMs (weights streamed, or FLOP-bound), keys and values
    read, the other kernels per layer, the sampler, and 3 all-to-alls a MoE layer (counts, rows, rows back)."""
    ep, L, k, d = GPUS_PER_NODE, a.num_layers, a.top_k, a.hidden_size
    rows = w.seqs // W
    weights = linear_bytes(a, w.dense_shapes, w.expert // ep)  # every local expert touched: rows * k >> El
    kv = rows * (w.prompt + w.response / 2) * w.kv_per_token  # the mean context over the decode steps
    gemm = max(weights / m["gemm_stream_Bps"], rows * 2 * w.active / m["gemm_flops"])
    compute = gemm + kv / attention_Bps(m, kv / L) + L * m["other_s_per_layer"] \
        + rows * a.vocab_size * m["sampler_s_per_vocab_row"]
    row_bytes = k * d * 2 * (ep - 1) / ep  # one token's rows that leave its rank, one way
    exact = 2 * L * rows * row_bytes  # dispatch + return
    sent = {"current": exact * ep * min(k, a.num_experts // ep) / k,  # a buffer of rows * min(k, El) rows each
            "proposed": exact * CAPACITY_FACTOR}
    step = {v: compute + link_s(b, 0, 3 * L) for v, b in sent.items()}
    prompt_tokens = rows * w.prompt
    prefill_a2a = 2 * L * prompt_tokens * row_bytes
    chunks = math.ceil(prompt_tokens / 8192)  # generator.max_num_batched_tokens
    prefill_s = prompt_tokens * 2 * w.active / m["prefill_flops"] + link_s(prefill_a2a, 0, 3 * L * chunks)
    return {"rows_per_rank": rows, "decode_steps": w.response, "decode_gemm_s_per_step": gemm,
            "weights_read_per_step_GB": weights / GB, "kv_read_per_step_GB": kv / GB,
            "decode_compute_s_per_step": compute, "decode_s_per_step": step, "prefill_s": prefill_s,
            "alltoall_GB_per_rank": {"prefill": prefill_a2a / GB, "decode_exact_rows": exact * w.response / GB,
                                     **{f"decode_{v}": b * w.response / GB for v, b in sent.items()}},
            "generate_s": {v: prefill_s + s * w.response for v, s in step.items()},
            "tokens_per_s_per_gpu": {v: rows / s for v, s in step.items()}}


def generator_gib(w, gen: dict) -> dict:
    rows = gen["rows_per_rank"]
    out = {"weights": (w.dense + w.expert / GPUS_PER_NODE) * 2 / GIB,
           "kv_cache": rows * (w.prompt + w.response) * w.kv_per_token / GIB,  # pages reserved for the longest
           "logits": 2 * rows * w.vocab * 4 / GIB}
    return {**out, "total": sum(out.values())}


def fit(w, a, ep: int, gen_gib: float, held: bool) -> tuple[int, dict]:
    """Micro-batches per rank per optimizer step: those of --minibatches optimizer steps, halved until the trainer's
    peak fits one H200 beside the generator's weights and KV cache (colocated: the trainer's persistent state stays
    while the generator runs). held: a rank's dense leaves wait for the tree's broadcast (current)."""
    M = math.ceil(math.ceil(w.seqs / w.micro_batch / W) / w.minibatches)
    while True:
        mem = trainer_memory(a, w.dense_shapes, w.expert, ep, w.micro_tokens, M, W, held)["sharded"]
        peak = max(mem["peak_in_backward_gib"], mem["peak_at_optimizer_step_gib"], mem["persistent_gib"] + gen_gib)
        if peak <= H200_GIB:
            return M, mem
        if M == 1:
            raise SystemExit(f"plan_multinode: one micro-batch of {w.micro_tokens} tokens does not fit at EP {ep}")
        M = (M + 1) // 2


def reductions(w, ep: int, M: dict) -> dict:
    """Per optimizer step: the dense gradient tree (current: every node broadcast to every rank in fp32; a node's
    nodes enter the other node once, over its 8 NICs; proposed: slices of the bf16 leaves to their owners, then
    the updated weights all-gathered), the expert replicas' tree nodes (fp32, to the other node's replica)."""
    D = w.dense
    cur = {"nvlink_GB": (W - 1) * M["current"] * D * 4 / GB, "ib_GB_per_nic": M["current"] * D * 4 / GB}
    cur["s"] = link_s(cur["nvlink_GB"] * GB, cur["ib_GB_per_nic"] * GB, W * M["current"])
    per_rank = (M["proposed"] + 1) * D * 2 / W  # to (and from) each other rank
    prop = {"nvlink_GB": per_rank * (GPUS_PER_NODE - 1) / GB, "ib_GB_per_nic": per_rank * GPUS_PER_NODE / GB}
    prop["s"] = link_s(prop["nvlink_GB"] * GB, prop["ib_GB_per_nic"] * GB, 2)
    replica = w.expert / ep * 4 if ep < W else 0.0
    return {"dense_current": cur, "dense_proposed": prop,
            "expert_replicas": {"ib_GB": replica / GB, "s": link_s(0, replica, 1) if replica else 0.0}}


def trainer(w, a, m: dict, ep: int, M: dict) -> dict:
    """One RL step's training: forward + backward of every token at the measured MFU, 5 all-to-alls a MoE layer
    and micro-batch (counts, rows and rows back; the backward's two), and per optimizer step the reductions and
    AdamW (M: micro-batches per rank per optimizer step of each variant, from fit)."""
    L, k, d = a.num_layers, a.top_k, a.hidden_size
    tokens = w.seqs * (w.prompt + w.response)
    flops = model_flops(SimpleNamespace(model=a), [SimpleNamespace(prompt=range(w.prompt),
                                                                   response=range(w.response))] * w.seqs)
    compute_s = flops["flops"] / (W * m["peak_flops"] * m["mfu"])
    on_node = (min(ep, GPUS_PER_NODE) - 1) / ep  # a row's destinations: its EP group, its own node first
    off_node = max(0, ep - GPUS_PER_NODE) / ep
    a2a = tokens / W * L * 4 * k * d * 2
    micro = math.ceil(w.seqs / w.micro_batch / W)
    a2a_s = link_s(a2a * on_node, a2a * off_node, micro * L * 5)
    red = reductions(w, ep, M)
    adamw_s = (w.dense / W + w.expert / ep) * 30 / m["device_copy_Bps"]  # bytes a parameter: grad 4, master 8,
    opt = {v: math.ceil(micro / n) for v, n in M.items()}  # moments 16, bf16 weight 2
    per_opt = {v: red[f"dense_{v}"]["s"] + red["expert_replicas"]["s"] + adamw_s for v in M}
    return {"tokens": tokens, "flops": flops["flops"], "compute_s": compute_s, "micro_batches_per_rank": micro,
            "micro_batches_per_rank_per_optimizer_step": M, "optimizer_steps": opt,
            "expert_rows_per_source_micro_batch": w.micro_tokens * k / a.num_experts,
            "alltoall_GB_per_rank": {"nvlink": a2a * on_node / GB, "ib": a2a * off_node / GB}, "alltoall_s": a2a_s,
            "per_optimizer_step": {**red, "adamw_s": adamw_s},
            "train_s": {v: compute_s + a2a_s + opt[v] * per_opt[v] for v in M}}


def weight_sync(w, m: dict, ep: int) -> dict:
    """Bytes and time of one sync. Current: trainer rank 0 gathers the expert shards, then one broadcast of the
    whole model to the 16 generator ranks, at the measured separate-GPU path's rate at best. Proposed: per GPU.
    ep8_dp2: trainer rank r of a node holds generator rank r's experts, on the same GPU; ep16: generator rank g
    of a node needs trainer ranks 2g and 2g + 1 (global), so half of a node's generator ranks read theirs over
    NVLink and the other half over InfiniBand (each through its own NIC)."""
    full = (w.dense + w.expert) * 2
    experts = w.expert / GPUS_PER_NODE * 2  # a generator rank's (EP 8), bf16
    gather_nv = w.expert * 2 * (min(ep, GPUS_PER_NODE) - 1) / ep
    gather_ib = w.expert * 2 * max(0, ep - GPUS_PER_NODE) / ep
    bcast_s = max(full / min(m["sync_path_Bps"], NVLINK_GBPS * GB * LINK_EFFICIENCY), link_s(0, full / GPUS_PER_NODE))
    current = {"nvlink_GB": (gather_nv + full) / GB, "ib_GB_per_nic": (gather_ib + full / GPUS_PER_NODE) / GB,
               "s": link_s(gather_nv, gather_ib) + bcast_s}
    same = ep == GPUS_PER_NODE
    local = w.dense * 2 + (experts if same else 0.0)
    remote = 0.0 if same else experts
    proposed = {"local_copy_GB": local / GB, "nvlink_GB": 0.0 if same else experts / GB, "ib_GB": remote / GB,
                "s": local / m["colocated_copy_Bps"] + link_s(0, remote, 0 if same else 1)}
    links = {"whole_model_over_one_nvlink_port_s": link_s(full, 0), "whole_model_over_one_nic_s": link_s(0, full),
             "whole_model_over_a_nodes_8_nics_s": link_s(0, full / GPUS_PER_NODE)}
    return {"model_GB": full / GB, "current": current, "proposed": proposed, **links}


def layout_plan(w, a, m: dict, gen: dict, name: str) -> dict:
    ep = LAYOUTS[name]
    gmem = generator_gib(w, gen)
    fits = {v: fit(w, a, ep, gmem["total"], held) for v, held in (("current", True), ("proposed", False))}
    tr = trainer(w, a, m, ep, {v: f[0] for v, f in fits.items()})
    sync = weight_sync(w, m, ep)
    memory = {}
    for v, (_, mem) in fits.items():
        memory[v] = {"trainer_persistent": mem["persistent_gib"], "trainer_backward_peak": mem["peak_in_backward_gib"],
                     "trainer_optimizer_step_peak": mem["peak_at_optimizer_step_gib"],
                     "generator": gmem, "while_generating": mem["persistent_gib"] + gmem["total"]}
        memory[v]["peak"] = max(memory[v]["while_generating"], mem["peak_in_backward_gib"],
                                mem["peak_at_optimizer_step_gib"])
    a2a = {"trainer": sum(tr["alltoall_GB_per_rank"].values()),
           "generator": gen["alltoall_GB_per_rank"]["prefill"] + gen["alltoall_GB_per_rank"]["decode_proposed"]}
    phases = {v: {"generate": gen["generate_s"][v], "train": tr["train_s"][v], "sync": sync[v]["s"]}
              for v in ("current", "proposed")}
    step = {v: sum(p.values()) * m["colocated_overhead"] + m["step_other_s"] for v, p in phases.items()}
    return {"trainer_ep": ep, "requires": REQUIRES[name],
            "memory_gib_per_gpu": memory, "trainer": tr, "weight_sync": sync,
            "alltoall_GB_per_gpu": {**a2a, "total": sum(a2a.values()),
                                    "ib_share": tr["alltoall_GB_per_rank"]["ib"] / sum(a2a.values())},
            "step_s": step, "phases_s": phases}


def summarize(plans: dict) -> dict:
    best = min(plans, key=lambda n: plans[n]["step_s"]["proposed"])

    def keys(p: dict) -> dict:
        return {"step_s_estimate": round(p["step_s"]["proposed"], 1),
                "memory_gib_per_gpu": round(p["memory_gib_per_gpu"]["proposed"]["peak"], 1),
                "alltoall_gb_per_step": round(p["alltoall_GB_per_gpu"]["total"], 1),
                "sync_s_estimate": round(p["weight_sync"]["proposed"]["s"], 3),
                "step_s_current": round(p["step_s"]["current"], 1),
                "sync_s_current": round(p["weight_sync"]["current"]["s"], 2)}

    return {"layout": best, **keys(plans[best]), "other_layouts": {n: keys(p) for n, p in plans.items() if n != best},
            "units": "per GPU: GiB of device memory at its peak, GB one GPU sends through all-to-alls in one RL step "
                     "(trainer + generator, proposed capacity); seconds of one RL step and of one weight sync, with "
                     "the PROPOSED changes (step_s_current, sync_s_current: today's mechanisms)"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=512, help="prompts per RL step")
    ap.add_argument("--samples", type=int, default=8, help="samples per prompt")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--response-len", type=int, default=1024)
    ap.add_argument("--micro-batch", type=int, default=2, help="trainer.micro_batch_size (sequences)")
    ap.add_argument("--minibatches", type=int, default=8, help="algorithm.num_minibatches (optimizer steps a step)")
    ap.add_argument("--out", default=None, help="results directory (default experiments/results)")
    o = ap.parse_args()
    a, dense, E = model_shapes("qwen3-30b-a3b-shape", GPUS_PER_NODE)
    inp = Inputs()
    m = measured(inp, model_shapes("bench-moe-large", 1))
    w = SimpleNamespace(seqs=o.prompts * o.samples, prompt=o.prompt_len, response=o.response_len,
                        micro_batch=o.micro_batch, minibatches=o.minibatches,
                        micro_tokens=o.micro_batch * (o.prompt_len + o.response_len), dense_shapes=dense,
                        dense=sum(math.prod(s) for s in dense.values()), expert=E, active=active_params(a),
                        vocab=a.vocab_size, kv_per_token=a.num_layers * 2 * a.num_kv_heads * a.head_dim * 2)
    gen = generation(w, a, m)
    plans = {name: layout_plan(w, a, m, gen, name) for name in LAYOUTS}
    summary = summarize(plans)
    for name, p in plans.items():
        s, a2a, sync = p["step_s"], p["alltoall_GB_per_gpu"], p["weight_sync"]
        print(f"{name:8s} step {s['proposed']:6.1f} s (current {s['current']:6.1f})  memory "
              f"{p['memory_gib_per_gpu']['proposed']['peak']:5.1f} GiB  all-to-all {a2a['total']:7.1f} GB/GPU "
              f"({100 * a2a['ib_share']:.0f} % over IB)  sync {sync['proposed']['s']:.3f} s (current "
              f"{sync['current']['s']:.2f})")
    best = plans[summary["layout"]]
    what = (f"Qwen3-30B-A3B RL on 2 nodes x 8 H200 on paper, from the one-H200 results ({w.seqs} sequences of "
            f"{w.prompt} + {w.response} tokens a step, {w.minibatches} optimizer steps): {summary['layout']} "
            f"(trainer EP {best['trainer_ep']}) {summary['step_s_estimate']} s a step with the proposed changes "
            f"({summary['step_s_current']} s with today's mechanisms), {summary['memory_gib_per_gpu']} GiB peak per "
            f"GPU, {summary['alltoall_gb_per_step']} GB of all-to-all per GPU a step, weight sync "
            f"{summary['sync_s_estimate']} s; "
            + "; ".join(f"{n} {v['step_s_estimate']} s ({v['step_s_current']} s)"
                        for n, v in summary["other_layouts"].items()) + ". Computed, not measured.")
    workload = {k: v for k, v in vars(w).items() if k != "dense_shapes"}
    out = {"what_it_shows": what, "summary": summary, "workload": workload,
           "model": "configs/model/qwen3-30b-a3b-shape.yaml", "assumptions": ASSUMPTIONS, "proposed": PROPOSED,
           "inputs": inp.used,
           "rates": {k: v for k, v in m.items() if k != "attention"}, "generation": gen, "layouts": plans}
    print("wrote", record.write("multinode_plan", out, o.out))


if __name__ == "__main__":
    main()
