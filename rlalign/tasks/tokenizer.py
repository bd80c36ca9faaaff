"""Tokenizers: a character-level one for the built-in tasks (fits the tiny models' 64 ids) and a
Hugging Face tokenizer from a local directory for real checkpoints.

Which one a run uses (task.tokenizer; make_tokenizer is the one place this is decided):
    null    the model directory's (model.path) when it holds one, else the char tokenizer
    char    the char tokenizer, whatever model.path holds
    DIR     the Hugging Face tokenizer in DIR
With task.chat=true a prompt is the user turn of the tokenizer's chat template followed by its
generation prompt. The eos id is the tokenizer's. An environment's observation (observation_encoder) is
its text as it is, or with task.chat=true the chat template's next message after the assistant turn.
"""

from __future__ import annotations

import json
import os
import string
from collections.abc import Callable
from pathlib import Path

PAD_ID, EOS_ID = 0, 1
CHARS = string.digits + string.ascii_lowercase + "+-*=:;,. ?!()<>|#@"  # 54 symbols, ids 2..55
# files that make a directory a Hugging Face tokenizer (AutoTokenizer reads them)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


class CharTokenizer:
    pad_token_id, eos_token_id = PAD_ID, EOS_ID
    name, chat = "the char tokenizer", False

    def __init__(self, chars: str = CHARS, hint: str = ""):
        self.chars, self.hint = chars, hint
        self.vocab_size = len(chars) + 2
        self._id = {c: i + 2 for i, c in enumerate(chars)}

    def encode(self, text: str, where: str = "text", template: bool = True) -> list[int]:
        bad = sorted({c for c in text if c not in self._id})
        if bad:
            raise ValueError(f"{where}: characters {bad!r} are not in the char tokenizer's alphabet "
                             f"{self.chars!r}{self.hint}")
        return [self._id[c] for c in text]

    def describe(self) -> str:
        return f"{self.name} ({self.vocab_size} ids){self.hint}"

    def decode(self, ids: list[int]) -> str:
        return "".join(self.chars[i - 2] if 2 <= i < self.vocab_size else "" for i in ids)

    def save_hf(self, directory: Path) -> list[Path]:
        """This tokenizer as Hugging Face files in `directory` (tokenizer.json, tokenizer_config.json), which
        AutoTokenizer and so vLLM load with the same ids and text: one token per character, eos '</s>',
        pad '<pad>'; a character outside the alphabet is an error there too (no unknown token)."""
        from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

        tok = Tokenizer(models.WordLevel({"<pad>": PAD_ID, "</s>": EOS_ID, **self._id}, unk_token=None))
        tok.pre_tokenizer, tok.decoder = pre_tokenizers.Split("", "isolated"), decoders.Fuse()
        tok.add_special_tokens([AddedToken("<pad>", special=True), AddedToken("</s>", special=True)])
        files = [Path(directory) / "tokenizer.json", Path(directory) / "tokenizer_config.json"]
        tok.save(str(files[0]))
        files[1].write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "</s>",
                                        "pad_token": "<pad>", "clean_up_tokenization_spaces": False}, indent=2) + "\n")
        return files


class HFTokenizer:
    """A tokenizer loaded from a local directory (tokenizer.json etc.); no hub access."""

    def __init__(self, path: str | os.PathLike, chat: bool = False):
        if not Path(path).is_dir():
            raise FileNotFoundError(f"tokenizer directory {str(path)!r} does not exist")
        self.name, self.chat = f"the tokenizer in {path}", chat
        from transformers import AutoTokenizer

        try:
            self.tok = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        except Exception as e:  # a broken file: one line naming the directory
            text = " ".join(str(e).split())[:300]
            raise ValueError(f"{self.name}: cannot load it ({type(e).__name__}: {text})") from None
        if self.tok.eos_token_id is None:
            raise ValueError(f"{self.name} has no eos token, so no rollout could end: set \"eos_token\" in "
                             f"{Path(path) / 'tokenizer_config.json'}")
        if chat and not self.tok.chat_template:
            raise ValueError(f"task.chat=true: {self.name} has no chat template (\"chat_template\" in "
                             f"tokenizer_config.json, or chat_template.jinja)")
        self.eos_token_id = self.tok.eos_token_id
        self.pad_token_id = self.tok.pad_token_id if self.tok.pad_token_id is not None else 0
        self.vocab_size = len(self.tok)

    def encode(self, text: str, where: str = "text", template: bool = True) -> list[int]:
        """A prompt's ids (with task.chat and `template`: its user turn in the chat template, then the
        generation prompt; an environment's observation is encoded as it is); text the tokenizer knows
        only as its unknown token is refused, naming `where`."""
        if self.chat and template:
            text = self.tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                tokenize=False)
        return self.ids(text, where)

    def ids(self, text: str, where: str) -> list[int]:
        """text's ids as they are (no template, no special tokens added), refusing unknown text."""
        ids = self.tok.encode(text, add_special_tokens=False)
        unk = self.tok.unk_token_id
        if unk is not None and unk in ids:
            self._refuse_unknown(text, where)
        return ids

    def _refuse_unknown(self, text: str, where: str) -> None:
        unk = self.tok.unk_token
        try:
            enc = self.tok(text, add_special_tokens=False, return_offsets_mapping=True)
            spans = sorted({text[s:e] for i, (s, e) in zip(enc["input_ids"], enc["offset_mapping"])
                            if i == self.tok.unk_token_id} - {unk})  # the unknown token written out is no error
        except NotImplementedError:  # a slow tokenizer has no offsets
            spans = None if unk not in text else []
        if spans == []:
            return
        what = f"text {spans!r}" if spans else "text"
        raise ValueError(f"{where}: {what} not in the vocabulary of {self.name} (it encodes to its unknown token "
                         f"{unk!r})")

    def describe(self) -> str:
        chat = ", its chat template applied to each prompt" if self.chat else ""
        return f"{self.name} ({self.vocab_size} ids, eos {self.tok.eos_token!r} = id {self.eos_token_id}{chat})"

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)


class ChatObservations:
    """With task.chat=true: an observation as the chat template's delta after an assistant turn, i.e.
    what the template renders after the assistant's content for [user, assistant, {"role": role,
    "content": text}] with the generation prompt (the assistant's end of turn, the message, the next
    assistant header). A turn that ended at eos holds the end-of-turn token already: the delta starts
    after it. A turn that ended otherwise (a stop string, the per-turn limit) gets the template's end
    of turn as the delta's first tokens (observation tokens: no loss). Each delta is tokenized on its
    own; where it starts with a special token (ChatML's <|im_end|>, or the text after it) the episode's
    tokens are the tokenization of the template's rendering of the whole conversation."""

    USER, TURN, PROBE = "RLALIGN_USER", "RLALIGN_TURN", "RLALIGN_OBSERVATION"

    def __init__(self, tok: HFTokenizer, role: str):
        self.tok, self.role = tok, role
        self.template = f"the chat template of {tok.name}"
        self.eos = tok.tok.eos_token
        user = " (set task.observation_role=user)" if role != "user" else ""
        after = self._after_turn(self.PROBE, user)
        if after.count(self.PROBE) != 1:
            raise ValueError(f"task.observation_role={role!r}: {self.template} renders no content for a message "
                             f"of role {role!r}{user}")
        if not after.startswith(self.eos):
            raise ValueError(f"task.chat=true: {self.template} ends an assistant message with {after[:24]!r}, not "
                             f"with the eos token {self.eos!r}, so a turn that ends at eos cannot go on with an "
                             f"observation")

    def __call__(self, text: str, closed: bool, where: str) -> list[int]:
        """The observation's ids after a turn that ended at eos (`closed`) or not."""
        after = self._after_turn(text, "")
        return self.tok.ids(after[len(self.eos):] if closed else after, where)

    def _after_turn(self, text: str, hint: str) -> str:
        messages = [{"role": "user", "content": self.USER}, {"role": "assistant", "content": self.TURN},
                    {"role": self.role, "content": text}]
        try:
            full = self.tok.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception as e:  # the template's own refusal (jinja's raise_exception), one line
            msg = " ".join(str(e).split())[:200]
            raise ValueError(f"task.observation_role={self.role!r}: {self.template} cannot render a message of "
                             f"role {self.role!r} after an assistant turn ({type(e).__name__}: {msg}){hint}") from None
        if full.count(self.TURN) != 1:
            raise ValueError(f"task.chat=true: {self.template} does not render an assistant message's content as it "
                             f"is, so the observation's place after a turn is unknown")
        return full[full.index(self.TURN) + len(self.TURN):]


def observation_encoder(tok, role: str = "tool") -> Callable[[str, bool, str], list[int]]:
    """How an environment's observation text becomes the episode's next tokens: (text, whether the
    turn ended at eos, where) -> ids. The text as it is; with task.chat=true ChatObservations."""
    if tok.chat:
        return ChatObservations(tok, role)
    return lambda text, closed, where: tok.encode(text, where, template=False)


def has_tokenizer(path: str | os.PathLike | None) -> bool:
    return bool(path) and any((Path(path) / f).is_file() for f in TOKENIZER_FILES)


def tokenizer_dir(spec: str | None, model_path: str | None = None) -> str | None:
    """The directory of the run's Hugging Face tokenizer, or None for the char tokenizer (module docstring)."""
    if spec == "char" or (spec is None and not has_tokenizer(model_path)):
        return None
    return spec or model_path


def make_tokenizer(spec: str | None, model_path: str | None = None, chat: bool = False):
    """The run's tokenizer from task.tokenizer (`spec`), model.path and task.chat (module docstring)."""
    if tokenizer_dir(spec, model_path) is None:
        if chat:
            raise ValueError("task.chat=true needs a tokenizer with a chat template, and the char tokenizer has "
                             "none (model.path holds no tokenizer files; set task.tokenizer=DIR)")
        hint = ""
        if model_path and spec is None:
            hint = (f" (model.path={model_path} holds none of {', '.join(TOKENIZER_FILES)}, so the built-in char "
                    f"tokenizer is used; task.tokenizer=DIR names a Hugging Face tokenizer)")
        return CharTokenizer(hint=hint)
    return HFTokenizer(tokenizer_dir(spec, model_path), chat)
