"""A practitioner's own model tokenizer, data and reward (issue 43): the model directory's tokenizer
and its chat template are used, JSONL rows' extra fields and answers of any JSON type reach the
reward, a reward module in the working directory loads without PYTHONPATH, and bad input (a
tokenizer that cannot load, text outside the tokenizer, a reward that raises) is one line naming
the user's file and line. Everything runs in-process before any actor starts, except one short
`rlalign train` (the console script, from the user's directory)."""

import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

from rlalign import cli
from rlalign.config import load_config
from rlalign.rl import train
from rlalign.tasks import Example, load_reward, make_task
from rlalign.tasks.reward_calls import RewardCall, RewardCaller, RewardError
from rlalign.tasks.tokenizer import CharTokenizer, HFTokenizer, make_tokenizer

SPECIALS = ["<pad>", "<unk>", "<|im_start|>", "<|im_end|>", "<eos>"]  # eos = id 4 (the char tokenizer's is 1)
ALPHABET = "zyxwvutsrqponmlkjihgfedcba0123456789:>+= \né"  # ids in another order than the char tokenizer's
CHAT = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def write_tokenizer(d: Path, chat_template: str | None = CHAT, specials: list[str] = SPECIALS,
                    alphabet: str = ALPHABET, eos: str = "<eos>") -> Path:
    """A character-level WordLevel tokenizer (by default 48 ids, fits the tiny model's 64) with a chat template."""
    d.mkdir(parents=True, exist_ok=True)
    tk = Tokenizer(models.WordLevel({t: i for i, t in enumerate(specials + list(alphabet))}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tk.decoder = decoders.Fuse()
    tk.add_special_tokens(specials)
    tk.save(str(d / "tokenizer.json"))
    conf = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos, "pad_token": "<pad>",
            "unk_token": "<unk>", **({"chat_template": chat_template} if chat_template else {})}
    (d / "tokenizer_config.json").write_text(json.dumps(conf))
    return d


def raw_ids(d: Path, text: str) -> list[int]:
    return Tokenizer.from_file(str(d / "tokenizer.json")).encode(text, add_special_tokens=False).ids


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The tiny model saved as a HF directory, with the tokenizer beside its weights."""
    from rlalign.model import save_hf
    from rlalign.model.build import model_from_config

    d = tmp_path_factory.mktemp("user") / "model"
    save_hf(model_from_config(load_config([])), d)
    write_tokenizer(d)
    return d


def _before_actors(overrides, match, exc=(ValueError, FileNotFoundError)):
    """train() fails with `match` before it reaches the Ray cluster."""
    from rlalign import cluster

    def refuse(*a, **k):
        raise AssertionError("train() reached the Ray cluster: the bad input was not caught first")

    real, cluster.connect = cluster.connect, refuse
    try:
        with pytest.raises(exc, match=match):
            train(load_config(overrides))
    finally:
        cluster.connect = real


# --- the tokenizer ---------------------------------------------------------------------------------

def test_the_model_directorys_tokenizer_is_used(model_dir):
    tok = make_tokenizer(None, str(model_dir))
    assert isinstance(tok, HFTokenizer) and tok.eos_token_id == 4 and tok.vocab_size == 48
    assert tok.encode("ab:é") == raw_ids(model_dir, "ab:é") == [30, 29, 41, 47]
    assert tok.decode([30, 29, 41, 47, 4]) == "ab:é"
    # twin: task.tokenizer=char keeps the built-in one, whose ids differ and which has no 'é'
    char = make_tokenizer("char", str(model_dir))
    assert isinstance(char, CharTokenizer) and char.eos_token_id == 1
    assert char.encode("ab:") == [12, 13, 42] != tok.encode("ab:")
    with pytest.raises(ValueError, match=r"row 7: characters \['é'\] are not in the char tokenizer's alphabet"):
        char.encode("é", where="row 7")


def test_a_model_directory_without_a_tokenizer_says_the_char_tokenizer_is_used(model_dir, tmp_path):
    bare = tmp_path / "bare"
    shutil.copytree(model_dir, bare, ignore=shutil.ignore_patterns("tokenizer*"))
    tok = make_tokenizer(None, str(bare))
    assert isinstance(tok, CharTokenizer)
    with pytest.raises(ValueError, match=r"holds none of tokenizer.json.*task.tokenizer=DIR"):
        tok.encode("é", where="data.jsonl:2")
    assert isinstance(make_tokenizer(str(model_dir), str(bare)), HFTokenizer)  # task.tokenizer=DIR names one


def test_chat_applies_the_tokenizers_template_with_the_generation_prompt(model_dir, tmp_path):
    tok = make_tokenizer(None, str(model_dir), chat=True)
    templated = "<|im_start|>user\nab:<|im_end|>\n<|im_start|>assistant\n"
    assert tok.encode("ab:") == raw_ids(model_dir, templated)
    assert tok.encode("ab:")[:1] == [2] and len(tok.encode("ab:")) == 22
    assert make_tokenizer(None, str(model_dir)).encode("ab:") == [30, 29, 41]  # twin: chat off, the text alone
    with pytest.raises(ValueError, match="task.chat=true needs a tokenizer with a chat template"):
        make_tokenizer("char", str(model_dir), chat=True)
    plain = write_tokenizer(tmp_path / "plain", chat_template=None)
    with pytest.raises(ValueError, match=r"task.chat=true: the tokenizer in .*plain has no chat template"):
        make_tokenizer(str(plain), None, chat=True)


def test_text_outside_the_tokenizer_names_the_row(model_dir, tmp_path):
    data = tmp_path / "data.jsonl"
    data.write_text('{"prompt": "ab:", "answer": "ba"}\n{"prompt": "aQb:", "answer": "x"}\n')
    _before_actors([f"model.path={model_dir}", "task=jsonl", f"task.path={data}"],
                   r"data.jsonl:2: text \['Q'\] not in the vocabulary of the tokenizer in .*model "
                   r"\(it encodes to its unknown token '<unk>'\)")
    data.write_text('{"prompt": "ab:", "answer": "ba"}\n{"prompt": "a<unk>b:", "answer": "x"}\n')
    tok = make_tokenizer(None, str(model_dir))  # twin: the unknown token written out is the user's own
    assert tok.encode("a<unk>b:") == [30, 1, 29, 41]


def test_a_tokenizer_larger_than_the_model_is_refused_naming_both(model_dir):
    _before_actors([f"task.tokenizer={model_dir}", "model.vocab_size=40"],
                   r"the tokenizer in .*model has 48 ids but the model \(tiny-moe\) only 40")


def test_a_tokenizer_that_cannot_load_is_one_line(model_dir, tmp_path, capsys, monkeypatch):
    bad = tmp_path / "bad"
    shutil.copytree(model_dir, bad)
    (bad / "tokenizer.json").write_text('{"version": "1.0", "model": \n')
    monkeypatch.delenv("RLALIGN_DEBUG", raising=False)
    assert cli.main(["train", f"model.path={bad}", f"run.dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"rlalign train: error: the tokenizer in {bad}: cannot load it (") and \
        "Traceback" not in "\n".join(err)
    monkeypatch.setenv("RLALIGN_DEBUG", "1")  # twin: the debug switch shows where
    assert cli.main(["train", f"model.path={bad}", f"run.dir={tmp_path / 'run'}"]) == 2
    assert "Traceback (most recent call last)" in capsys.readouterr().err


# --- the data and the reward -----------------------------------------------------------------------

SEEN: list = []


def record_all(completion, answer, prompt, **fields):
    SEEN.append((answer, fields))
    return 0.0


def record_named(completion, answer, prompt, difficulty, tags=()):
    SEEN.append((answer, {"difficulty": difficulty, "tags": tags}))
    return 0.0


def two_args(completion, answer):
    return 0.0


def _jsonl(tmp_path, *rows) -> Path:
    p = tmp_path / "data.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return p


def test_extra_fields_and_answers_of_any_json_type_reach_the_reward(tmp_path):
    rows = [{"prompt": "1+1=", "answer": 2, "difficulty": 1, "meta": {"src": ["x"]}},
            {"prompt": "ab:", "answer": "ba", "difficulty": 3},
            {"prompt": "a:", "answer": [1.5, None], "difficulty": 2, "tags": ["t"]}]
    task = make_task("jsonl", 0, reward="tests.test_tasks_user:record_all", path=str(_jsonl(tmp_path, *rows)))
    seen = task.reward_fn.fn.__globals__["SEEN"]  # the module as the reward loaded it (pytest's is another)
    seen.clear()
    for ex in task.all_examples():
        task.reward("c", ex)
    assert seen == [(2, {"difficulty": 1, "meta": {"src": ["x"]}}), ("ba", {"difficulty": 3}),
                    ([1.5, None], {"difficulty": 2, "tags": ["t"]})]
    assert type(seen[0][0]) is int  # the number as JSON has it, not its text
    named = make_task("jsonl", 0, reward="tests.test_tasks_user:record_named", path=str(_jsonl(tmp_path, *rows)))
    seen.clear()
    named.reward("c", named.all_examples()[0])  # a reward naming fields gets those (meta is not one)
    assert seen == [(2, {"difficulty": 1, "tags": ()})]
    default = make_task("jsonl", 0, path=str(_jsonl(tmp_path, *rows)))  # exact_match compares the answer's JSON
    assert [default.reward(c, ex) for c, ex in zip(["2", "ba", "[1.5, null]"], default.all_examples())] == [1.0] * 3
    assert default.reward("2.0", default.all_examples()[0]) == 0.0


def test_a_reward_requiring_a_field_a_row_lacks_names_the_row(tmp_path):
    rows = [{"prompt": "a:", "answer": "a", "difficulty": 1}, {"prompt": "b:", "answer": "b"}]
    path = _jsonl(tmp_path, *rows)
    with pytest.raises(ValueError, match=r"data.jsonl:2: the reward task.reward=tests.test_tasks_user:record_named "
                                         r"\(.*test_tasks_user.py:\d+\) needs the field\(s\) \['difficulty'\], which "
                                         r"this row lacks"):
        make_task("jsonl", 0, reward="tests.test_tasks_user:record_named", path=str(path))
    make_task("jsonl", 0, reward="tests.test_tasks_user:record_all", path=str(path))  # twin: **fields needs none
    with pytest.raises(ValueError, match=r"a reward takes \(completion, answer, prompt, \*\*fields\); this one "
                                         r"takes \(completion, answer\)"):
        load_reward("tests.test_tasks_user:two_args")
    no_answer = _jsonl(tmp_path, {"prompt": "a:", "answer": 1}, {"prompt": "b:", "solution": 2})
    with pytest.raises(ValueError, match=r"data.jsonl:2: expected an object with a string field 'prompt' and a "
                                         r"field 'answer'"):
        make_task("jsonl", 0, path=str(no_answer))


@pytest.mark.parametrize("name, kwargs, message", [
    ("repeat", dict(length="abc"), r"task.kwargs.length='abc': must be an integer >= 1"),
    ("repeat", dict(length=None), r"task.kwargs.length=None: must be an integer >= 1"),
    ("repeat", dict(letters=""), r"task.kwargs.letters='': must be a non-empty string"),
    ("reverse", dict(min_len=3, max_len=2), r"task.kwargs.max_len=2: must be an integer >= min_len=3"),
    ("add", dict(max_operand=-5), r"task.kwargs.max_operand=-5: must be an integer >= 0"),
    ("calc", dict(max_operand=True), r"task.kwargs.max_operand=True: must be an integer >= 0"),
    ("guess", dict(size="8"), r"task.kwargs.size='8': must be an integer in \[2, 10\]"),
    ("repeat", dict(path="data.jsonl"), r"task.path='data.jsonl': only task=jsonl reads a file; this run's task is "
                                         r"'repeat'"),
])
def test_a_built_in_tasks_options_out_of_range_are_named(name, kwargs, message):
    """Each option a generated task cannot make examples with is refused naming its key, before any example is
    made (they were TypeErrors, an IndexError or randrange's error at the first step, and a task.path beside a
    generated task was ignored). The twin: the options at their range's ends make examples."""
    with pytest.raises(ValueError, match=message):
        make_task(name, 0, **kwargs)
    for name, ok in (("repeat", dict(letters="a", length=1)), ("reverse", dict(min_len=1, max_len=1)),
                     ("add", dict(max_operand=0)), ("calc", dict(max_operand=0)), ("guess", dict(size=10))):
        assert make_task(name, 0, **ok).examples(0, 2)


def _user_module(where: Path, body: str) -> str:
    """A module of the user's in `where`; its import name (unique, so no test sees another's)."""
    name = f"user_reward_{uuid.uuid4().hex[:8]}"
    where.mkdir(parents=True, exist_ok=True)
    (where / f"{name}.py").write_text(body)
    return name


@pytest.fixture
def isolated_path(monkeypatch):
    """sys.path without the working directory (as the `rlalign` console script has it), restored after."""
    cwd = os.getcwd()
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", cwd)])


def test_a_reward_module_in_the_working_directory_loads_without_pythonpath(tmp_path, monkeypatch, isolated_path):
    name = _user_module(tmp_path / "proj", "def score(completion, answer, prompt):\n    return 0.5\n")
    monkeypatch.chdir(tmp_path)  # twin first: from another directory it is not found
    with pytest.raises(ValueError, match=rf"cannot import module '{name}': ModuleNotFoundError"):
        load_reward(f"{name}:score")
    monkeypatch.chdir(tmp_path / "proj")
    assert load_reward(f"{name}:score")("c", Example("p", "a")) == 0.5
    monkeypatch.delitem(sys.modules, name)


BOOM = """import json


def score(completion, answer, prompt):
    return helper(completion)


def helper(text):
    return json.loads("{" + text)  # line 9: the library raises, the user's line is named
"""


def test_a_reward_that_raises_names_the_users_file_and_line(tmp_path, monkeypatch, isolated_path, capsys):
    name = _user_module(tmp_path, BOOM)
    monkeypatch.chdir(tmp_path)
    task = make_task("repeat", 0, reward=f"{name}:score")
    with pytest.raises(RewardError, match=rf"on sample 3: JSONDecodeError: .* \(at {tmp_path / name}.py:9 in helper\)"):
        RewardCaller(task).score([RewardCall("x", Example("a:", "aaaa"), "sample 3")], "step 0")
    # through the CLI (the check before the run): one line, the traceback only with RLALIGN_DEBUG=1
    monkeypatch.delenv("RLALIGN_DEBUG", raising=False)
    assert cli.main(["train", f"task.reward={name}:score", f"run.dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{name}.py:9 in helper" in err and "Traceback" not in err
    monkeypatch.setenv("RLALIGN_DEBUG", "1")
    assert cli.main(["train", f"task.reward={name}:score", f"run.dir={tmp_path / 'run'}"]) == 2
    assert "Traceback (most recent call last)" in capsys.readouterr().err
    monkeypatch.delitem(sys.modules, name)


def test_a_reward_too_large_for_a_float_is_named(tmp_path, monkeypatch, isolated_path):
    """An int reward beyond the doubles (10**400) is a RewardError naming the sample (it was an OverflowError
    traceback). The twin: 10**300 scores as the float it is."""
    name = _user_module(tmp_path, "def huge(c, a, p):\n    return 10**400\n\n\ndef big(c, a, p):\n    return 10**300\n")
    monkeypatch.chdir(tmp_path)
    call = [RewardCall("x", Example("a:", "aaaa"), "sample 2")]
    with pytest.raises(RewardError, match=r"reward function returned 10{19}\.\.\.0{8} on sample 2; "
                                          r"a reward must be finite"):
        RewardCaller(make_task("repeat", 0, reward=f"{name}:huge")).score(call, "step 0")
    assert RewardCaller(make_task("repeat", 0, reward=f"{name}:big")).score(call, "step 0") == ([1e300], 0)
    monkeypatch.delitem(sys.modules, name)


@pytest.mark.parametrize("body, code", [("import argparse\nargparse.ArgumentParser().parse_args()\n", "2"),
                                        ("import sys\nsys.exit(0)\n", "0")])
def test_a_reward_module_that_exits_as_it_loads_is_named(tmp_path, monkeypatch, isolated_path, capsys, body, code):
    """A module that parses the command line (argparse) or calls sys.exit as it loads: a ValueError naming the
    key, the module and its line (it ended rlalign: argparse's usage line read as rlalign's own, and exit 0 was
    a silent success). The twin: the same module guarded by `if __name__ == '__main__':` loads."""
    name = _user_module(tmp_path, body + "\n\ndef score(c, a, p):\n    return 1.0\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["rlalign", "train", "task.reward=x:score"])  # argparse reads it (not pytest's)
    with pytest.raises(ValueError, match=rf"task.reward='{name}:score': importing module '{name}' \({tmp_path / name}"
                                         rf"\.py:2 in <module>\) exited \(SystemExit {code}\): a module rlalign "
                                         r"imports must not run a script"):
        load_reward(f"{name}:score")
    capsys.readouterr()
    guarded = _user_module(tmp_path, "if __name__ == '__main__':\n" + "".join(f"    {ln}\n" for ln in
                                                                          body.splitlines())
                           + "\n\ndef score(c, a, p):\n    return 1.0\n")
    assert load_reward(f"{guarded}:score")("c", Example("p", "a")) == 1.0
    for n in (name, guarded):
        monkeypatch.delitem(sys.modules, n, raising=False)


def test_a_reward_module_that_does_not_import_names_its_line(tmp_path, monkeypatch, isolated_path):
    name = _user_module(tmp_path, "x = 1\ny = undefined_name\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=rf"cannot import module '{name}' \({tmp_path / name}.py:2 in <module>\): "
                                         r"NameError"):
        load_reward(f"{name}:score")
    bad = _user_module(tmp_path, "def score(:\n")
    with pytest.raises(ValueError, match=rf"\({tmp_path / bad}.py:1 in <module>\): SyntaxError"):
        load_reward(f"{bad}:score")



def test_a_reward_file_imports_its_neighbours_as_a_script_does(tmp_path, monkeypatch, isolated_path):
    """`task.reward=DIR/file.py:fn` runs as `python DIR/file.py` would: a module beside it imports by name
    from any working directory; a relative import (no parent package for a file) is one line saying what to
    give instead. Twin: the neighbour removed, the import fails naming it."""
    helper = _user_module(tmp_path / "rewards", "def half():\n    return 0.5\n")
    main = _user_module(tmp_path / "rewards", f"from {helper} import half\n\n\ndef score(c, a, p):\n"
                                              f"    return half()\n")
    rel = _user_module(tmp_path / "rewards", f"from .{helper} import half\n")
    monkeypatch.chdir(tmp_path)
    assert load_reward(f"rewards/{main}.py:score")("c", Example("p", "a")) == 0.5
    with pytest.raises(ValueError, match=r"relative import.*a file given by path is loaded as a script.*"
                                         r"task.reward=PACKAGE.MODULE:NAME"):
        load_reward(f"rewards/{rel}.py:score")
    monkeypatch.delitem(sys.modules, helper)
    (tmp_path / "rewards" / f"{helper}.py").unlink()
    again = _user_module(tmp_path / "rewards", f"from {helper} import half\n")
    with pytest.raises(ValueError, match=rf"ModuleNotFoundError: No module named '{helper}'"):
        load_reward(f"rewards/{again}.py:score")

# --- one run, from the user's directory ------------------------------------------------------------

USER_REWARD = """import json


def score(completion, answer, prompt, **fields):
    with open("seen.jsonl", "a") as f:
        f.write(json.dumps({"answer": answer, "fields": fields}) + "\\n")
    return float(completion.strip() == str(answer))
"""


@pytest.mark.slow
def test_a_run_from_the_users_directory_with_the_models_tokenizer(model_dir, tmp_path):
    """`rlalign train` (the console script; no PYTHONPATH) in a directory holding the reward module:
    the model's tokenizer with its chat template encodes a non-ASCII dataset, numeric answers and
    extra fields reach the reward, and the two sides agree on every token."""
    (tmp_path / "myrewards.py").write_text(USER_REWARD)
    data = _jsonl(tmp_path, {"prompt": "1+1=", "answer": 2, "level": "easy"},
                  {"prompt": "é:", "answer": "éé", "level": "hard", "id": 7})
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RLALIGN_DEBUG")}
    rlalign = Path(sys.executable).parent / "rlalign"
    p = subprocess.run([str(rlalign), "train", f"model.path={model_dir}", "task=jsonl", f"task.path={data}",
                        "task.reward=myrewards:score", "task.chat=true", "task.num_prompts=2",
                        "task.samples_per_prompt=2", "task.max_new_tokens=4", "trainer.ep_size=1",
                        "trainer.micro_batch_size=4", "run.steps=1", f"run.dir={tmp_path / 'run'}",
                        "checkpoint.enabled=false"],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    assert f"tokenizer: the tokenizer in {model_dir} (48 ids, eos '<eos>' = id 4, its chat template" in p.stderr
    row = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    template = len(make_tokenizer(None, str(model_dir), chat=True).encode(""))
    assert row["prompt/tokens"] == 2 * (2 * template + len("1+1=") + len("é:"))  # the templated prompts
    assert row["consistency/mismatched_tokens"] == 0 and row["consistency/tokens"] > 0
    seen = [json.loads(ln) for ln in (tmp_path / "seen.jsonl").read_text().splitlines()]
    assert {"answer": 2, "fields": {"level": "easy"}} in seen
    assert {"answer": "éé", "fields": {"level": "hard", "id": 7}} in seen
