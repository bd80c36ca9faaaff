"""Which rows the native engine runs each step, and the slots and pages its sequences hold."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from rlalign.rollout.native.pages import KVState
from rlalign.sampling_params import SamplingParams
from rlalign.sequences import Rollout


@dataclass
class Seq:
    """A request in flight: its tokens so far (prompt + sampled, in an episode also observations), how
    many have keys/values in the cache, its row of the block table and its pages."""

    b: int  # index into the caller's lists
    tokens: list[int]
    n_prefill: int  # tokens given, not sampled (the prompt; in an episode up to the latest observation)
    slot: int
    pages: list[int]
    limit: int  # len(tokens) at which the current turn ends by length
    n_cached: int = 0
    done: bool = False  # runs no rows: ended (its slot and pages are free), or paused between an episode's turns

    @property
    def decoding(self) -> bool:
        return self.n_cached >= self.n_prefill


@dataclass
class Step:
    """One engine step: `rows` (sequence, position) run through the model; the rows named in
    `sample_at` (sequence, row index) sample their sequence's next token. `follow` (lookahead):
    row i's input token is the previous step's sampled token number follow[i], still on the device.
    `runs`: the prompt chunks, the rows after the decode rows, each (first row, rows, first position,
    block-table row) of consecutive positions of one sequence (the attention runs them as prefill tiles)."""

    rows: list[tuple[Seq, int]] = field(default_factory=list)
    sample_at: list[tuple[Seq, int]] = field(default_factory=list)
    follow: list[int] | None = None
    runs: list[tuple[int, int, int, int]] = field(default_factory=list)


class Scheduler:
    """Continuous batching: requests are admitted in order while a slot and the pages for their
    longest length (`max_lens`: tokens in all) are free; each step holds one row per decoding
    sequence, then prompt chunks within the token budget; a finished sequence frees its slot and
    pages at once."""

    def __init__(self, prompts: list[list[int]], sample_ids: list[int], params: SamplingParams, state: KVState,
                 max_seqs: int, max_lens: list[int], budget: int):
        self.prompts, self.params, self.state = prompts, params, state
        self.max_lens, self.budget = max_lens, budget or float("inf")
        self.pages_of = [-(-n // state.page_size) for n in max_lens]
        self.free_pages = list(range(state.num_pages - 1, -1, -1))
        self.free_slots = list(range(max_seqs - 1, -1, -1))
        self.queue, self.running = deque(range(len(prompts))), []
        self.out = [Rollout(s, list(p), params=params) for s, p in zip(sample_ids, prompts)]
        self.discarded_rows = 0

    def slot(self, seq: Seq, p: int) -> int:
        """The KV cache slot of position p of `seq`."""
        ps = self.state.page_size
        return seq.pages[p // ps] * ps + p % ps

    def can_admit(self) -> bool:
        return bool(self.queue and self.free_slots and len(self.free_pages) >= self.pages_of[self.queue[0]])

    def _admit(self) -> None:
        """Admit queued requests while a slot and their pages are free."""
        admitted = []
        while self.can_admit():
            b = self.queue.popleft()
            n = len(self.prompts[b])
            seq = Seq(b, list(self.prompts[b]), n, self.free_slots.pop(),
                      [self.free_pages.pop() for _ in range(self.pages_of[b])],
                      min(n + self.params.max_new_tokens, self.max_lens[b]))
            admitted.append((seq.slot, seq.pages))
            self.running.append(seq)
        self.state.set_rows(admitted)

    def _add_prompt_chunks(self, step: Step) -> None:
        """Prompt chunks of the sequences still prefilling (in an episode also observations), in admission
        order, within the budget; each one's rows (consecutive positions of one sequence) also named in
        step.runs."""
        for seq in self.running:
            n = int(min(self.budget - len(step.rows), seq.n_prefill - seq.n_cached)) if not seq.decoding else 0
            if n > 0:
                step.runs.append((len(step.rows), n, seq.n_cached, seq.slot))
                step.rows.extend((seq, p) for p in range(seq.n_cached, seq.n_cached + n))
                seq.n_cached += n
                if seq.decoding:
                    step.sample_at.append((seq, len(step.rows) - 1))

    def schedule(self) -> Step:
        """Admit what fits, then this step's rows: decode rows first (one each), then prompt chunks in
        admission order within the budget. No rows: nothing is left to run."""
        self._admit()
        step = Step()
        for seq in self.running:
            if seq.decoding:
                step.sample_at.append((seq, len(step.rows)))
                step.rows.append((seq, len(seq.tokens) - 1))
        self._add_prompt_chunks(step)
        return step

    def lookahead(self, pending: Step) -> Step | None:
        """The step after `pending`, to enqueue before pending's tokens are read back: first the rows of
        pending's samples whose sequences go on, each at the position of the token pending samples for
        it (its input token taken on the device: `follow`), then what schedule() would add: requests
        admitted into the slots and pages free now, and prompt chunks within the budget (the prompts'
        tokens are known on the host). A sequence that pending ends with EOS (or in an episode with a
        stop: not known yet) still gets a row: it reads and writes only its own pages at a position
        below its length limit, and its sample is discarded (postprocess). Sequences that pending ends
        by length are left out; their slots and pages are freed by postprocess, for the step after.
        Every kept row computes what the step after reading pending back would compute for it: the
        same tokens and logprob bits (batch invariance)."""
        self._admit()
        step = Step(follow=[])
        for j, (seq, _) in enumerate(pending.sample_at):
            if seq.done or len(seq.tokens) + 1 >= seq.limit:
                continue
            step.sample_at.append((seq, len(step.rows)))
            step.rows.append((seq, len(seq.tokens)))
            step.follow.append(j)
        self._add_prompt_chunks(step)
        return step if step.rows else None

    def postprocess(self, step: Step, tokens: list[int]) -> list[int]:
        """The step's sampled tokens appended; finished sequences' slots and pages freed (the next
        step admits from the queue). Returns each sample's request index (-1: a discarded lookahead
        row of a sequence that had already ended)."""
        eos, finished, b_idx = self.params.eos_token_id, [], []
        for (seq, _), t in zip(step.sample_at, tokens):
            if seq.done:
                self.discarded_rows += 1
                b_idx.append(-1)
                continue
            b_idx.append(seq.b)
            seq.tokens.append(t)
            o = self.out[seq.b]
            o.tokens.append(t)
            if eos is not None and t == eos:
                o.finish_reason = "eos"
            elif len(seq.tokens) == seq.limit:
                o.finish_reason = "length"
            else:
                continue
            seq.done = True
            finished.append(seq)
        if finished:
            self.running = [seq for seq in self.running if not seq.done]
        for seq in finished:
            self.free_slots.append(seq.slot)
            self.free_pages.extend(reversed(seq.pages))
        return b_idx
