"""Recorded episodes: the Continuations (rlalign.rollout.types) of a replay. Each episode's turns and
observations come from a record (a mismatch dump's responses and turns, rlalign.step.dump_mismatch),
not from an environment: assistant turn k ends when it is as long as the recorded turn k (whatever
ended it in the run: EOS, a stop string, the per-turn limit), the recorded observation after it
continues the episode, and the episode ends after its last recorded turn. A replay that samples
other tokens still follows the recorded boundaries and observations: the difference shows in the
tokens and logprobs it returns, never as a turn cut elsewhere."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RecordedEpisode:
    lengths: list[int]  # per assistant turn: its tokens
    observations: list[list[int]]  # after each assistant turn but the last: the observation's tokens


def split_episode(response: list[int], turns: list[int] | None, where: str) -> RecordedEpisode:
    """An episode's response (its turns and observations) and its Rollout.turns (per token: its
    assistant turn, -1 an observation token; None: one turn) split into turns and observations.
    `where` names the episode in the error a malformed record raises."""
    if turns is None:
        turns = [0] * len(response)
    if len(turns) != len(response) or not response:
        raise ValueError(f"{where}: {len(turns)} turns for {len(response)} response tokens (need one per token, "
                         "and at least one)")
    lengths, observations, obs = [], [], []
    for j, t in enumerate(turns):
        if not isinstance(t, int) or isinstance(t, bool) or t < -1:
            raise ValueError(f"{where}: turns[{j}]={t!r} is neither an assistant turn (an int >= 0) nor -1")
        if t == -1:
            if not lengths:
                raise ValueError(f"{where}: starts with an observation token (turns[0]=-1); an episode starts with "
                                 "an assistant turn")
            obs.append(response[j])
        elif lengths and t == len(lengths) - 1 and turns[j - 1] == t:
            lengths[-1] += 1
        elif t == len(lengths):
            if lengths:
                observations.append(obs)
                obs = []
            lengths.append(1)
        else:
            raise ValueError(f"{where}: turns[{j}]={t} after assistant turn {len(lengths) - 1}: turns must run "
                             "0, 1, 2, ... each in one piece, observations (-1) between them")
    if obs:
        raise ValueError(f"{where}: ends with {len(obs)} observation tokens; an episode ends with an assistant turn")
    return RecordedEpisode(lengths, observations)


class RecordedEpisodes:
    """Implements rlalign.rollout.types.Continuations for one generate call whose request b replays
    episodes[b] after its prompt of prompt_lens[b] tokens."""

    def __init__(self, episodes: list[RecordedEpisode], prompt_lens: list[int]):
        self.episodes, self.prompt_lens = episodes, prompt_lens
        self.turn = [0] * len(episodes)  # request b's assistant turns ended
        self.answers: list[tuple[int, list[int] | None]] = []  # ready for the next poll

    def max_len(self, b: int) -> int:
        ep = self.episodes[b]
        return self.prompt_lens[b] + sum(ep.lengths) + sum(len(o) for o in ep.observations)

    def stopped(self, b: int, turn: list[int]) -> bool:
        return len(turn) >= self.episodes[b].lengths[self.turn[b]]

    def ended(self, b: int, turn: list[int], reason: str) -> None:
        ep, k = self.episodes[b], self.turn[b]
        self.turn[b] += 1
        self.answers.append((b, ep.observations[k] if k < len(ep.observations) else None))

    def poll(self, wait: bool) -> list[tuple[int, list[int] | None]]:
        out, self.answers = self.answers, []
        return out

    def pending(self) -> int:
        return len(self.answers)
