"""Observations in the chat template (task.chat=true): each is the template's delta after the
assistant turn (its end of turn, a message of task.observation_role, the generation prompt), so an
episode's tokens are the template's rendering of the whole conversation; a turn ended by a stop
string gets the end-of-turn token first. Without chat the observation's text is appended as it is.
A template that cannot render the role is a clear error. The engine here is scripted."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_tasks_user import write_tokenizer as write_char_tokenizer

from rlalign.agent import EpisodeDriver, EpisodeLimits, Step
from rlalign.config import load_config
from rlalign.sampling_params import SamplingParams
from rlalign.sequences import Rollout
from rlalign.tasks import Example
from rlalign.tasks.tokenizer import HFTokenizer

SPECIALS = ["<pad>", "<unk>", "<|im_start|>", "<|im_end|>"]  # eos: <|im_end|>, the template's end of turn
ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789:<>-+=?()_/ \n"
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
NO_TOOL = ("{% for m in messages %}{% if m['role'] not in ['system', 'user', 'assistant'] %}"
           "{{ raise_exception('Conversation roles must be user or assistant') }}{% endif %}"
           "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
           "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# Qwen3's way: the last assistant message gets an empty thinking block, tool replies are user turns
QWEN3_LIKE = ("{% for m in messages %}{% if m.role == 'assistant' %}<|im_start|>assistant\n"
              "{% if loop.last %}<think>\n\n</think>\n\n{% endif %}{{ m.content }}<|im_end|>\n"
              "{% elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response>"
              "<|im_end|>\n{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
              "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
DROPS_TOOL = CHATML.replace("{% for m in messages %}", "{% for m in messages if m['role'] != 'tool' %}")
ROW = Example("what is 2+3", "5")
# each assistant turn (its text, how it ended) and the environment's answers
TURNS = [("calc(2+3)", "eos"), ("calc(5", "stop"), ("5", "eos")]
OBSERVATIONS = ["5", "err"]


def write_tokenizer(d: Path, template: str, eos: str = "<|im_end|>") -> Path:
    """A character-level WordLevel tokenizer (53 ids) with a chat template."""
    return write_char_tokenizer(d, template, SPECIALS, ALPHABET, eos)


class Scripted:
    """Answers OBSERVATIONS in turn, then done."""

    def reset(self, example, seed):
        self.k = 0

    def step(self, action: str) -> Step:
        self.k += 1
        return Step(done=True) if self.k > len(OBSERVATIONS) else Step(OBSERVATIONS[self.k - 1])


def episode(tok: HFTokenizer, role: str = "tool") -> tuple[list[int], Rollout]:
    """The prompt and the episode of TURNS (eos appended to a turn that ended at eos)."""
    prompt = tok.encode(ROW.prompt)
    driver = EpisodeDriver(Scripted, tok, [ROW], [prompt], [3], 0, EpisodeLimits(4, 256, observation_role=role))
    tokens: list[int] = []
    for k, (text, reason) in enumerate(TURNS):
        turn = tok.ids(text, "turn") + ([tok.eos_token_id] if reason == "eos" else [])
        tokens += turn
        driver.ended(0, turn, reason)
        answers = []
        while not answers:
            answers = driver.poll(wait=True)
        (b, obs), = answers
        assert (obs is None) == (k == len(TURNS) - 1)
        tokens += obs or []
    return prompt, driver.finish([Rollout(3, prompt, tokens, torch.zeros(len(tokens)), params=SamplingParams())])[0]


def conversation(role: str = "tool") -> list[dict]:
    messages = [{"role": "user", "content": ROW.prompt}]
    for k, (text, _) in enumerate(TURNS):
        messages.append({"role": "assistant", "content": text})
        if k < len(OBSERVATIONS):
            messages.append({"role": role, "content": OBSERVATIONS[k]})
    return messages


@pytest.mark.parametrize("role", ["tool", "user"])
def test_chat_observations_make_the_episode_the_templates_rendering_of_the_conversation(tmp_path, role):
    tok = HFTokenizer(write_tokenizer(tmp_path / "tok", CHATML), chat=True)
    prompt, r = episode(tok, role)
    full = tok.tok.apply_chat_template(conversation(role), tokenize=False)
    # the whole rendering, but for the "\n" the template writes after the last <|im_end|> (the model stops at it)
    assert prompt + r.tokens + tok.ids("\n", "") == tok.ids(full, "the rendering")
    end, start = tok.tok.convert_tokens_to_ids(["<|im_end|>", "<|im_start|>"])
    obs = [t for t, k in zip(r.tokens, r.turns) if k == -1]
    first = tok.ids(f"\n<|im_start|>{role}\n5<|im_end|>\n<|im_start|>assistant\n", "")  # after an eos turn
    second = tok.ids(f"<|im_end|>\n<|im_start|>{role}\nerr<|im_end|>\n<|im_start|>assistant\n", "")  # after a stop
    assert obs == first + second and first[1] == start and second[0] == end
    assert r.turns.count(-1) == r.episode["observation_tokens"] == len(first) + len(second)
    assert [r.turns[i] for i in range(len(r.turns)) if r.tokens[i] == end and r.turns[i] >= 0] == [0, 2]


def test_a_template_that_re_renders_the_last_assistant_turn_gets_the_delta_after_the_turns_content(tmp_path):
    """Rendering [user, assistant] is no prefix of [user, assistant, tool] here (the thinking block
    moves); the observation is what the template writes after the assistant's content."""
    tok = HFTokenizer(write_tokenizer(tmp_path / "tok", QWEN3_LIKE), chat=True)
    short = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    render = tok.tok.apply_chat_template
    assert not render(short + [{"role": "tool", "content": "5"}], add_generation_prompt=True,
                      tokenize=False).startswith(render(short, tokenize=False))
    _, r = episode(tok)
    reply = "<|im_start|>user\n<tool_response>\n{}\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    want = tok.ids("\n" + reply.format("5"), "") + tok.ids("<|im_end|>\n" + reply.format("err"), "")
    assert [t for t, k in zip(r.tokens, r.turns) if k == -1] == want


def test_without_chat_the_observations_are_their_text_as_it_is(tmp_path):
    """The negative twin: the same tokenizer with task.chat=false appends the raw text."""
    tok = HFTokenizer(write_tokenizer(tmp_path / "tok", CHATML), chat=False)
    prompt, r = episode(tok)
    assert [t for t, k in zip(r.tokens, r.turns) if k == -1] == tok.ids("5", "") + tok.ids("err", "")
    chat = HFTokenizer(tmp_path / "tok", chat=True)
    full = chat.tok.apply_chat_template(conversation(), tokenize=False)
    assert prompt + r.tokens + tok.ids("\n", "") != chat.ids(full, "the rendering")


@pytest.mark.parametrize("template, what", [
    (NO_TOOL, r"cannot render a message of role 'tool' after an assistant turn \(TemplateError: Conversation roles "
              r"must be user or assistant\) \(set task.observation_role=user\)"),
    (DROPS_TOOL, r"renders no content for a message of role 'tool' \(set task.observation_role=user\)"),
], ids=["raises", "drops"])
def test_a_template_without_the_tool_role_is_an_error_suggesting_user(tmp_path, template, what):
    d = write_tokenizer(tmp_path / "tok", template)
    with pytest.raises(ValueError, match=rf"^task.observation_role='tool': the chat template of the tokenizer in "
                                         rf"{tmp_path}/tok {what}$"):
        episode(HFTokenizer(d, chat=True))
    prompt, r = episode(HFTokenizer(d, chat=True), role="user")  # the suggestion works
    assert r.finish_reason == "done" and r.turns.count(-1) > 0


def test_the_role_error_comes_before_any_actor(tmp_path):
    from rlalign.rl import train

    d = write_tokenizer(tmp_path / "tok", NO_TOOL)
    with pytest.raises(ValueError, match=r"task.observation_role='tool': .* \(set task.observation_role=user\)"):
        train(load_config(["task=calc", "task.chat=true", f"task.tokenizer={d}", f"run.dir={tmp_path / 'run'}"]))


def test_an_eos_that_is_not_the_templates_end_of_turn_is_an_error(tmp_path):
    d = write_tokenizer(tmp_path / "tok", CHATML, eos="<pad>")
    with pytest.raises(ValueError, match=r"^task.chat=true: the chat template of the tokenizer in .* ends an assistant "
                                         r"message with '<\|im_end\|>\\n.*', not with the eos token '<pad>', so a "
                                         r"turn that ends at eos cannot go on with an observation$"):
        episode(HFTokenizer(d, chat=True))
