import pathlib
import sys

import pytest
import torch

from subquad.kernels.memory import (
    BlockOutput,
    Scratch,
    kept_buffer,
    new_buffers,
    new_output,
    new_output_like,
    tracks_grad,
)


def blocks():
    return [torch.full((2, n, 3), float(n)) for n in (1, 4, 2)]


def test_blocks_are_written_in_order_without_autograd():
    out = BlockOutput((2, 7, 3), 1, torch.zeros(1), track=False)
    for b in blocks():
        out.put(b)
    assert torch.equal(out.result(), torch.cat(blocks(), dim=1))


def test_a_single_block_is_returned_without_a_copy():
    block = torch.ones(2, 5, 3)
    out = BlockOutput((2, 5, 3), 1, block, track=False)
    out.put(block)
    assert out.result() is block


def test_tracked_blocks_are_concatenated_and_carry_gradients():
    x = torch.ones(2, 7, 3, requires_grad=True)
    assert tracks_grad(x) and not tracks_grad(torch.ones(1))
    out = BlockOutput((2, 7, 3), 1, x, track=True)
    out.put(x[:, :3] * 2)
    out.put(x[:, 3:] * 3)
    out.result().sum().backward()
    assert torch.equal(x.grad[:, :3], torch.full((2, 3, 3), 2.0)) and torch.equal(
        x.grad[:, 3:], torch.full((2, 4, 3), 3.0)
    )


def test_scratch_reuses_one_buffer_per_name_and_grows_when_asked_for_more():
    scratch = Scratch(torch.float64, torch.device("cpu"))
    a = scratch("x", (2, 3, 4))
    assert a.shape == (2, 3, 4) and a.dtype == torch.float64 and a.is_contiguous()
    smaller = scratch("x", (5, 2))  # fits: the same memory
    assert smaller.is_contiguous() and smaller.data_ptr() == a.data_ptr()
    assert scratch("y", (5, 2)).data_ptr() != a.data_ptr()  # another name, another buffer
    larger = scratch("x", (7, 7))  # does not fit: a new buffer
    assert larger.shape == (7, 7) and scratch("x", (2, 3, 4)).data_ptr() == larger.data_ptr()


def test_new_output_is_an_empty_tensor_of_the_shape_dtype_and_device():
    for shape, dtype in (((2, 3, 5), torch.float32), ((1 << 21,), torch.float64), ((0, 4), torch.bfloat16)):
        out = new_output(shape, dtype, torch.device("cpu"))
        assert out.shape == shape and out.dtype == dtype and out.device.type == "cpu" and out.is_contiguous()
        out.fill_(1.5)
        assert bool((out == 1.5).all())


def _thp_mode() -> str | None:
    path = pathlib.Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not sys.platform.startswith("linux") or not path.exists():
        return None
    return path.read_text().split("[")[1].split("]")[0]


def _mapping_flags(address: int) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping that holds ``address``."""
    fields, inside = {}, False
    for line in pathlib.Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            begin, end = (int(x, 16) for x in head.split("-"))
            inside = begin <= address < end
        elif inside:
            key, _, value = line.partition(":")
            fields[key] = value.strip()
    return fields


@pytest.mark.skipif(_thp_mode() in (None, "never"), reason="needs Linux with transparent huge pages")
def test_a_large_cpu_output_is_eligible_for_huge_pages():
    for out in (
        new_output((8, 1 << 20), torch.float32, torch.device("cpu")),  # 32 MiB
        new_output_like(torch.zeros(1 << 20, 8).t()),
    ):
        inner = -(-out.data_ptr() // (1 << 21)) * (1 << 21)  # its first whole 2 MiB page
        flags = _mapping_flags(inner)
        if "THPeligible" not in flags:
            pytest.skip("this kernel does not report THPeligible")
        assert flags["THPeligible"] == "1"


def test_outputs_below_huge_page_mib_are_not_advised_and_working_buffers_always_are(monkeypatch):
    """``TUNING.huge_page_mib``: a fresh output of at least that many MiB has its whole huge pages
    advised (raised past every output, the advice is off); ``new_buffers`` carves its slab from huge
    pages whatever it says (their cache layout, not the first write, is what they are for)."""
    from subquad.kernels import memory
    from subquad.kernels.tuning import tuned

    advised = []
    monkeypatch.setattr(memory, "_madvise", lambda start, length, advice: advised.append((length, advice)))
    cpu = torch.device("cpu")
    with tuned(huge_page_mib=2):
        new_output((8, 1 << 20), torch.float32, cpu)  # 32 MiB: at least 15 whole huge pages
        new_output_like(torch.zeros(1 << 20, 8).t())
    assert len(advised) == 2 and all(n >= 15 << 21 and a == memory._MADV_HUGEPAGE for n, a in advised)
    advised.clear()
    with tuned(huge_page_mib=33):  # 32 MiB is below it
        new_output((8, 1 << 20), torch.float32, cpu)
        new_output_like(torch.zeros(1 << 20, 8).t())
        assert not advised
        new_buffers([(8, 1 << 20)], torch.float32, cpu, zero=False)
    assert len(advised) == 1 and advised[0][0] >= 16 << 21


def test_new_output_like_keeps_the_strides_and_fakes_pass_through():
    x = torch.zeros(5, 7, 3).transpose(0, 1)
    out = new_output_like(x)
    assert out.shape == x.shape and out.stride() == x.stride()
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():  # no storage to advise: no error
        assert new_output((4, 1 << 20), torch.float32, torch.device("cpu")).shape == (4, 1 << 20)


def test_new_buffers_are_disjoint_aligned_contiguous_and_zeroed_when_asked():
    shapes = [(3, 5), (7,), (0, 4), (2, 2, 3), (1,)]
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        buffers = new_buffers(shapes, dtype, torch.device("cpu"), zero=True)
        assert [b.shape for b in buffers] == [torch.Size(s) for s in shapes]
        for i, b in enumerate(buffers):
            assert b.dtype == dtype and b.is_contiguous() and b.data_ptr() % 64 == buffers[0].data_ptr() % 64
            assert bool((b == 0).all())
            b.fill_(i + 1)
        assert [float(b.float().sum()) / max(1, b.numel()) for b in buffers] == [
            1,
            2,
            0,
            4,
            5,
        ]  # no write reached another


def test_a_kept_buffer_is_the_same_memory_on_the_next_request_of_its_name_and_grows_when_asked_for_more():
    import threading

    from subquad.kernels.tuning import tuned

    cpu = torch.device("cpu")
    first = kept_buffer("test.kept", 100, torch.float32, cpu)
    assert first.shape == (100,) and first.dtype == torch.float32 and first.is_contiguous()
    assert kept_buffer("test.kept", 60, torch.float32, cpu).data_ptr() == first.data_ptr()
    assert kept_buffer("test.other", 60, torch.float32, cpu).data_ptr() != first.data_ptr()
    assert kept_buffer("test.kept", 60, torch.float64, cpu).data_ptr() != first.data_ptr()  # one per dtype
    grown = kept_buffer("test.kept", 1000, torch.float32, cpu)
    assert grown.shape == (1000,) and kept_buffer("test.kept", 100, torch.float32, cpu).data_ptr() == grown.data_ptr()
    other_thread = []
    thread = threading.Thread(target=lambda: other_thread.append(kept_buffer("test.kept", 100, torch.float32, cpu)))
    thread.start()
    thread.join()
    assert other_thread[0].data_ptr() != grown.data_ptr()  # each thread keeps its own
    with tuned(kept_buffer=500):  # above the limit: a fresh tensor every time, nothing kept
        a, b = (kept_buffer("test.large", 501, torch.float32, cpu) for _ in range(2))
        assert a.shape == (501,) and a.data_ptr() != kept_buffer("test.large", 501, torch.float32, cpu).data_ptr()
        del b


def test_a_kept_buffer_asked_for_under_fake_tensors_is_a_fake_and_keeps_nothing():
    """A request under fake tensors (tracing, export) gets a fake and stores nothing, so the next
    real request, of a name never asked for before, is a real buffer that ``out=`` can write."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    cpu = torch.device("cpu")
    with FakeTensorMode():
        fake = kept_buffer("test.fake", 12, torch.float32, cpu)
        assert isinstance(fake, FakeTensor) and fake.shape == (12,)
    real = kept_buffer("test.fake", 12, torch.float32, cpu)
    assert type(real) is torch.Tensor
    torch.index_select(torch.arange(24.0).view(6, 4), 0, torch.tensor([5, 0, 2]), out=real.view(3, 4))
    assert real.view(3, 4)[:, 0].tolist() == [20.0, 0.0, 8.0]


def test_a_kept_buffer_made_in_inference_mode_takes_writes_outside_it():
    cpu = torch.device("cpu")
    with torch.inference_mode():
        kept_buffer("test.inference", 10, torch.float32, cpu).fill_(1)
    buffer = kept_buffer("test.inference", 10, torch.float32, cpu)
    assert not buffer.is_inference()
    torch.index_select(torch.arange(20.0).view(10, 2), 0, torch.arange(5), out=buffer.view(5, 2))
    assert buffer.tolist() == list(map(float, range(10)))
