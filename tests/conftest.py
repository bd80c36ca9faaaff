import dataclasses
import json
import os
import shutil
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():  # Triton kernels run in its interpreter on CPU (set before import)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from rlalign import kernels  # noqa: E402
from rlalign.model import ModelArgs, build_model  # noqa: E402


def _refuse_host_blas_dot(self, *args, **kwargs):
    raise AssertionError(
        "tl.dot ran under TRITON_INTERPRET: the interpreter computes it with the host's BLAS, whose bits "
        "change with the CPU's kernel (OPENBLAS_CORETYPE), so a bit test through it passes or fails by "
        "machine. Kernels take the UPCAST branch there (kernels/triton/common.py host_free_dot).")


class _PatchLangOncePerLaunch:
    """triton.runtime.interpreter._patch_lang, applied once per kernel launch. The interpreter calls it
    at the launch (and restores the language at its end) and again at every call of a jit function
    from inside the kernel, per program: each time it scans every member of triton.language with
    inspect.getmembers and sets the same interpreted builtins again (a quarter of an interpreter
    test's time: model forward and backward, 7,400 device-function calls). A device function's call
    here patches only the language modules (tl, tl.core) its globals see that the launch has not
    patched yet; the functions the kernel runs are the same objects, so no value changes."""

    def __init__(self, interpreter):
        self.real = interpreter._patch_lang
        self.tl = interpreter.tl
        self.patched: set[int] | None = None  # ids of the language modules patched by the running launch

    def langs(self, fn) -> set[int]:
        return {id(v) for v in fn.__globals__.values() if v is self.tl or v is self.tl.core}

    def __call__(self, fn):
        langs = self.langs(fn)
        if self.patched is not None and langs <= self.patched:  # a device function inside a launch
            return _NO_PATCH
        scope = self.real(fn)
        if self.patched is not None:  # a device function that sees a module the launch does not
            self.patched |= langs
            return scope
        self.patched = langs
        restore = scope.restore

        def restore_and_end_launch():
            self.patched = None
            restore()

        scope.restore = restore_and_end_launch
        return scope


class _NoPatch:
    def restore(self) -> None:
        pass


_NO_PATCH = _NoPatch()


if os.environ.get("TRITON_INTERPRET") == "1":  # every in-process interpreter test proves it stays off BLAS
    from triton.runtime import interpreter as _interpreter
    from triton.runtime.interpreter import InterpreterBuilder

    InterpreterBuilder.create_dot = _refuse_host_blas_dot
    _interpreter._patch_lang = _PatchLangOncePerLaunch(_interpreter)
    # The interpreter checks every integer add, sub and mul below 64 bits for overflow (device asserts:
    # half of an interpreter test's time); a compiled kernel does so only with debug=True, and the tiny
    # shapes here keep every index far inside int32. The values computed are the same either way.
    _interpreter.interpreter_builder.options = dataclasses.replace(_interpreter.interpreter_builder.options,
                                                                   sanitize_overflow=False)


os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")

TINY = dict(
    vocab_size=64, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
    intermediate_size=128, moe_intermediate_size=64, num_experts=8, top_k=2, norm_topk_prob=True,
    max_position_embeddings=256, eos_token_id=1,
)


@pytest.fixture(autouse=True)
def _deterministic_mode():
    with kernels.use(mode="deterministic", backend="torch"):
        yield


@pytest.fixture(scope="session", autouse=True)
def _one_ray_cluster_per_worker():
    """The in-process runs (train, gates) of a pytest process (an xdist worker: every module it
    takes) share one private Ray cluster: the first run's connect() starts it, the later ones find
    Ray up and attach, and the shutdown is deferred to the session's end. Starting and stopping a
    cluster costs ~7 s here, once per module or run otherwise. Environment variables set after it
    started do not reach its actors (train_cli_with_fault below). test_cluster's drivers are
    processes of their own, with their own clusters."""
    from rlalign import cluster

    real, started = cluster.disconnect, []
    cluster.disconnect = lambda initialized: started.append(True) if initialized else None
    try:
        yield
    finally:
        cluster.disconnect = real
        if started:
            real(True)


@pytest.fixture(scope="module")
def shared_runs():
    """The module's runs of `rlalign train` by config (run.dir and the gate's own keys aside): a run
    whose config ran before in this module, in another gate or test, is a copy of that run's directory,
    not trained again. Never within one gate (its two runs share a parent directory: the repeatability
    gate is what shows that a second run of a config equals the first), nor for a run that resumes
    (checkpoint.resume != never: its result depends on its directory too)."""
    from rlalign import gates, rl

    runs: dict[str, tuple[Path, dict]] = {}

    def train_or_copy(cfg, status=None):
        run_dir = Path(cfg.run.dir)
        key = OmegaConf.to_container(cfg, resolve=True)
        key["run"].pop("dir")
        key.pop("gate")
        key["RLALIGN_FAULT"] = os.environ.get("RLALIGN_FAULT")  # the run's injected faults (rlalign.faults)
        key = json.dumps(key, sort_keys=True)
        fresh = cfg.checkpoint.resume == "never"
        src = runs.get(key) if fresh else None
        if src is not None and src[0].parent != run_dir.parent and not run_dir.exists():
            shutil.copytree(src[0], run_dir)
            return {**src[1], "run_dir": str(run_dir)}
        summary = rl.train(cfg, status)
        if fresh:
            runs.setdefault(key, (run_dir, summary))
        return summary

    gates.train = train_or_copy
    try:
        yield train_or_copy
    finally:
        gates.train = rl.train


def inject_fault(spec: str, monkeypatch) -> None:
    """RLALIGN_FAULT=spec (rlalign.faults) for the rest of the test. The module's Ray cluster comes up
    first, so its raylet, and the actors of the module's later runs, never inherit the fault; the
    runs of this test pass it to their actors through their runtime env (actors/group.py)."""
    from rlalign import cluster
    from rlalign.config import load_config

    cluster.disconnect(cluster.connect(load_config([]).placement.num_cpus))
    monkeypatch.setenv("RLALIGN_FAULT", spec)


def train_cli_with_fault(spec: str, args: list[str], capsys, monkeypatch) -> tuple[int, str]:
    """`rlalign train ARGS` in this process with RLALIGN_FAULT=spec (inject_fault): (exit status, stderr)."""
    from rlalign import cli

    inject_fault(spec, monkeypatch)
    capsys.readouterr()
    rc = cli.main(["train", *args])
    return rc, capsys.readouterr().err


def flip_checkpoint_bit(ckpt_dir: Path, key: str) -> None:
    """One bit of one checkpoint tensor changed (the lowest exponent bit of its first bf16 element:
    half or twice the value), and meta.json's fingerprint with it (a checkpoint whose bits changed
    before it was fingerprinted: loadable)."""
    from safetensors import safe_open

    from rlalign.fingerprint import fingerprint

    meta = json.loads((ckpt_dir / "meta.json").read_text())
    shard = ckpt_dir / meta["tensors"][key]["file"]
    b = bytearray(shard.read_bytes())
    n = int.from_bytes(b[:8], "little")
    b[8 + n + json.loads(b[8:8 + n])[key]["data_offsets"][0] + 1] ^= 1  # element 0's lowest exponent bit (bf16)
    shard.write_bytes(bytes(b))
    with safe_open(str(shard), framework="pt") as st:
        meta["tensors"][key]["fp"] = fingerprint(st.get_tensor(key))
    (ckpt_dir / "meta.json").write_text(json.dumps(meta) + "\n")


def tiny_model(dtype="bfloat16", seed=0, **over):
    return build_model(ModelArgs(**{**TINY, **over}), dtype, seed=seed)


def bits(t: torch.Tensor) -> torch.Tensor:
    """Raw bits, so -0.0 != +0.0 and NaN payloads count."""
    t = t.detach().contiguous()
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a), bits(b))


def triton_filtered(z: torch.Tensor, top_k: int = 0, top_p: float = 1.0, scale: float = 1.0) -> torch.Tensor:
    """The filtered fp32 copy that the Triton cut (kernels/triton/topp.py filter_cut) stands for:
    sampling.apply_cut(temper(z, scale), cut), what the draw and the logprob read in registers."""
    from rlalign.kernels import sampling
    from rlalign.kernels.triton.topp import filter_cut

    return sampling.apply_cut(sampling.temper(z, scale), filter_cut(z, top_k, top_p, scale))


# `make test` runs the modules on two pytest-xdist workers (`-n 2 --dist loadfile`: a module stays on one
# worker, so its module fixtures — a Ray cluster, a vLLM engine — are built once). Workers take modules in
# collection order; the modules measured longest (`--durations`, 2-core machine) come first so that both
# workers finish close together. Modules not named keep their order after these.
LONGEST_FIRST = ("test_vllm", "test_multinode", "test_cluster", "test_train", "test_scheduler", "test_monitor",
                 "test_triton_topp", "test_topology", "test_triton_paged", "test_sampling_stats", "test_triton",
                 "test_agree", "test_shard", "test_ep", "test_multiturn", "test_tasks_user", "test_cli",
                 "test_multirun", "test_triton_sampling_cut", "test_config", "test_train_kernels", "test_packaging",
                 "test_triton_fused", "test_triton_sampling", "test_engine", "test_help_keys", "test_checkpoint",
                 "test_weight_sync", "test_losses", "test_report", "test_sampling_prune", "test_continuation",
                 "test_layers", "test_moe_counts", "test_export", "test_config_search", "test_checkpoint_limits",
                 "test_run_start", "test_multiturn_train", "test_fingerprint", "test_ep_capacity")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))  # stable: a module's own order is kept


def pytest_configure(config):
    if hasattr(config, "workerinput"):  # an xdist worker: one core each, no oversubscription
        torch.set_num_threads(1)


_VERDICT = {"exitstatus": None}


def pytest_sessionfinish(session, exitstatus):
    _VERDICT["exitstatus"] = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """End the process with pytest's verdict, without interpreter teardown. Seen once on this
    2-core machine: every test passed ("235 passed"), then the interpreter died with SIGSEGV while
    tearing down C extensions (Ray, gloo, wandb and Triton's interpreter all live in this process at
    some point), and make reported a failure that was not one. The summary is already printed."""
    if _VERDICT["exitstatus"] is None or hasattr(config, "workerinput"):  # a worker reports to the controller first
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(_VERDICT["exitstatus"])
