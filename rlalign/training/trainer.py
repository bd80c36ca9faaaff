"""One rank of the trainer group, made of parts: the policy model in its compute dtype (EP applied
from outside), the step's partition (rlalign.training.partition), gradients (rlalign.training.gradients), fp32
master weights with AdamW (rlalign.training.optimizer, rlalign.training.shards) and the state
that checkpoints and traces read (rlalign.training.state).

A step: micro-batches of sequences -> scored with the generator's logprob function -> loss ->
backward -> gradients reduced in a fixed order -> global-norm clipping -> AdamW on the masters,
rounded into the model. Every rank runs the same number of micro-batches (empty ones included) so
that the MoE all-to-alls of forward and backward stay in lockstep.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf

from rlalign.faults import SideFaults
from rlalign.model.build import model_from_config
from rlalign.parallel.ep import apply_ep, full_state_dict, is_expert_param
from rlalign.sequences import Sample, policy_tokens
from rlalign.training import state
from rlalign.training.gradients import Gradients
from rlalign.training.losses import LossBatch, LossFn, policy_batch, policy_selection, resolve_loss
from rlalign.training.optimizer import AdamW, MasterWeights
from rlalign.training.partition import micro_batch_share, step_partition
from rlalign.training.scoring import drawn_with, micro_batches, score_micro_batch
from rlalign.training.shards import Unit


def _on_host(logprobs: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
    """Each sample's logprobs as a CPU tensor of its own (Ray pickles whole storages), the device ones
    copied in one transfer."""
    dev = [i for i, x in logprobs.items() if x.device.type != "cpu"]
    if not dev:
        return logprobs
    flat = torch.cat([logprobs[i] for i in dev]).cpu()
    out = dict(logprobs)
    for i, x in zip(dev, flat.split([logprobs[i].numel() for i in dev])):
        out[i] = x.clone()
    return out


class Trainer:
    def __init__(self, cfg: DictConfig, group=None):
        self.cfg, self.group = cfg, group
        self.model = model_from_config(cfg)
        if group is not None:
            apply_ep(self.model, group)
        self.device = self.model.lm_head.weight.device
        self.names = [n for n, _ in self.model.named_parameters()]
        self.dense_names = [n for n in self.names if not is_expert_param(n)]
        self.expert_names = [n for n in self.names if is_expert_param(n)]
        self.weights = MasterWeights(self.model, cfg.trainer, self.dense_names, self.expert_names, self.rank,
                                     self.world)
        self.invariant = bool(cfg.trainer.get("topology_invariant", True))
        self.gradients = Gradients(self.model, self.dense_names, self.expert_names, self.invariant, group,
                                   self.world, SideFaults("trainer").reorder)
        self.ref_model = None
        if cfg.get("algorithm") is not None and cfg.algorithm.kl_coef > 0:
            self.ref_model = model_from_config(cfg).requires_grad_(False)  # the initial policy
            if group is not None:
                apply_ep(self.ref_model, group)
        self.max_new_tokens = cfg.task.max_new_tokens  # the sampling limit of `rlalign train`: dr_grpo's normaliser

    @property
    def rank(self) -> int:
        return 0 if self.group is None else dist.get_rank(self.group)

    @property
    def world(self) -> int:
        return 1 if self.group is None else dist.get_world_size(self.group)

    @property
    def grads(self) -> dict[str, torch.Tensor]:
        """fp32 gradients by parameter name (sharded, after a step: by unit key)."""
        return self.gradients.grads

    @property
    def master(self) -> dict[str, torch.nn.Parameter]:
        return self.weights.master

    @property
    def opt(self) -> AdamW | None:
        return self.weights.opt

    def my_units(self) -> list[Unit]:
        return self.weights.my_units()

    # --- the step ----------------------------------------------------------------------------------
    def train_step(self, samples: list[Sample], alg) -> tuple[dict[int, torch.Tensor], list[tuple[tuple, dict]]]:
        """PPO epochs over the step's minibatches. `samples` is the WHOLE step (every rank gets the
        same list) so that minibatches and micro-batches are a fixed partition of it (step_partition);
        this rank runs its share of each minibatch's micro-batches (micro_batch_share). Returns this
        rank's samples' pre-update logprobs by global index (what the monitor compares with the
        generator's) and stat records keyed (epoch, minibatch, micro-batch), which the driver merges
        in key order: the same bits at every trainer EP size."""
        minibatches = step_partition(len(samples), self.cfg.trainer.micro_batch_size, alg.num_minibatches)
        mine = [i for mbs in minibatches for mb in self.my_micro_batches(mbs)[1] for i in mb]
        old = {}  # the pre-update logprobs: scored first, or captured by the first forward
        if alg.ppo_epochs * alg.num_minibatches > 1 or self.cfg.trainer.separate_scoring_pass:
            old = dict(zip(mine, self.score([samples[i] for i in mine])))
        ref = dict(zip(mine, self.score([samples[i] for i in mine], self.ref_model))) if self.ref_model else None
        records: list[tuple[tuple, dict]] = []
        for epoch in range(alg.ppo_epochs):
            for k, mbs in enumerate(minibatches):
                loss_fn = self.ppo_loss(samples, alg, old, ref, mbs)
                records += [((epoch, k, g), st) for g, st in self.forward_backward(samples, loss_fn, mbs=mbs).items()]
                norm = self.optimizer_step()["grad_norm"]
                records.append(((epoch, k, len(mbs)), {"grad_norm_last": norm}))
        return _on_host({i: old[i] for i in mine}), records

    def ppo_loss(self, samples: list[Sample], alg, old: dict[int, torch.Tensor], ref: dict | None,
                 minibatch: list[list[int]] | None = None) -> LossFn:
        """The loss (algorithm.name or algorithm.loss: rlalign.training.losses) of a micro-batch of
        `minibatch` (default: all samples); the first forward of a sample not scored before the step
        captures its pre-update logprobs into `old`, on the device (train_step copies them to the host
        once, at its end: no host sync between a micro-batch's forward and its backward). The host
        inputs (generator logprobs, advantages) go to the device in one pinned, asynchronous copy. An
        episode's observation tokens are selected out before the loss (losses.policy_batch): the loss,
        its metrics and `minibatch_tokens` see the policy tokens only."""
        loss = resolve_loss(alg)
        members = [j for mb in minibatch for j in mb] if minibatch is not None else range(len(samples))
        sizes = dict(minibatch_tokens=sum(policy_tokens(samples[j]) for j in members), minibatch_sequences=len(members),
                     max_new_tokens=self.max_new_tokens)

        def loss_fn(lps, idx):
            for lp, j in zip(lps, idx):
                if j not in old:
                    old[j] = lp.detach().float()
            dev = lps[0].device if lps else torch.device("cpu")
            gen = [samples[j].generator_logprobs.detach().cpu().float() for j in idx]
            adv = [torch.full((len(samples[j].response),), float(samples[j].advantage)) for j in idx]
            host = torch.cat(gen + adv) if idx else torch.zeros(0)
            host = host.pin_memory().to(dev, non_blocking=True) if dev.type == "cuda" else host.to(dev)
            gen_t, adv_t = host.split([sum(x.numel() for x in gen), sum(x.numel() for x in adv)])
            cat = lambda xs: torch.cat(xs).to(dev).float() if xs else torch.zeros(0, device=dev)  # noqa: E731
            batch = LossBatch(torch.cat(lps), gen_t, cat([old[j] for j in idx]), adv_t,
                              [len(samples[j].response) for j in idx],
                              cat([ref[j] for j in idx]) if ref is not None else None, **sizes)
            if any(samples[j].turns is not None for j in idx):  # an episode: the loss sees its policy tokens only
                batch = policy_batch(batch, *policy_selection([samples[j].turns for j in idx], batch.lengths, dev))
            return loss(batch, alg)

        return loss_fn

    @torch.no_grad()
    def score(self, samples: Sequence[Sample], model=None) -> list[torch.Tensor]:
        """Logprobs of this rank's samples (no grad), micro-batched like training."""
        model = model or self.model
        mbs = micro_batches(len(samples), self.cfg.trainer.micro_batch_size)
        out: list[torch.Tensor] = []
        for i in range(self._max_over_ranks(len(mbs))):
            mb = [samples[j] for j in mbs[i]] if i < len(mbs) else []
            out += score_micro_batch(model, [s.prompt for s in mb], [s.response for s in mb], **self._kw(mb))
        if not out:
            return []
        flat = torch.cat([x.float() for x in out]).cpu()  # one device-to-host copy
        return [x.clone() for x in flat.split([x.numel() for x in out])]

    def _max_over_ranks(self, n: int) -> int:
        if self.group is None:
            return n
        t = torch.tensor([n], device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return int(t.item())

    def _kw(self, mb: list[Sample]) -> dict:
        """score_micro_batch's options: the layout, and what the samples carry: the distribution their
        responses were drawn with (scored under it), their sample ids (the monitor's row names)."""
        ids = [s.sample_id for s in mb]
        turns = {"turns": [s.turns for s in mb]} if any(s.turns is not None for s in mb) else {}
        return {"layout": self.cfg.trainer.layout, "params": drawn_with(mb),
                "sample_ids": ids if None not in ids else None, **turns}

    def my_micro_batches(self, mbs: list[list[int]]) -> tuple[range, list[list[int]]]:
        """This rank's share of a minibatch's global micro-batches (indices, contents): every
        world-th one (micro_batch_share)."""
        share = micro_batch_share(len(mbs), self.world, self.rank)
        return share, [mbs[g] for g in share]

    def forward_backward(self, samples: Sequence[Sample], loss_fn: LossFn, global_tokens: int | None = None,
                         mbs: list[list[int]] | None = None) -> dict[int, dict[str, float]]:
        """d(sum of token losses / global_tokens) into fp32 gradients (self.grads) over the global
        micro-batches `mbs` (lists of indices into `samples`, the same on every rank; default: all
        samples in micro_batch_size chunks), this rank running its share (rlalign.training.gradients
        keeps the sums' order fixed); global_tokens defaults to the policy tokens (an episode's observation
        tokens excluded). Returns each of its micro-batches' stats by global index."""
        if mbs is None:
            mbs = [list(mb) for mb in micro_batches(len(samples), self.cfg.trainer.micro_batch_size)]
        if global_tokens is None:
            global_tokens = sum(policy_tokens(samples[j]) for mb in mbs for j in mb)
        share, mine = self.my_micro_batches(mbs)
        starts = [micro_batch_share(len(mbs), self.world, r) for r in range(self.world)]
        self.gradients.start(len(mbs), starts)
        pending: list[tuple[int, list[str], torch.Tensor | None]] = []  # stats read once, after the loop
        for i in range(len(starts[0])):  # rank 0 has the most: every rank steps in lockstep
            idx = mine[i] if i < len(mine) else []
            mb = [samples[j] for j in idx]
            if mb:
                ent: list[torch.Tensor] = []
                lps = score_micro_batch(self.model, [s.prompt for s in mb], [s.response for s in mb], **self._kw(mb),
                                        entropy=ent)
                loss, st = loss_fn(lps, idx)
                st = {**st, "entropy_sum": ent[0]}
                vals = [torch.as_tensor(v, device=self.device).float().reshape(()) for v in st.values()]
                pending.append((share[i], list(st), torch.stack(vals).detach() if vals else None))
            else:  # still runs forward and backward through the MoE collectives
                loss = self.model(torch.zeros(0, dtype=torch.long, device=self.device), [0]).float().sum() * 0.0
            self.gradients.before_backward(i)
            (loss / max(1, global_tokens)).backward()
            self.gradients.after_backward(share[i] if mb else None, i)
        self.gradients.finish()
        filled = [v for _, _, v in pending if v is not None]
        flat = torch.cat(filled).tolist() if filled else []  # one host read for the step's stats
        stats: dict[int, dict[str, float]] = {}
        pos = 0
        for g, names, v in pending:
            n = len(names) if v is not None else 0
            stats[g] = dict(zip(names, flat[pos : pos + n]))
            pos += n
        return stats

    def reduce_grads(self) -> None:
        self.gradients.reduce()

    def grad_norm(self) -> float:
        return self.gradients.norm()

    def optimizer_step(self) -> dict[str, float]:
        """Reduce, norm (from the whole dense gradient, sharded or not: the same bits), clip, AdamW,
        the update rounded into the model."""
        self.reduce_grads()
        norm = self.grad_norm()
        if not math.isfinite(norm):  # the same value on every rank: all refuse the update together
            raise FloatingPointError(f"the gradient norm is {norm}, so the weights were not updated: the loss or its "
                                     f"gradient is not finite (see algorithm.loss or algorithm.*)")
        if self.weights.shard:
            self.weights.keep_own_grads(self.grads, self.dense_names)
            self.gradients.dense_flat = None
        clip = self.cfg.trainer.grad_clip
        coef = min(1.0, clip / (norm + 1e-6)) if clip and clip > 0 else 1.0
        written = self.weights.step(self.grads, coef, self.model)
        self.weights.write_into(self.model, self.group, skip=written)
        return {"grad_norm": norm, "grad_clip_coef": coef}

    # --- state -------------------------------------------------------------------------------------
    def topology_records(self) -> dict[str, torch.Tensor]:
        return state.topology_records(self.model, self.weights, self.grads, self.rank)

    def topology_record_groups(self, moments: bool = True) -> list[tuple[str, torch.Tensor, int | None]]:
        return state.topology_record_groups(self.model, self.weights, self.grads, self.rank, moments)

    def checkpoint_state(self) -> dict[str, torch.Tensor]:
        return state.checkpoint_state(self.model, self.weights, self.grads, self.dense_names, self.expert_names,
                                      self.rank)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return full_state_dict(self.model, self.group)


def checkpoint_shapes(cfg) -> dict[str, torch.Tensor]:
    """checkpoint_state() of a trainer of this config built on the meta device (shapes and dtypes, no
    memory), whose keys are the same at every EP size and dense sharding, so the union over ranks."""
    return Trainer(OmegaConf.merge(cfg, {"device": "meta"})).checkpoint_state()


def checkpoint_nbytes(cfg, shapes: dict[str, torch.Tensor] | None = None) -> dict[str, int]:
    """The bytes of a checkpoint of this config by part ('bfloat16 weights', 'fp32 masters', 'AdamW
    moments', 'AdamW steps'), from checkpoint_shapes(cfg) (`shapes`: those, built already)."""
    parts = {f"{cfg.model.dtype} weights": 0, "fp32 masters": 0, "AdamW moments": 0, "AdamW steps": 0}
    for key, t in (checkpoint_shapes(cfg) if shapes is None else shapes).items():
        part = ("AdamW steps" if key.endswith("/step") else "AdamW moments") if key.startswith("optim/") else (
            "fp32 masters" if key.startswith("master/") else f"{cfg.model.dtype} weights")
        parts[part] += t.numel() * t.element_size()
    return parts
