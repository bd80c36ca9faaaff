"""A task's reward function, by import path, and what it takes.

    reward = load_reward("mypkg.rewards:score")       # a bare name: rlalign.tasks.rewards
    reward(completion, example)                        # -> score(completion, answer, prompt, **fields)

A reward takes (completion, answer, prompt) positionally, then the dataset row's extra fields by
name: all of them with **kwargs, else those it names (a named field without a default is required
of every row: Reward.check_rows names a row that lacks it). The module is imported from the
installed packages, else from the current directory (no PYTHONPATH needed), or from its file
('/path/to/file.py:score'). user_frame names the file and line of the user's code where an exception
was raised.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import sys
import sysconfig
from collections.abc import Callable
from pathlib import Path

RLALIGN_DIR = Path(__file__).resolve().parents[1]
_LIBRARY_DIRS = tuple({str(Path(p).resolve()) for k, p in sysconfig.get_paths().items()
                       if k in ("stdlib", "platstdlib", "purelib", "platlib")})


def user_frame(exc: BaseException) -> str | None:
    """'FILE:LINE in FUNCTION' of the deepest traceback frame in the user's code (not rlalign's, not
    the standard library's or an installed package's), or None."""
    for path, line, func in reversed(list(_frames(exc))):
        if path.startswith("<frozen "):  # importlib's own frames
            continue
        p = Path(path).resolve()
        if not p.is_relative_to(RLALIGN_DIR) and not str(p).startswith(_LIBRARY_DIRS):
            return f"{path}:{line} in {func}"
    return None


def _frames(exc: BaseException):
    if isinstance(exc, SyntaxError) and exc.filename:  # the file that does not parse is the place
        yield exc.filename, exc.lineno, "<module>"
        return
    tb = exc.__traceback__
    while tb is not None:
        yield tb.tb_frame.f_code.co_filename, tb.tb_lineno, tb.tb_frame.f_code.co_name
        tb = tb.tb_next


def _in_cwd(top: str) -> bool:
    """The current directory holds the top-level module `top` (a file or a package directory)."""
    return Path(os.getcwd(), top + ".py").is_file() or Path(os.getcwd(), top).is_dir()


def module_found(name: str) -> bool:
    """import_module(name) would find the top of `name` (installed, on sys.path, or in the current
    directory), without importing it."""
    top = name.split(".")[0]
    return _in_cwd(top) or importlib.util.find_spec(top) is not None


def import_module(name: str):
    """importlib.import_module, falling back to the current directory for a module found there."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        top, cwd = name.split(".")[0], os.getcwd()
        if e.name != top or not _in_cwd(top) or cwd in sys.path:
            raise
    sys.path.append(cwd)  # kept: the module may import its neighbours later
    importlib.invalidate_caches()
    return importlib.import_module(name)


def import_file(path: Path):
    """The Python file at `path` as a module named by its absolute path (once per file; registered
    before it runs, as an import is, so that its dataclasses find it). As for `python FILE`, the file's
    directory goes first on sys.path (its neighbours import by name) and it has no parent package."""
    path = path.resolve()
    name = str(path)
    if name not in sys.modules:
        if not path.is_file():
            raise FileNotFoundError(f"no such file: {path}")
        if str(path.parent) not in sys.path:
            sys.path.insert(0, str(path.parent))
            importlib.invalidate_caches()
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)
        mod.__package__ = ""  # a script's: not the path's text before its last dot
        sys.modules[name] = mod
        try:
            spec.loader.exec_module(mod)
        except BaseException:
            del sys.modules[name]
            raise
    return sys.modules[name]


def import_user_module(key: str, name: str):
    """import_module(name), or import_file(name) for a name ending in '.py' (relative to the current
    directory), for the config value `key` (e.g. "task.reward='pkg.module:function'"): a failing
    import is one ValueError naming the key, the module and the line of the user's code."""
    try:
        return import_file(Path(name)) if name.endswith(".py") else import_module(name)
    except SystemExit as e:  # a module that parses its own command line (argparse) or exits as it loads
        at = user_frame(e)
        raise ValueError(f"{key}: importing module {name!r}{f' ({at})' if at else ''} exited (SystemExit "
                         f"{e.code!r}): a module rlalign imports must not run a script as it loads (guard it with "
                         "`if __name__ == '__main__':`)") from None
    except Exception as e:
        at = user_frame(e)
        hint = ""
        if name.endswith(".py") and isinstance(e, ImportError) and "relative import" in str(e):
            hint = (f" (a file given by path is loaded as a script, without its package: import its neighbours "
                    f"by name, or give the module, {key.split('=')[0]}=PACKAGE.MODULE:NAME, from the package's "
                    f"parent directory)")
        raise ValueError(f"{key}: cannot import module {name!r}{f' ({at})' if at else ''}: "
                         f"{type(e).__name__}: {e}{hint}") from None


def defined_at(fn: Callable) -> str | None:
    """'FILE:LINE' where a Python function is defined (None for a builtin or another callable)."""
    code = getattr(fn, "__code__", None)
    return f"{code.co_filename}:{code.co_firstlineno}" if code else None


class Reward:
    """A reward function and the dataset fields it takes (module docstring)."""

    def __init__(self, fn: Callable, spec: str):
        self.fn, self.spec = fn, spec
        self.defined_at = defined_at(fn) or spec
        self.all_fields, self.fields, self.required, self.positional = False, set(), set(), []
        try:
            params = list(inspect.signature(fn).parameters.values())
        except (TypeError, ValueError):  # a builtin without a signature: called with the three values only
            return
        P = inspect.Parameter
        self.positional = [p.name for p in params if p.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)]
        if len(self.positional) < 3 and not any(p.kind is P.VAR_POSITIONAL for p in params):
            raise ValueError(f"task.reward={spec} ({self.defined_at}): a reward takes (completion, answer, prompt, "
                             f"**fields); this one takes ({', '.join(p.name for p in params)})")
        named = [p for p in params if p.name in self.positional[3:] and p.kind is P.POSITIONAL_OR_KEYWORD]
        named += [p for p in params if p.kind is P.KEYWORD_ONLY]
        self.all_fields = any(p.kind is P.VAR_KEYWORD for p in params)
        self.fields = {p.name for p in named}
        self.required = {p.name for p in named if p.default is P.empty}

    def __call__(self, completion: str, example):
        fields = example.fields if self.all_fields else {k: v for k, v in example.fields.items() if k in self.fields}
        return self.fn(completion, example.answer, example.prompt, **fields)

    def check_rows(self, examples) -> None:
        """Every row has the fields the reward requires, and none is named like its positional
        parameters (which the row's prompt and answer fill)."""
        for ex in examples:
            missing = sorted(self.required - ex.fields.keys())
            if missing:
                raise ValueError(f"{ex.source}: the reward task.reward={self.spec} ({self.defined_at}) needs the "
                                 f"field(s) {missing}, which this row lacks")
            clash = sorted(k for k in ex.fields if k in self.positional[:3] and (self.all_fields or k in self.fields))
            if clash:
                raise ValueError(f"{ex.source}: field(s) {clash} have the names of the reward's positional parameters "
                                 f"(completion, answer, prompt); rename them")


def load_reward(path: str) -> Reward:
    """'pkg.module:function' or '/path/to/file.py:function' -> the function; a bare name means
    rlalign.tasks.rewards."""
    mod_name, _, fn_name = path.rpartition(":") if ":" in path else ("rlalign.tasks.rewards", ":", path)
    mod = import_user_module(f"task.reward={path!r}", mod_name)
    fn = getattr(mod, fn_name, None)
    if not callable(fn):
        raise ValueError(f"task.reward={path!r}: module {mod_name!r} ({getattr(mod, '__file__', '?')}) has no "
                         f"function {fn_name!r}")
    return Reward(fn, path)
