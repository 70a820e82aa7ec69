"""The allocator instrument (remat.measurement.allocator) against a hand count.

The stack: 8 bias-free ``Linear(256, 256)``, an input of 4096 x 256 created
outside the measured region, loss = ``sum``. With A = 4096*256*4 bytes (one
activation) and W = 256*256*4 bytes (one weight):

* Forward: every layer's output is allocated (8A). Linear saves its input, so
  outputs 1..7 are held; output 8 dies once ``sum`` has run. The loss is 4 bytes.
* Backward of layer 8: 7A held, the loss and the seed gradient of ``sum`` (8
  bytes; its expansion to 4096 x 256 is a stride-0 view), the new input gradient
  (A) and weight gradient (W): 8A + W + 8 at the dispatch level. The matmul needs
  a contiguous gradient, so the kernel copies the broadcast one into a scratch
  buffer (A) that the allocator sees and the dispatcher does not: 9A + W + 8.
* Backward of layer 7: 6A held, the gradient of output 7 (A), the new input
  gradient (A) and two weight gradients (2W): 8A + 2W + 8 on both instruments.
* Later layers hold less. Dispatch peak: 8A + 2W + 8 (layer 7, as W > 0);
  allocator peak: 9A + W + 8 (layer 8, as A > W).

So the two instruments differ by exactly the scratch copy minus one weight
gradient: allocator - dispatch = A - W.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from remat.measurement import allocator
from remat.measurement.collective_buffers import Release
from remat.measurement.deaths import Death
from remat.measurement.meter import MemoryMeter

A = 4096 * 256 * 4
W = 256 * 256 * 4
SCALARS = 8  # the loss and its seed gradient, 4 bytes each


@pytest.fixture()
def stack() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(256, 256, bias=False) for _ in range(8)])
    return model, torch.randn(4096, 256)


def _step(model: nn.Module, x: torch.Tensor) -> None:
    for p in model.parameters():
        p.grad = None
    model(x).sum().backward()


def test_allocator_peak_matches_hand_count(stack: tuple[nn.Module, torch.Tensor]) -> None:
    model, x = stack
    _step(model, x)  # warm-up
    for p in model.parameters():
        p.grad = None
    assert allocator.allocator_peak(lambda: model(x).sum().backward()) == 9 * A + W + SCALARS


def test_dispatch_meter_misses_the_scratch_copy(stack: tuple[nn.Module, torch.Tensor]) -> None:
    model, x = stack
    _step(model, x)
    for p in model.parameters():
        p.grad = None
    with MemoryMeter() as meter:
        model(x).sum().backward()
    for p in model.parameters():
        p.grad = None
    alloc = allocator.allocator_peak(lambda: model(x).sum().backward())
    assert meter.peak_bytes == 8 * A + 2 * W + SCALARS
    assert alloc - meter.peak_bytes == A - W


def test_peak_of_is_a_running_sum_above_the_start() -> None:
    ev = allocator.AllocationEvent
    events = [ev(0, -100, "cpu"), ev(1, 300, "cpu"), ev(2, 50, "cuda"), ev(3, -300, "cpu"),
              ev(4, 120, "cpu")]
    assert allocator.peak_of(events) == 200  # -100 + 300
    assert allocator.peak_of(events, "cuda") == 50
    assert allocator.peak_of([ev(0, -5, "cpu")]) == 0


def test_a_block_whose_free_went_unrecorded_is_freed_when_its_address_is_reused() -> None:
    # A collective's work on gloo's threads can drop a tensor's last reference after it
    # ran, outside the profiler's scope: the block's free is missing from the record.
    ev = allocator.AllocationEvent
    events = [ev(0, 300, "cpu", 0xA0), ev(1, 100, "cpu", 0xB0), ev(2, 200, "cpu", 0xA0),
              ev(3, -200, "cpu", 0xA0), ev(4, -100, "cpu", 0xB0)]
    closed = allocator.unrecorded_frees_closed(events)
    assert [e.nbytes for e in closed] == [300, 100, -300, 200, -200, -100]
    assert allocator.peak_of(closed) == 400  # not 600: the first block went before the reuse
    unknown = [ev(0, 300, "cpu"), ev(1, 200, "cpu")]  # no address: summed as recorded
    assert allocator.unrecorded_frees_closed(unknown) == unknown


def test_a_block_whose_storage_the_meter_saw_die_is_freed_then() -> None:
    ev, death = allocator.AllocationEvent, Death
    # 0xA0's storage died at 5, its free unrecorded: closed then, not at the reuse (8).
    # 0xB0's free was recorded (6), a new block took its address (7), and the old
    # storage's death was noted after that (7.5): it must not close the new block.
    events = [ev(0, 300, "cpu", 0xA0), ev(1, 100, "cpu", 0xB0), ev(6, -100, "cpu", 0xB0),
              ev(7, 100, "cpu", 0xB0), ev(8, 200, "cpu", 0xA0), ev(9, -200, "cpu", 0xA0)]
    deaths = [death("cpu", 0xA0, born_ns=0, time_ns=5), death("cpu", 0xB0, born_ns=1, time_ns=7)]
    closed = allocator.unrecorded_frees_closed(events, deaths)
    assert [(e.time_ns, e.nbytes) for e in closed] == [
        (0, 300), (1, 100), (5, -300), (6, -100), (7, 100), (8, 200), (9, -200)]
    # A death noted a moment before its own recorded free: freed once, at the death.
    events = [ev(0, 300, "cpu", 0xA0), ev(4, -300, "cpu", 0xA0)]
    closed = allocator.unrecorded_frees_closed(events, [death("cpu", 0xA0, 0, 3)])
    assert [(e.time_ns, e.nbytes) for e in closed] == [(0, 300), (3, -300)]


def test_a_collectives_own_buffer_is_freed_when_its_work_ended() -> None:
    # gloo's clone of a reduce-scatter's input: no meter counts it, and its free goes
    # unrecorded when gloo's worker drops the work (remat.measurement.collective_buffers).
    ev, release = allocator.AllocationEvent, Release
    events = [ev(0, 300, "cpu", 0xA0),  # unrecorded free, address reused at 8
              ev(1, 100, "cpu", 0xB0), ev(6, -100, "cpu", 0xB0),  # recorded free at 6
              ev(2, 50, "cpu", 0xC0),  # never freed by the record
              ev(3, 70, "cpu", 0xD0),  # unrecorded, reused at 8 before its release (9)
              ev(8, 200, "cpu", 0xA0), ev(8, 10, "cpu", 0xD0)]
    releases = [release(0xA0, allocated_ns=0, time_ns=4),
                release(0xB0, allocated_ns=1, time_ns=3),  # the caller held it: 6 stands
                release(0xC0, allocated_ns=2, time_ns=5),
                release(0xD0, allocated_ns=3, time_ns=9),
                release(0xA0, allocated_ns=7, time_ns=9)]  # another block's: ignored
    closed = allocator.unrecorded_frees_closed(sorted(events, key=lambda e: e.time_ns),
                                               released=releases)
    frees = {(e.ptr, e.time_ns) for e in closed if e.nbytes < 0}
    assert frees == {(0xA0, 4), (0xB0, 6), (0xC0, 5), (0xD0, 8)}
    assert sum(e.nbytes for e in closed) == 210  # the two blocks allocated at 8
    assert allocator.peak_of(closed) == 520  # at 3: every block but 0xA0's first


def test_a_tensor_freed_on_another_thread_leaves_the_allocators_view_when_it_dies() -> None:
    # As gloo's workers drop FSDP's collective buffers: the last reference goes on a
    # thread the profiler does not record, so only the meter sees the free.
    import threading

    n = 1 << 20
    handed: list[torch.Tensor] = []
    dropped = threading.Event()

    def worker() -> None:
        handed.clear()  # the last reference, on this thread
        dropped.set()

    def step() -> None:
        handed.append(torch.ones(n))  # 4 MiB, recorded on this thread
        thread = threading.Thread(target=worker)
        thread.start()
        dropped.wait()
        thread.join()
        keep = [torch.ones(n + 4096) for _ in range(2)]  # elsewhere: no reuse closes it
        del keep

    with MemoryMeter() as meter, allocator.AllocatorTimeline() as timeline:
        timeline.mark()
        step()
        end = timeline.mark()
    two = 2 * (n + 4096) * 4
    assert meter.peak_bytes == two  # the first block was gone before the two came
    # Without the meter's deaths the block would count to the end of the region, or to
    # a reuse of its address (mmap may hand it out again: not a thing a test can hold).
    assert timeline.rise(0, end) == two


def test_the_profiler_sessions_print_nothing(capfd) -> None:
    # Kineto prints `USDT: ... profiler_start/stop` from C++ on every session, and the CPU
    # allocator warns once about blocks freed that it did not see allocated.
    kept = torch.randn(1024)
    x = torch.randn(256, 256, requires_grad=True)

    def step() -> None:
        nonlocal kept
        kept = None  # a block from before the session, freed in it
        (x @ x).sum().backward()
        import os

        os.write(2, b"the user's own line\n")  # what the step itself prints stays

    capfd.readouterr()
    for _ in range(2):
        assert allocator.allocator_peak(step) > 0
        with allocator.AllocatorTimeline() as timeline:
            timeline.mark()
            step()
            timeline.mark()
    err = capfd.readouterr().err
    assert "USDT" not in err and "STAGE:" not in err and "CPUAllocator" not in err
    assert err.count("the user's own line") == 4


def test_sessions_in_two_threads_run_one_after_the_other() -> None:
    # Two torch.profiler sessions at once crashed the process: run it in a child.
    import subprocess
    import sys

    code = (
        "import threading, torch\n"
        "from remat.measurement.allocator import allocator_peak\n"
        "x = torch.randn(512, 512, requires_grad=True)\n"
        "peaks = []\n"
        "def work():\n"
        "    for _ in range(5):\n"
        "        peaks.append(allocator_peak(lambda: (x @ x).sum().backward()))\n"
        "threads = [threading.Thread(target=work) for _ in range(2)]\n"
        "[t.start() for t in threads]; [t.join() for t in threads]\n"
        "print(len(peaks), min(peaks) > 0)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["10", "True"]
