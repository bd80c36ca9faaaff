"""Model arguments of the Qwen3-MoE-style decoder, and how they map to a HF config.json."""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from rlalign.values import type_problems

# Every Qwen3-MoE config.json field, by what this model does with it. A field outside these sets,
# or a value this model does not implement, is refused with its name: a `hidden_act: gelu`
# checkpoint once loaded and ran as SiLU, and since both sides agreed the monitor could not see it.
HF_READ = frozenset({
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
    "intermediate_size", "moe_intermediate_size", "num_experts", "num_local_experts", "num_experts_per_tok",
    "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers", "rms_norm_eps", "rope_theta", "rope_parameters",
    "max_position_embeddings", "tie_word_embeddings", "attention_bias", "eos_token_id",
})
# field -> (the values implemented, what the others would need)
HF_FIXED = {
    "hidden_act": (("silu",), "only SiLU (SwiGLU) MLPs are implemented"),
    "rope_scaling": ((None,), "only default RoPE is implemented"),
    "use_sliding_window": ((False, None), "sliding-window attention is not implemented"),
    "attention_dropout": ((0, 0.0, None), "attention dropout is not implemented"),
    "output_router_logits": ((False, None), "the router auxiliary loss is not implemented"),
    "is_encoder_decoder": ((False, None), "this is a decoder-only model"),
    "quantization_config": ((None,), "quantized checkpoints are not implemented"),
    "pruned_heads": ((None, {}), "pruned attention heads are not implemented"),
}
# metadata, or knobs that only act through a field above being set (sliding_window and
# max_window_layers need use_sliding_window; router_aux_loss_coef needs output_router_logits)
HF_NO_EFFECT = frozenset({
    "architectures", "model_type", "transformers_version", "dtype", "torch_dtype", "_name_or_path", "name_or_path",
    "id2label", "label2id", "problem_type", "output_hidden_states", "output_attentions", "return_dict", "use_cache",
    "chunk_size_feed_forward", "initializer_range", "bos_token_id", "pad_token_id", "sliding_window",
    "max_window_layers", "router_aux_loss_coef", "tokenizer_class", "use_bfloat16", "torchscript",
})
_ROPE_KEYS = {"rope_type", "rope_theta"}


def check_hf_fields(cfg: dict, where: str) -> None:
    """Refuse every config.json field (and value) that this model would otherwise ignore."""
    problems = []
    for key in sorted(cfg):
        value = cfg[key]
        if key in HF_FIXED:
            allowed, why = HF_FIXED[key]
            if not any(value == a and type(value) is type(a) or value is a for a in allowed):
                problems.append(f"{key}={value!r} ({why})")
        elif key == "layer_types":
            if any(t != "full_attention" for t in value or []):
                problems.append(f"layer_types={value!r} (only full attention is implemented)")
        elif key not in HF_READ and key not in HF_NO_EFFECT:
            problems.append(f"{key}={value!r} (a field this model does not implement)")
    rope = cfg.get("rope_parameters") or {}
    if not isinstance(rope, dict) or rope.get("rope_type", "default") != "default" or set(rope) - _ROPE_KEYS:
        problems.append(f"rope_parameters={rope!r} (only default RoPE with rope_theta is implemented)")
    if problems:
        raise ValueError(f"{where}: unsupported config field(s): " + "; ".join(problems))


@dataclass
class ModelArgs:
    vocab_size: int = 64
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    intermediate_size: int = 128  # dense MLP layers
    moe_intermediate_size: int = 64
    num_experts: int = 8
    top_k: int = 2
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 256
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    eos_token_id: int | None = None

    def is_moe_layer(self, i: int) -> bool:
        return (
            i not in self.mlp_only_layers and self.num_experts > 0 and (i + 1) % self.decoder_sparse_step == 0
        )

    def validate(self, where: str = "model") -> None:
        problems = type_problems(self)
        if problems:
            raise ValueError(f"{where}: invalid model arguments: " + "; ".join(problems))
        for name in ("num_kv_heads", "head_dim", "rms_norm_eps", "rope_theta", "decoder_sparse_step"):  # divisors,
            if not getattr(self, name) > 0:
                problems.append(f"{name}={getattr(self, name)} must be positive")
        if problems:
            raise ValueError(f"{where}: invalid model arguments: " + "; ".join(problems))
        if self.num_heads % self.num_kv_heads:
            problems.append(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if self.head_dim % 2:
            problems.append(f"head_dim={self.head_dim} must be even (RoPE)")
        if self.num_experts and not 0 < self.top_k <= self.num_experts:
            problems.append(f"top_k={self.top_k} must be in [1, num_experts={self.num_experts}]")
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                problems.append(f"{name}={getattr(self, name)} must be positive")
        if self.num_experts < 0:
            problems.append(f"num_experts={self.num_experts} must be >= 0 (0: every layer dense)")
        moe = [self.is_moe_layer(i) for i in range(max(self.num_layers, 0))]
        if any(moe) and self.moe_intermediate_size <= 0:
            problems.append(f"moe_intermediate_size={self.moe_intermediate_size} must be positive (MoE layers)")
        if not all(moe) and self.intermediate_size <= 0:
            problems.append(f"intermediate_size={self.intermediate_size} must be positive (dense layers)")
        if problems:
            raise ValueError(f"{where}: invalid model arguments: " + "; ".join(problems))

    def context_overflow(self, prompt_len: int, max_new: int) -> str | None:
        """Why a prompt of `prompt_len` tokens plus `max_new` completion tokens does not fit the
        context (None: it fits). The one prompt limit: the run's check before Ray starts and every
        engine's input check ask it."""
        if prompt_len + max_new <= self.max_position_embeddings:
            return None
        return (f"has {prompt_len} tokens; with max_new_tokens={max_new} it exceeds the model's context of "
                f"{self.max_position_embeddings} positions")

    @classmethod
    def from_dict(cls, d: dict, where: str = "model") -> ModelArgs:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"{where}: unknown model argument(s) {unknown}; valid: {sorted(names)}")
        args = cls(**d)
        args.mlp_only_layers = list(args.mlp_only_layers)
        args.validate(where)
        return args

    # --- Hugging Face Qwen3MoeConfig ----------------------------------------------------------
    @classmethod
    def from_hf_config(cls, cfg: dict, where: str) -> ModelArgs:
        if not isinstance(cfg, dict):
            raise ValueError(f"{where}: config.json holds a JSON {type(cfg).__name__}, not an object")
        arch = cfg.get("architectures") or []
        if cfg.get("model_type") != "qwen3_moe" and "Qwen3MoeForCausalLM" not in arch:
            raise ValueError(
                f"{where}: unsupported architecture {arch or cfg.get('model_type')!r}; "
                "expected Qwen3MoeForCausalLM (model_type 'qwen3_moe')"
            )
        check_hf_fields(cfg, where)
        if cfg.get("eos_token_id") == []:
            raise ValueError(f"{where}: config.json's eos_token_id is an empty list (an id, a list of ids, or null)")
        try:
            rope = cfg.get("rope_parameters") or {}
            eos = cfg.get("eos_token_id")
            args = cls(
                vocab_size=cfg["vocab_size"],
                hidden_size=cfg["hidden_size"],
                num_layers=cfg["num_hidden_layers"],
                num_heads=cfg["num_attention_heads"],
                num_kv_heads=cfg.get("num_key_value_heads", cfg["num_attention_heads"]),
                head_dim=cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"],
                intermediate_size=cfg["intermediate_size"],
                moe_intermediate_size=cfg["moe_intermediate_size"],
                num_experts=cfg.get("num_experts", cfg.get("num_local_experts", 0)),
                top_k=cfg["num_experts_per_tok"],
                norm_topk_prob=cfg.get("norm_topk_prob", False),
                decoder_sparse_step=cfg.get("decoder_sparse_step", 1),
                mlp_only_layers=list(cfg.get("mlp_only_layers") or []),
                rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
                rope_theta=rope.get("rope_theta", cfg.get("rope_theta", 10000.0)),
                max_position_embeddings=cfg["max_position_embeddings"],
                tie_word_embeddings=cfg.get("tie_word_embeddings", False),
                attention_bias=cfg.get("attention_bias", False),
                eos_token_id=eos[0] if isinstance(eos, list) else eos,
            )
        except KeyError as e:
            raise ValueError(f"{where}: config.json lacks required key {e.args[0]!r}") from None
        except (TypeError, AttributeError, ZeroDivisionError) as e:
            raise ValueError(f"{where}: config.json holds a value of the wrong type or size ({e})") from None
        args.validate(where)
        return args

    def to_hf_config(self, dtype: str) -> dict:
        return {
            "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": "qwen3_moe",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "moe_intermediate_size": self.moe_intermediate_size,
            "num_experts": self.num_experts,
            "num_experts_per_tok": self.top_k,
            "norm_topk_prob": self.norm_topk_prob,
            "decoder_sparse_step": self.decoder_sparse_step,
            "mlp_only_layers": list(self.mlp_only_layers),
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "hidden_act": "silu",
            "eos_token_id": self.eos_token_id,
            "use_sliding_window": False,
            "dtype": dtype,
        }


def read_args(path: str | os.PathLike) -> tuple[ModelArgs, dict]:
    cfg_path = Path(path) / "config.json"
    if not Path(path).is_dir():
        raise FileNotFoundError(f"model directory {str(path)!r} does not exist")
    if not cfg_path.is_file():
        ours = (Path(path) / "meta.json").is_file() or (Path(path) / "checkpoints").is_dir()
        hint = (f"; {path} is an rlalign checkpoint or run directory: `rlalign export {path} OUT_DIR` makes a model "
                f"directory of it, checkpoint.resume=CHECKPOINT continues its run" if ours else "")
        raise FileNotFoundError(f"{cfg_path}: missing (a Hugging Face model directory needs config.json){hint}")
    try:
        cfg = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{cfg_path}: malformed JSON at line {e.lineno}: {e.msg}") from None
    return ModelArgs.from_hf_config(cfg, where=str(cfg_path)), cfg
