"""GPU: the fingerprint kernel's sums equal numpy's of the same bytes (the definition's bits on any
device: whole tensors, views, padded tails, rows, a share), and one bit flipped on the device is seen."""

import numpy as np
import pytest
import torch

from rlalign import kernels
from rlalign.fingerprint import fingerprint
from rlalign.kernels import fingerprint as fpk
from rlalign.kernels.fingerprint import Part

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _parts(device):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(700, 1000, generator=g)
    ts = [x, x.bfloat16(), x[:5, :3].bfloat16(), x.t()[:50], x.bfloat16().view(-1)[1:5001],
          torch.randint(0, 1 << 20, (777,), generator=g), torch.tensor(2.0), torch.zeros(0, 3)]
    parts = [Part(t.to(device)) for t in ts]
    return parts + [Part(x.bfloat16().view(70, 10, 1000).to(device), rows=True),
                    Part(x[:9, :5].bfloat16().to(device), rows=True),  # 10-byte rows: padded copies
                    Part(x[200:400].to(device), first_row=200)]


def test_device_sums_equal_numpys_and_see_one_bit():
    parts = _parts("cuda")
    got = kernels.fingerprint_sums(parts).cpu().numpy().view(np.uint32)
    want = fpk.sums_cpu(_parts("cpu"))
    assert np.array_equal(got, want)
    flipped = parts[0].tensor.clone()
    flipped.view(torch.int32)[300, 300] ^= 1
    assert not np.array_equal(kernels.fingerprint_sums([Part(flipped)]).cpu().numpy().view(np.uint32), want[:1])
    x = torch.arange(12, dtype=torch.float32, device="cuda").reshape(3, 4)
    assert fingerprint(x) == "7afa5e57437ee2c4"  # tests/test_fingerprint.py's pinned value
