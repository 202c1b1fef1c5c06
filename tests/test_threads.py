import dataclasses
import functools
import threading

import pytest
import torch

import subquad
import subquad.kernels.blocksparse_backward as blocksparse_backward
from subquad.call import call
from subquad.kernels import threads
from subquad.kernels.threads import PERIOD, Sample, adapted, free_cores, threads_for
from subquad.kernels.tuning import Tuning, tuned
from subquad.registry import get_mechanism, mechanism_names

STEP = PERIOD * 1.01  # a period has passed (PERIOD itself could fall short by rounding)


@pytest.fixture
def two_threads():
    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(saved)


class FakeMachine:
    """A clock and /proc counters that tests move by hand: ``others`` cores' worth of busy time
    from other processes, on ``cores`` cores."""

    def __init__(self, cores: int = 2) -> None:
        self.now, self.busy, self.cores, self.reads = 100.0, 0.0, cores, 0

    def clock(self) -> float:
        return self.now

    def read(self) -> Sample:
        self.reads += 1
        return Sample(self.now, self.busy, 0.0, self.cores)

    def run(self, seconds: float, others: float) -> None:
        self.now += seconds
        self.busy += seconds * others


@pytest.fixture(autouse=True)
def _switched_on():
    """The adaptation is opt-in; these tests are about what it does when on."""
    with tuned(adaptive_threads=1):
        yield


@pytest.fixture
def machine(monkeypatch):
    fake = FakeMachine()
    monkeypatch.setattr(threads, "_LOAD", threads._Load(fake.read, fake.clock))
    monkeypatch.setattr(threads, "_alone", lambda: True)  # threads other tests left running do not count here
    return fake


@pytest.mark.parametrize(
    "requested, cores, free, expected",
    [
        (2, 2, 2.0, 2),  # quiet
        (2, 2, 1.6, 2),  # others took less than half a core
        (2, 2, 1.0, 1),  # a busy process on one of two cores
        (2, 2, 0.0, 1),  # never fewer than one
        (16, 16, 11.7, 12),
        (8, 16, 11.7, 8),  # never more than requested
        (4, 2, 2.0, 4),  # more threads than cores, asked for on a quiet machine: as asked
        (4, 2, 1.0, 1),
    ],
)
def test_threads_for_leaves_a_quiet_machine_alone_and_fits_a_busy_one(requested, cores, free, expected):
    assert threads_for(requested, cores, free) == expected


def test_free_cores_are_the_cores_less_what_other_processes_used():
    before = Sample(wall=10.0, busy=100.0, own=5.0, cores=2)
    after = Sample(wall=10.5, busy=101.5, own=5.7, cores=2)  # 1.5 s busy, 0.7 s of it this process's
    assert free_cores(before, after) == pytest.approx(2 - 0.8 / 0.5)
    mine = Sample(wall=10.5, busy=100.9, own=6.0, cores=2)  # tick rounding: own > busy counts as none
    assert free_cores(before, mine) == 2.0


def test_the_load_is_read_once_per_period_and_known_after_two_reads(machine):
    load = threads._LOAD
    assert load.free_now() is None and machine.reads == 1  # one reading says nothing yet
    machine.run(PERIOD / 2, others=1.0)
    assert load.free_now() is None and machine.reads == 1  # within the period: no read
    machine.run(STEP, others=1.0)
    assert load.free_now() == (2, pytest.approx(1.0)) and machine.reads == 2  # one core's worth taken
    machine.run(STEP, others=0.0)
    assert load.free_now() == (2, pytest.approx(2.0)) and machine.reads == 3


def test_adapted_runs_on_the_free_cores_and_restores_the_count(machine, two_threads):
    threads._LOAD.free_now()
    machine.run(STEP, others=1.0)  # a busy process on one of the two cores
    with adapted(torch.device("cpu")):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == 2
    with pytest.raises(RuntimeError, match="inside"), adapted(torch.device("cpu")):
        assert torch.get_num_threads() == 1
        raise RuntimeError("inside")
    assert torch.get_num_threads() == 2
    with adapted(torch.device("cpu")), adapted(torch.device("cpu")):  # nested: restored once, to 2
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == 2
    with tuned(adaptive_threads=0), adapted(torch.device("cpu")):  # switched off
        assert torch.get_num_threads() == 2
    with adapted(torch.device("meta")):  # off the CPU nothing changes
        assert torch.get_num_threads() == 2


def test_a_quiet_machine_or_no_counters_change_nothing(machine, monkeypatch, two_threads):
    threads._LOAD.free_now()
    machine.run(STEP, others=0.2)
    with adapted(torch.device("cpu")):
        assert torch.get_num_threads() == 2
    monkeypatch.setattr(threads, "_LOAD", threads._Load(lambda: None))  # not Linux
    with adapted(torch.device("cpu")):
        assert torch.get_num_threads() == 2
    assert threads._LOAD.disabled


def test_nothing_is_adapted_while_other_python_threads_run(machine, monkeypatch, two_threads):
    """A thread that first used torch while a call ran on one thread would keep one thread."""
    threads._LOAD.free_now()
    machine.run(STEP, others=1.0)
    monkeypatch.setattr(threads, "_alone", lambda: False)
    with adapted(torch.device("cpu")):
        assert torch.get_num_threads() == 2


def test_another_running_python_thread_is_seen():
    stop = threading.Event()
    other = threading.Thread(target=stop.wait)
    other.start()
    try:
        assert not threads._alone()
    finally:
        stop.set()
        other.join()


def test_a_forked_child_starts_its_own_readings(machine):
    threads._LOAD.free_now()
    parent = threads._LOAD
    threads._forget_after_fork()  # what os.register_at_fork runs in the child
    assert threads._LOAD is not parent and threads._LOAD.last is None


def test_the_real_counters_can_be_read():
    sample = threads.read_sample()
    if sample is None:
        pytest.skip("no /proc/stat here: the threads are never adapted")
    assert sample.cores >= 1 and sample.busy >= 0 and sample.own > 0


def test_a_call_and_its_backward_run_on_the_free_cores(machine, monkeypatch, two_threads):
    """The call through the registry, and the block-sparse engine's backward, which runs after the
    call has returned, both see one thread while a busy process holds one of two cores."""
    threads._LOAD.free_now()
    machine.run(STEP, others=1.0)
    seen = []
    scatter = blocksparse_backward._add_rows

    def spy(*args):
        seen.append(torch.get_num_threads())
        return scatter(*args)

    monkeypatch.setattr(blocksparse_backward, "_add_rows", spy)
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy_sdpa(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy_sdpa)
    q, k, v = (torch.randn(1, 2, 40, 8, requires_grad=True) for _ in range(3))
    subquad.attention(q, k, v, mechanism="full")
    out = subquad.attention(q, k, v, mechanism="local", window=8)
    assert torch.get_num_threads() == 2
    out.sum().backward()
    assert torch.get_num_threads() == 2
    assert seen and set(seen) == {1}


def _count_threads_in(monkeypatch, module, name: str) -> list[int]:
    """Record the thread count whenever ``module.name`` (a torch function) runs."""
    seen, original = [], getattr(module, name)

    def spy(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, spy)
    return seen


@pytest.mark.parametrize("name", ["clustered", "improved-clustered", "multires", "agglomerative"])
def test_a_backward_of_torchs_own_operations_runs_on_the_free_cores(machine, monkeypatch, two_threads, name):
    """Mechanisms whose backward is autograd's (``plain_backward``) run it on one thread while a busy
    process holds one of two cores, with the gradients autograd gives without the bracket; the
    count is back to two after the backward."""
    mech = get_mechanism(name)
    assert mech.plain_backward
    config = mech.config(**({"clusters": 4} if "clustered" in name else {}))  # not exactly full attention
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 1, 4, 48, 8, generator=gen, requires_grad=True)  # q, k and v come from x
    q, k, v = x.unbind(0)
    extra = {}
    if mech.example_tensors is not None:
        extra = mech.example_tensors(q, k, v, config, torch.Generator().manual_seed(1))
    grad = torch.randn(1, 4, 48, 8, generator=gen)
    with tuned(adaptive_threads=0):
        (expected,) = torch.autograd.grad(call(mech, q, k, v, config=config, **extra), (x,), grad)
    threads._LOAD.free_now()
    machine.run(STEP, others=1.0)
    seen = []

    def fn(*args, **kwargs):  # the mechanism, with a hook inside its backward
        out = mech.fn(*args, **kwargs)
        out.register_hook(lambda g: seen.append(torch.get_num_threads()))
        return out.view_as(out)

    out = call(dataclasses.replace(mech, fn=fn), q, k, v, config=config, **extra)
    assert torch.get_num_threads() == 2
    x.register_hook(lambda g: seen.append(torch.get_num_threads()))  # after q's, k's and v's: restored
    out.backward(grad)
    assert seen == [1, 2] and torch.get_num_threads() == 2
    assert torch.allclose(x.grad, expected, atol=1e-6)


def test_the_bracket_restores_the_count_when_only_some_inputs_take_a_gradient(machine, two_threads):
    threads._LOAD.free_now()
    machine.run(STEP, others=1.0)
    q, k, v = (torch.randn(1, 2, 48, 8, requires_grad=True) for _ in range(3))
    out = subquad.attention(q, k, v, mechanism="clustered", clusters=4)
    (dq,) = torch.autograd.grad(out.sum(), (q,), retain_graph=True)  # k's and v's hooks never run
    assert torch.get_num_threads() == 2 and dq.shape == q.shape
    out.sum().backward()  # the kept graph runs again, bracketed again
    assert torch.get_num_threads() == 2 and v.grad is not None


def test_a_backward_that_raises_leaves_the_count_lowered_only_until_the_next_call(machine, two_threads):
    threads._LOAD.free_now()
    machine.run(STEP, others=1.0)
    q, k, v = (torch.randn(1, 2, 48, 8, requires_grad=True) for _ in range(3))
    out = subquad.attention(q, k, v, mechanism="clustered", clusters=4)
    v.register_hook(lambda g: (_ for _ in ()).throw(RuntimeError("in the backward")))
    with pytest.raises(RuntimeError, match="in the backward"):
        out.sum().backward()
    subquad.attention(q, k, v, mechanism="local", window=4)  # any call restores what was left lowered
    assert torch.get_num_threads() == 2 and not threads._OPEN


def test_gradcheck_through_the_bracket_under_load(machine, two_threads):
    """gradcheck's checks, undefined output gradients among them (the hooks get None), pass with
    the bracket on: a busy process holds one of two cores throughout."""
    threads._LOAD.free_now()
    machine.run(STEP, others=1.0)
    q, k, v = (torch.randn(1, 2, 12, 4, dtype=torch.float64, requires_grad=True) for _ in range(3))
    assert threads._lowers(q.device)
    fn = lambda *xs: subquad.attention(*xs, mechanism="improved-clustered", clusters=3, topk=4)
    assert torch.autograd.gradcheck(fn, (q, k, v), eps=1e-6, atol=1e-5, fast_mode=True)
    assert torch.get_num_threads() == 2 and not threads._OPEN


def test_no_bracket_on_a_quiet_machine(machine, two_threads):
    """Quiet, the call is autograd's own: no identity views or hooks are added."""
    threads._LOAD.free_now()
    machine.run(STEP, others=0.0)
    q, k, v = (torch.randn(1, 2, 48, 8, requires_grad=True) for _ in range(3))
    calls = []
    threads.backward_adapted(lambda *xs: calls.append(xs) or xs[0] * 2, [q, k, v])
    assert all(x is y for x, y in zip(calls[0], (q, k, v)))
    machine.run(STEP, others=1.0)
    threads.backward_adapted(lambda *xs: calls.append(xs) or xs[0] * 2, [q, k, v])
    assert all(x is not y and torch.equal(x, y) for x, y in zip(calls[1], (q, k, v)))


def test_double_backward_goes_through_the_bracket(machine, two_threads):
    threads._LOAD.free_now()
    machine.run(STEP, others=1.0)
    x = torch.randn(5, dtype=torch.float64, requires_grad=True)
    y = threads.backward_adapted(lambda t: (t**3).sum(), [x])
    (g,) = torch.autograd.grad(y, (x,), create_graph=True)
    (h,) = torch.autograd.grad(g.sum(), (x,))
    assert torch.allclose(h, 6 * x) and torch.get_num_threads() == 2


def _outputs_and_gradients(name: str, causal: bool, threads_: int) -> list[torch.Tensor]:
    mech = get_mechanism(name)
    config = mech.config()
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 256, 32, generator=gen) for _ in range(3))
    extra = mech.example_tensors(q, k, v, config, torch.Generator().manual_seed(1)) if mech.example_tensors else {}
    leaves = [x.requires_grad_() for x in (q, k, v)]
    leaves += [x.requires_grad_() for x in extra.values() if isinstance(x, torch.Tensor) and x.is_floating_point()]
    saved = torch.get_num_threads()
    torch.set_num_threads(threads_)
    try:
        with tuned(adaptive_threads=0):
            out = call(mech, q, k, v, is_causal=causal, config=config, **extra)
            out.backward(torch.randn(out.shape, generator=gen))
    finally:
        torch.set_num_threads(saved)
    return [out.detach()] + [x.grad for x in leaves if x.grad is not None]


@pytest.mark.parametrize(
    "name, causal",
    [(n, c) for n in mechanism_names() for c in ((False, True) if get_mechanism(n).causal else (False,))],
)
def test_outputs_and_gradients_do_not_depend_on_the_thread_count(name, causal):
    """What lets the thread count follow the machine's load: one thread gives the two threads'
    outputs and gradients, bitwise wherever torch's own attention kernel does (as on the 2-core
    machines CI runs on); on CPUs where torch's kernel itself rounds differently with the thread
    count (seen on a 16-core server), within fp32 rounding."""
    one, two = (_outputs_and_gradients(name, causal, n) for n in (1, 2))
    assert len(one) == len(two) >= 4
    bitwise = _torch_is_bitwise_across_thread_counts()
    for a, b in zip(one, two):
        assert torch.equal(a, b) if bitwise else torch.allclose(a, b, rtol=1e-5, atol=1e-6)


@functools.cache
def _torch_is_bitwise_across_thread_counts() -> bool:
    pairs = [(_outputs_and_gradients("full", c, 1), _outputs_and_gradients("full", c, 2)) for c in (False, True)]
    return all(torch.equal(a, b) for x, y in pairs for a, b in zip(x, y))


def test_by_default_a_call_never_changes_the_callers_thread_count_even_on_a_busy_machine(machine, two_threads):
    threads._LOAD.free_now()
    machine.run(STEP, others=1.0)  # a busy process on one of the two cores
    seen = []
    with tuned(adaptive_threads=0):  # the library's default
        assert Tuning().adaptive_threads == 0
        q = torch.randn(1, 2, 64, 8, requires_grad=True)
        with adapted(torch.device("cpu")):
            seen.append(torch.get_num_threads())
        subquad.attention(q, q, q, mechanism="local", window=8, is_causal=True).sum().backward()
        seen.append(torch.get_num_threads())
    assert seen == [2, 2] and machine.reads == 1, "the load is not even read"
