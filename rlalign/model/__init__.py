from rlalign.model.args import ModelArgs
from rlalign.model.hf import check_hf_dir, load_hf, read_args, save_hf
from rlalign.model.model import DTYPES, PagedKVCache, Transformer, build_model

__all__ = ["DTYPES", "ModelArgs", "PagedKVCache", "Transformer", "build_model", "check_hf_dir", "load_hf",
           "read_args", "save_hf"]
