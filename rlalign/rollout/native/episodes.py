"""Multi-turn episodes on the native engine: a sequence whose assistant turn ends is paused (it keeps
its slot and KV pages, runs no rows) until its Continuations answers; an observation is appended and
prefilled onto the same sequence (the turn's last sampled token too: it was never written to the
cache), then decoding resumes with a fresh per-turn count. Positions go on counting, so by batch and
chunk invariance a continued turn samples the tokens, with the logprob bits, of a fresh prefill of the
whole history."""

from __future__ import annotations

import torch

from rlalign.rollout.native.pages import KVState
from rlalign.rollout.native.scheduler import Scheduler, Seq, Step
from rlalign.rollout.types import Continuations
from rlalign.sampling_params import SamplingParams
from rlalign.sequences import Rollout, policy_mask
from rlalign.values import is_int


class EpisodeScheduler(Scheduler):
    """Scheduler of episodes: a turn ends at EOS ("eos"), at `episodes.stopped` ("stop") or at the
    per-turn limit params.max_new_tokens or the episode's max_len ("length"); then `episodes.ended`
    hears it and the sequence pauses until `resume` brings its answer."""

    def __init__(self, prompts: list[list[int]], sample_ids: list[int], params: SamplingParams, state: KVState,
                 max_seqs: int, max_lens: list[int], budget: int, episodes: Continuations, vocab_size: int):
        super().__init__(prompts, sample_ids, params, state, max_seqs, max_lens, budget)
        self.episodes, self.vocab_size = episodes, vocab_size
        self.paused: dict[int, Seq] = {}  # request index -> its sequence, waiting for its answer
        self.unsettled: set[int] = set()  # paused by the last postprocess: the lookahead step in flight may hold rows
        self.held: list[tuple[int, list[int] | None]] = []  # answers for unsettled sequences
        self.turn = [[] for _ in prompts]  # each request's tokens sampled in its current turn
        self.turn_no = [0] * len(prompts)
        for o in self.out:
            o.turns = []

    def postprocess(self, step: Step, tokens: list[int]) -> list[int]:
        """As Scheduler.postprocess, with turns: a sequence whose turn ends pauses (slot and pages kept)
        and its turn goes to `episodes.ended`."""
        eos, ep, ended, b_idx = self.params.eos_token_id, self.episodes, [], []
        for (seq, _), t in zip(step.sample_at, tokens):
            if seq.done:  # a lookahead row of a sequence ended or paused by the step before
                self.discarded_rows += 1
                b_idx.append(-1)
                continue
            b = seq.b
            b_idx.append(b)
            seq.tokens.append(t)
            self.out[b].tokens.append(t)
            turn = self.turn[b]
            turn.append(t)
            if eos is not None and t == eos:
                reason = "eos"
            elif ep.stopped(b, turn):
                reason = "stop"
            elif len(seq.tokens) == seq.limit:
                reason = "length"
            else:
                continue
            seq.done = True
            ended.append((seq, reason))
        self.unsettled = {seq.b for seq, _ in ended}
        if ended:
            self.running = [seq for seq in self.running if not seq.done]
        for seq, reason in ended:
            b = seq.b
            self.paused[b] = seq
            o = self.out[b]
            o.finish_reason = reason
            turn, self.turn[b] = self.turn[b], []
            o.turns.extend([self.turn_no[b]] * len(turn))  # the turn's sampled tokens, labelled once it ends
            self.turn_no[b] += 1
            ep.ended(b, turn, reason)
        return b_idx

    def resume(self, answers: list[tuple[int, list[int] | None]], in_flight: bool) -> None:
        """Apply `episodes.poll`'s answers: observation tokens continue the episode, None ends it (its
        slot and pages freed). `in_flight`: a step is enqueued and not read back; answers for sequences
        it may hold rows of (paused by the last postprocess) wait until it is, so that those rows are
        discarded as rows of a paused sequence."""
        ready, self.held = self.held + list(answers), []
        for b, obs in ready:
            if b not in self.paused:
                raise ValueError(f"Continuations.poll answered request {b}, whose turn is not waiting for an answer "
                                 "(answered twice, or never ended)")
            if in_flight and b in self.unsettled:
                self.held.append((b, obs))
                continue
            seq = self.paused.pop(b)
            if obs is None:
                self.free_slots.append(seq.slot)
                self.free_pages.extend(reversed(seq.pages))
            else:
                self._continue(seq, obs)

    def _continue(self, seq: Seq, obs: list[int]) -> None:
        """The observation appended; the sequence prefills from its last sampled token on, then decodes."""
        o = self.out[seq.b]
        if not all(is_int(t) and 0 <= t < self.vocab_size for t in obs):
            bad = next(t for t in obs if not (is_int(t) and 0 <= t < self.vocab_size))
            raise ValueError(f"sample {o.sample_id}: observation token {bad!r} after turn {self.turn_no[seq.b] - 1} "
                             f"is not a token id in [0, {self.vocab_size})")
        n, max_len = len(seq.tokens) + len(obs), self.max_lens[seq.b]
        if n >= max_len:
            raise ValueError(f"sample {o.sample_id}: an observation of {len(obs)} tokens after turn "
                             f"{self.turn_no[seq.b] - 1} makes the episode {n} tokens long, leaving no room to "
                             f"sample within its max_len={max_len} (Continuations.max_len: its KV pages); "
                             "end the episode instead (answer None)")
        seq.n_cached = len(seq.tokens) - 1
        seq.tokens.extend(obs)
        o.tokens.extend(obs)
        o.turns.extend([-1] * len(obs))
        seq.n_prefill, seq.limit, seq.done = n, min(n + self.params.max_new_tokens, max_len), False
        self.running.append(seq)

    def waiting(self) -> bool:
        """Whether an episode waits for its answer (then generate goes on, with or without rows)."""
        if self.paused and not self.held and self.episodes.pending() == 0:
            b = next(iter(self.paused))
            raise RuntimeError(f"sample {self.out[b].sample_id}: its turn ended (Continuations.ended) but poll never "
                               "answered it, and Continuations.pending() is 0")
        return bool(self.paused)


def spread_logprobs(out: list[Rollout]) -> list[Rollout]:
    """Each episode's logprobs (its policy tokens', in order) spread over all its tokens: 0.0 at
    observation tokens."""
    for o in out:
        full = torch.zeros(len(o.tokens), dtype=torch.float32)
        full[policy_mask(o.turns, len(o.tokens))] = o.logprobs
        o.logprobs = full
    return out
