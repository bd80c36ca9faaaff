import json
import os

import pytest
import torch
from conftest import same_bits
from safetensors.torch import load_file, save_file

from rlalign import kernels
from rlalign.model import check_hf_dir, load_hf, save_hf
from rlalign.model import hf as hf_mod

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=96, hidden_size=48, intermediate_size=64, moe_intermediate_size=24, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=12, num_experts=4, num_experts_per_tok=2,
        max_position_embeddings=128, mlp_only_layers=[1], norm_topk_prob=True, eos_token_id=2,
    )
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(cfg).eval()
    with torch.no_grad():  # HF initialises norms to 1 and the router to 0: randomise all for a real test
        for p in model.parameters():
            p.normal_(0, 0.2)
    d = tmp_path_factory.mktemp("hf") / "tiny-qwen3-moe"
    model.save_pretrained(d)
    return d, model


@pytest.mark.parametrize("mode", ["deterministic", "default"])
def test_our_fp32_logits_match_transformers(hf_dir, mode):
    d, hf = hf_dir
    ours = load_hf(d)
    toks = torch.randint(0, 96, (3, 21), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), kernels.use(mode=mode):
        ref = hf(toks).logits
        out = ours(toks.reshape(-1), [0, 21, 42, 63]).view(3, 21, -1)
    rel = ((out - ref).abs().max() / ref.abs().max()).item()
    assert rel <= 1e-5, rel


def test_round_trip_through_our_saver_is_bit_identical(hf_dir, tmp_path):
    d, _ = hf_dir
    a = load_hf(d)
    save_hf(a, tmp_path / "copy")
    b = load_hf(tmp_path / "copy")
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() and all(same_bits(sa[k], sb[k]) for k in sa)
    # and transformers reads what we wrote
    hf2 = transformers.Qwen3MoeForCausalLM.from_pretrained(tmp_path / "copy").eval()
    toks = torch.arange(10)[None] + 3
    with torch.no_grad():
        assert torch.allclose(hf2(toks).logits[0], a(toks[0], [0, 10]), rtol=0, atol=1e-5)


def test_bf16_load(hf_dir):
    d, _ = hf_dir
    m = load_hf(d, dtype="bfloat16")
    assert m.dtype == torch.bfloat16


def _corrupt(src, dst, edit):
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    t = load_file(src / "model.safetensors")
    edit(t, dst)
    save_file(t, dst / "model.safetensors")


@pytest.mark.parametrize("loader", [load_hf, check_hf_dir], ids=["load", "headers_only"])
def test_bad_model_directories_name_file_and_tensor(hf_dir, tmp_path, loader):
    d, _ = hf_dir
    with pytest.raises(FileNotFoundError, match="does not exist"):
        loader(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"config.json: missing \(a Hugging Face model directory needs "
                                                r"config.json\)$"):  # twin of the checkpoint's hint below
        loader(tmp_path / "empty")
    for ours in ("step_000003/meta.json", "run/checkpoints/"):
        (tmp_path / ours).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / ours).mkdir() if ours.endswith("/") else (tmp_path / ours).write_text("{}")
        where = tmp_path / ours.split("/")[0]
        with pytest.raises(FileNotFoundError, match=rf"; {where} is an rlalign checkpoint or run directory: `rlalign "
                                                    rf"export {where} OUT_DIR` makes a model directory of it"):
            loader(where)

    arch = tmp_path / "arch"
    _corrupt(d, arch, lambda t, p: None)
    cfg = json.loads((arch / "config.json").read_text())
    cfg.update(architectures=["LlamaForCausalLM"], model_type="llama")
    (arch / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported architecture.*LlamaForCausalLM"):
        loader(arch)

    bad_json = tmp_path / "badjson"
    _corrupt(d, bad_json, lambda t, p: None)
    (bad_json / "config.json").write_text("{\n  \"vocab_size\": 96,\n oops }")
    with pytest.raises(ValueError, match="config.json: malformed JSON at line 3"):
        loader(bad_json)

    missing = tmp_path / "missing"
    _corrupt(d, missing, lambda t, p: t.pop("model.layers.0.self_attn.k_proj.weight"))
    with pytest.raises(ValueError, match="missing tensor 'model.layers.0.self_attn.k_proj.weight'"):
        loader(missing)

    missing_expert = tmp_path / "missing_expert"
    _corrupt(d, missing_expert, lambda t, p: t.pop("model.layers.2.mlp.experts.3.up_proj.weight"))
    with pytest.raises(ValueError, match=r"missing tensor model.layers.2.mlp.experts.3.up_proj.weight"):
        loader(missing_expert)

    shape = tmp_path / "shape"
    _corrupt(d, shape, lambda t, p: t.update({"model.norm.weight": torch.ones(7)}))
    with pytest.raises(ValueError, match=r"tensor .model.norm.weight. has shape \(7,\), expected \(48,\)"):
        loader(shape)

    eshape = tmp_path / "eshape"
    _corrupt(d, eshape, lambda t, p: t.update({"model.layers.0.mlp.experts.1.down_proj.weight": torch.ones(48, 5)}))
    with pytest.raises(ValueError, match=r"experts.1.down_proj.weight has shape \(48, 5\), expected \(48, 24\)"):
        loader(eshape)

    dtype = tmp_path / "dtype"
    _corrupt(d, dtype, lambda t, p: t.update({"model.norm.weight": torch.ones(48, dtype=torch.int32)}))
    with pytest.raises(ValueError, match="'model.norm.weight' has dtype torch.int32, expected a floating dtype"):
        loader(dtype)

    extra = tmp_path / "extra"
    _corrupt(d, extra, lambda t, p: t.update({"model.bogus.weight": torch.ones(3)}))
    with pytest.raises(ValueError, match="unexpected tensor 'model.bogus.weight'"):
        loader(extra)


def test_failed_save_leaves_nothing_half_written(hf_dir, tmp_path, monkeypatch):
    d, _ = hf_dir
    m = load_hf(d)
    target = tmp_path / "out"
    save_hf(m, target)
    before = {p.name: p.read_bytes() for p in target.iterdir()}

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(hf_mod, "save_file", boom)
    with pytest.raises(OSError, match="disk full"):
        save_hf(m, target)
    assert {p.name: p.read_bytes() for p in target.iterdir()} == before
    assert sorted(os.listdir(tmp_path)) == ["out"]  # no temp dirs left behind


def _rewrite_config(src, dst, **changes):
    import shutil

    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_a_gelu_checkpoint_is_refused_naming_the_field(hf_dir, tmp_path):
    d, _ = hf_dir
    bad = _rewrite_config(d, tmp_path / "gelu", hidden_act="gelu")
    with pytest.raises(ValueError, match=r"config.json: unsupported config field\(s\): hidden_act='gelu'"):
        load_hf(bad)
    load_hf(_rewrite_config(d, tmp_path / "silu", hidden_act="silu"))  # twin: the implemented value loads


def test_a_config_json_of_wrong_types_is_refused_naming_the_field(hf_dir, tmp_path):
    """A string where an int stands, a bool where a number stands, an empty eos list, and a config.json that is
    a JSON list are each refused by name, before any weight loads. The twin: the same values of the right
    types load."""
    d, _ = hf_dir
    cfg = json.loads((d / "config.json").read_text())
    for change, message in ((dict(vocab_size=str(cfg["vocab_size"])), r"vocab_size='\d+' \(str\) must be an integer"),
                            (dict(rms_norm_eps=True), r"rms_norm_eps=True \(bool\) must be a number"),
                            (dict(decoder_sparse_step=0), r"decoder_sparse_step=0 must be positive"),
                            (dict(eos_token_id=[]), r"eos_token_id is an empty list")):
        with pytest.raises(ValueError, match=r"config.json.*" + message):
            load_hf(_rewrite_config(d, tmp_path / next(iter(change)), **change))
    listed = _rewrite_config(d, tmp_path / "listed")
    (listed / "config.json").write_text(json.dumps([cfg]))
    with pytest.raises(ValueError, match=r"config.json holds a JSON list, not an object"):
        load_hf(listed)
    load_hf(_rewrite_config(d, tmp_path / "typed", vocab_size=cfg["vocab_size"], rms_norm_eps=1e-6,
                            eos_token_id=[cfg.get("eos_token_id") or 1]))


def test_every_qwen3_moe_config_field_is_read_fixed_or_without_effect():
    """Walk transformers' Qwen3MoeConfig: each field is read into ModelArgs (changing it changes
    them), pinned to the values implemented (any other is refused by name), or has no effect."""
    from rlalign.model.args import HF_FIXED, HF_NO_EFFECT, HF_READ, ModelArgs

    base = transformers.Qwen3MoeConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                       head_dim=16, hidden_size=64).to_dict()
    ours = ModelArgs().to_hf_config("bfloat16")
    ref = ModelArgs.from_hf_config(base, "base")
    for key in sorted(set(base) | set(ours)):
        assert key in HF_READ | set(HF_FIXED) | HF_NO_EFFECT, f"config field {key!r} is not classified"
        if key in HF_FIXED:
            with pytest.raises(ValueError, match=rf"{key}="):
                ModelArgs.from_hf_config({**base, key: "something-else"}, "walk")
        elif key in HF_READ and key in base and isinstance(base[key], int) and not isinstance(base[key], bool):
            changed = {**base, key: base[key] * 2 if base[key] else 2}
            try:
                assert ModelArgs.from_hf_config(changed, "walk") != ref, f"{key} changed nothing"
            except ValueError as e:  # a value the model validates and refuses is also not ignored
                assert "invalid model arguments" in str(e)
    # negative twins: a field nobody classified, non-default RoPE, a non-full-attention layer type
    for extra in ({"qk_layernorm_type": "x"}, {"rope_parameters": {"rope_type": "yarn", "factor": 4.0}},
                  {"layer_types": ["sliding_attention", "full_attention"]}):
        with pytest.raises(ValueError, match=next(iter(extra))):
            ModelArgs.from_hf_config({**base, **extra}, "walk")
