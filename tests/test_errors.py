"""``dsv4.errors.check_tensor``: each check names the argument, what was expected and what came."""

import pytest
import torch

from dsv4.errors import check_tensor


def test_check_tensor_contiguous():
    t = torch.zeros(4, 6, dtype=torch.int32)
    assert check_tensor("t", t, dtype=torch.int32, shape=[4, None], contiguous=True) is t
    check_tensor("t", t[:, ::2])  # not asked: passes
    with pytest.raises(ValueError, match="^t: expected a contiguous tensor$"):
        check_tensor("t", t[:, ::2], dtype=torch.int32, contiguous=True)
    with pytest.raises(ValueError, match="t: expected dtype torch.float32, got torch.int32"):
        check_tensor("t", t[:, ::2], dtype=torch.float32, contiguous=True)  # (the dtype is checked first)
