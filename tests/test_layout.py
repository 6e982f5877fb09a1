"""``utils.layout``: which tensors the compiled CPU kernels take as they are, and in which order."""
import torch

from lp_decentral_nlp.utils.layout import dense_like, is_channels_last, is_dense, memory_order


def test_channels_last_is_a_dense_layout_walked_in_memory_order():
    x = torch.arange(2 * 3 * 4 * 5.0).reshape(2, 3, 4, 5)
    last = x.contiguous(memory_format=torch.channels_last)
    assert is_channels_last(last) and is_dense(last) and not is_channels_last(x) and is_dense(x)
    walked = memory_order(last)
    assert walked.is_contiguous() and walked.data_ptr() == last.data_ptr()
    assert torch.equal(walked.reshape(2, -1), x.permute(0, 2, 3, 1).reshape(2, -1)), "samples stay whole and first"
    assert memory_order(x) is x and dense_like(last) is last and dense_like(x) is x


def test_ambiguous_and_strided_tensors():
    """One channel, or 1 x 1 images, are row-major and channels last at once: they count as
    row-major. A strided tensor is neither and gets a row-major copy."""
    for shape in ((2, 1, 4, 5), (2, 3, 1, 1)):
        t = torch.randn(shape).contiguous(memory_format=torch.channels_last)
        assert not is_channels_last(t) and is_dense(t) and memory_order(t) is t
    strided = torch.randn(2, 3, 4, 5).transpose(2, 3)
    assert not is_dense(strided)
    copy = dense_like(strided)
    assert copy.is_contiguous() and torch.equal(copy, strided)
    assert not is_channels_last(torch.randn(3, 4, 5))
