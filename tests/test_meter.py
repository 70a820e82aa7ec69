"""The memory meter is exact on CPU: every figure here is counted by hand first.

Notation (float32, so 4 bytes an element):
    A = B*D*4   one (B, D) activation
    W = D*D*4   one (D, D) weight (and its gradient)
    Db = D*4    one bias (and its gradient)

Two facts about ``y.sum().backward()`` used throughout:
    * ``y.sum()`` allocates the 4-byte scalar loss, alive during the backward call;
    * ``torch.autograd.backward`` creates the seed gradient ``ones_like(loss)`` (4 more
      bytes) and its Python frame holds it until the backward call returns; ``SumBackward``
      hands on ``ones.expand(B, D)``, a view (stride 0) that allocates nothing.
    So the backward of a sum adds a constant 8 bytes to every figure taken during it.

Autograd frees a node's saved tensors and its incoming gradient once the node has run;
a gradient that ``AccumulateGrad`` moves into ``param.grad`` stays (it was allocated
in the region). Inputs and parameters made before ``__enter__`` never count.
"""

from __future__ import annotations

import gc

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

from remat.measurement.meter import MemoryMeter, MeterMark
from remat.measurement.storage import storage_bytes

F32 = 4
SUM_BACKWARD = 8  # loss scalar + seed gradient, see the module docstring


def _linear_stack(layers: int, d: int, *, bias: bool, relu: bool) -> nn.Sequential:
    mods: list[nn.Module] = []
    for _ in range(layers):
        mods.append(nn.Linear(d, d, bias=bias))
        if relu:
            mods.append(nn.ReLU())
    return nn.Sequential(*mods)


# ---------------------------------------------------------------- bias-free Linear stack
def linear_stack_peak(layers: int, a: int, w: int) -> int:
    """Peak of forward + ``y.sum().backward()`` for L bias-free Linears, y kept alive.

    Forward: layer i allocates its output y_i (A); layer i saves its input y_{i-1}
    (y_0 = X is outside the region) and its weight. Nothing is freed: y_1..y_{L-1} are
    saved by the next layer and y_L = y is referenced. Live = L*A, and that is the
    forward peak.

    Backward, MmBackward of layer k (k = L..1) allocates grad_W (W, moved into
    W.grad, stays) and, for k >= 2, grad_in (A, for y_{k-1}); then it frees its saved
    input y_{k-1} (for k >= 2; y_L = y stays) and the incoming gradient (A for k < L;
    for k = L it is the zero-byte expand of ``ones``). Live at the end of layer k's
    allocations, besides the 8 bytes of the sum:
        k = L:          y_1..y_{L-1}, y, grad_in, 1 weight grad      = (L+1)A + W
        2 <= k < L:     y_1..y_{k-1}, y, incoming, grad_in, (L-k+1) weight grads
                                                                     = (k+2)A + (L-k+1)W
        k = 1:          y, incoming, L weight grads                  = 2A + L*W
    The peak is the largest of these (plus 8). When A >= W it is k = L-1:
    (L+1)A + 2W + 8, e.g. 9A + 2W + 8 for L = 8.
    """
    assert layers >= 2
    candidates = [(layers + 1) * a + w, 2 * a + layers * w]
    candidates += [(k + 2) * a + (layers - k + 1) * w for k in range(2, layers)]
    return max(candidates) + SUM_BACKWARD


@pytest.mark.parametrize(
    ("layers", "batch", "d"),
    [(8, 64, 32), (2, 16, 8), (5, 48, 16), (4, 8, 64)],  # the last has W > A
)
def test_linear_stack_forward_and_backward_exact(layers: int, batch: int, d: int) -> None:
    torch.manual_seed(0)
    net = _linear_stack(layers, d, bias=False, relu=False)
    x = torch.randn(batch, d)  # made before the region: does not count
    a, w = batch * d * F32, d * d * F32
    with MemoryMeter() as meter:
        y = net(x)
        fwd = meter.mark("forward")
        y.sum().backward()
        bwd = meter.mark("backward")
    # After forward all L outputs are alive (saved by the next layer, or y itself).
    assert fwd.live_bytes == layers * a
    assert fwd.peak_bytes == layers * a
    assert bwd.peak_bytes == linear_stack_peak(layers, a, w)
    assert meter.peak_bytes == linear_stack_peak(layers, a, w)
    # After backward: y (still referenced) and the L weight gradients; the sum's 8 bytes
    # and every saved activation are gone.
    assert bwd.live_bytes == a + layers * w
    if (layers, batch, d) == (8, 64, 32):
        assert bwd.peak_bytes == 9 * a + 2 * w + 8  # the A >= W closed form for L = 8


# ---------------------------------------------------------------- Linear + ReLU stack
def linear_relu_stack_peak(layers: int, a: int, g: int) -> int:
    """Peak of forward + ``y.sum().backward()`` for L (Linear with bias, ReLU) pairs.

    ``g = W + Db`` is one layer's parameter gradients. Forward: addmm allocates h_i (A),
    relu allocates r_i (A). Linear_i saves its input r_{i-1}; ReLU_i saves its output
    r_i: r_i is saved twice but is one storage. h_i is saved by nobody and dies when
    relu returns. After forward: L*A; forward peak (L+1)A (h_L beside r_1..r_L).

    Backward (8 bytes of the sum besides):
        ReLU_L:   threshold_backward -> g_h (A); live r_1..r_L, g_h        = (L+1)A
        Linear_L: grad_in (A), grad_W (W), grad_b (Db, a sum over the batch)
                  -> r_1..r_L, g_h, grad_in, g                               = (L+2)A + g
                  then frees g_h (its saved input r_{L-1} is still saved by ReLU_{L-1}).
        ReLU_k (k < L): allocates g_h; live r_1..r_k, r_L, incoming, g_h, (L-k) g
                                                                     = (k+3)A + (L-k)g
                  then frees r_k (no longer saved) and the incoming gradient.
        Linear_k (2 <= k < L): r_1..r_{k-1}, r_L, g_h, grad_in, (L-k+1) g
                                                                     = (k+2)A + (L-k+1)g
        Linear_1: no grad_in (X has no grad): r_L, g_h, L g          = 2A + L*g
    When A >= g the peak is (L+2)A + g + 8.
    """
    candidates = [(layers + 1) * a, (layers + 2) * a + g, 2 * a + layers * g]
    candidates += [(k + 3) * a + (layers - k) * g for k in range(1, layers)]
    candidates += [(k + 2) * a + (layers - k + 1) * g for k in range(2, layers)]
    return max(candidates) + SUM_BACKWARD


@pytest.mark.parametrize(("layers", "batch", "d"), [(4, 64, 32), (3, 4, 64)])
def test_linear_relu_stack_exact(layers: int, batch: int, d: int) -> None:
    torch.manual_seed(0)
    net = _linear_stack(layers, d, bias=True, relu=True)
    x = torch.randn(batch, d)
    a, w, db = batch * d * F32, d * d * F32, d * F32
    with MemoryMeter() as meter:
        y = net(x)
        fwd = meter.mark("forward")
        y.sum().backward()
        bwd = meter.mark("backward")
    # ReLU's saved output and the next Linear's saved input share one storage: L*A.
    assert fwd.live_bytes == layers * a
    assert fwd.peak_bytes == (layers + 1) * a
    assert bwd.peak_bytes == linear_relu_stack_peak(layers, a, w + db)
    # After backward: y plus W and b gradients of every layer.
    assert bwd.live_bytes == a + layers * (w + db)


def test_linear_relu_stack_closed_form() -> None:
    # L = 4, B = 64, D = 32: A = 8192, W = 4096, Db = 128, so A >= W + Db.
    # With y referenced: peak = (L+2)A + W + Db + 8 = 49152 + 4096 + 128 + 8 = 53384.
    # Without it, r_L is saved by ReLU_L only and dies once ReLU_L's backward has run,
    # so every later figure is A lower: peak = (L+1)A + W + Db + 8 = 45192.
    torch.manual_seed(0)
    net = _linear_stack(4, 32, bias=True, relu=True)
    x = torch.randn(64, 32)
    with MemoryMeter() as kept:
        y = net(x)
        y.sum().backward()
    assert kept.peak_bytes == 53384
    del y
    for p in net.parameters():
        p.grad = None
    with MemoryMeter() as dropped:
        net(x).sum().backward()
    assert dropped.peak_bytes == 45192


# ---------------------------------------------------------------- Conv2d
def test_conv2d_relu_exact() -> None:
    # N=2, C_in=3, 10x12 images, C_out=5, k=3, stride 2, padding 1:
    # H_out = (10 + 2 - 3)//2 + 1 = 5, W_out = (12 + 2 - 3)//2 + 1 = 6,
    # output O = N*C_out*H_out*W_out*4 = 2*5*5*6*4 = 1200 bytes.
    torch.manual_seed(0)
    n, c_in, h, w, c_out = 2, 3, 10, 12, 5
    conv = nn.Conv2d(c_in, c_out, 3, stride=2, padding=1)
    x = torch.randn(n, c_in, h, w)
    out_bytes = n * c_out * 5 * 6 * F32
    assert out_bytes == 1200
    weight_grad, bias_grad = c_out * c_in * 3 * 3 * F32, c_out * F32  # 540, 20
    with MemoryMeter() as meter:
        h_conv = conv(x)
        assert meter.live_bytes == out_bytes  # the convolution alone: exactly its output
        del h_conv
        assert meter.live_bytes == 0
        y = F.relu(conv(x))
        fwd = meter.mark("forward")
        y.sum().backward()
        bwd = meter.mark("backward")
    # Forward: conv output (1200, not saved: conv saves its input and weight) and relu
    # output (1200, saved by relu) -> peak 2400; after forward only y: 1200.
    assert fwd.live_bytes == out_bytes
    assert fwd.peak_bytes == 2 * out_bytes
    # Backward: threshold_backward -> grad of conv output (1200); convolution_backward
    # -> weight and bias grads (560; no input grad). Peak = y + grad + 560 + 8 = 2968.
    assert bwd.peak_bytes == 2 * out_bytes + weight_grad + bias_grad + SUM_BACKWARD == 2968
    assert bwd.live_bytes == out_bytes + weight_grad + bias_grad


# ---------------------------------------------------------------- checkpoint
# checkpoint stashes the CPU RNG state with each region (torch.get_rng_state(), made
# outside the dispatcher; the meter counts it), and forks it around the recompute.
RNG = torch.get_rng_state().untyped_storage().nbytes()


def test_checkpointed_block_exact() -> None:
    # Block: Linear(D, D, no bias) -> ReLU -> Linear(D, D, no bias); B=16, D=8:
    # A = 512, W = 256. The input x is created inside the region (A).
    b, d = 16, 8
    a, w = b * d * F32, d * d * F32
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(d, d, bias=False), nn.ReLU(), nn.Linear(d, d, bias=False))
    with set_checkpoint_early_stop(True), MemoryMeter() as meter:
        x = torch.randn(b, d)
        y = checkpoint(block, x, use_reentrant=False)
        fwd = meter.mark("forward")
        y.sum().backward()
        bwd = meter.mark("backward")
    # Forward: x, h1 = x W1^T, r1 = relu(h1) -> 3A at the peak; h1 dies after relu,
    # r1 after the second Linear (checkpoint saves nothing). Live: x, y and the RNG state.
    assert fwd.live_bytes == 2 * a + RNG
    assert fwd.peak_bytes == 3 * a + RNG
    # Backward (8 bytes of the sum besides x and y):
    #   recompute (early stop: it ends once the last saved tensor is packed, before the
    #   second Linear's matmul), with the RNG state forked around it (RNG): h1 (A),
    #   r1 (A); h1 dies                                            -> 2A + 2A + 2 RNG
    #   the fork's copy is dropped; the stashed state goes with the region
    #   Linear2 backward: grad_W2 (W), grad of r1 (A)             -> 4A + W
    #   ReLU backward: threshold_backward (A)                     -> 5A + W
    #   frees r1 and grad of r1; Linear1 backward: grad_W1 (W) only (x needs no grad)
    assert bwd.peak_bytes == max(5 * a + w, 4 * a + 2 * RNG) + SUM_BACKWARD
    # End: x, y, two weight gradients.
    assert bwd.live_bytes == 2 * a + 2 * w


def test_checkpoint_frees_what_plain_forward_keeps() -> None:
    # Same block without checkpoint: Linear1 saves x, ReLU and Linear2 save r1 (one
    # storage), so after forward x, r1 and y are live: 3A; with checkpoint 2A.
    b, d = 16, 8
    a = b * d * F32
    block = nn.Sequential(nn.Linear(d, d, bias=False), nn.ReLU(), nn.Linear(d, d, bias=False))
    with MemoryMeter() as plain:
        x = torch.randn(b, d)
        y = block(x)
    with MemoryMeter() as ckpt:
        x2 = torch.randn(b, d)
        y2 = checkpoint(block, x2, use_reentrant=False)
    assert plain.live_bytes == 3 * a
    assert ckpt.live_bytes == 2 * a + RNG
    del x, y, x2, y2


# ---------------------------------------------------------------- aliasing and freeing
def test_views_and_inplace_do_not_count() -> None:
    with MemoryMeter() as meter:
        x = torch.randn(8, 16)  # 512 bytes
        assert meter.live_bytes == 512
        v = x.view(16, 8)
        t = x.t()
        s = x[2:4]
        parts = x.chunk(4)
        x.add_(1)
        x.mul_(2)
        torch.add(x, 1, out=x)
        assert meter.live_bytes == 512
        z = torch.empty(8, 16)  # a fresh output buffer: 512 bytes
        torch.mul(x, 3, out=z)  # writing into it allocates nothing
        assert meter.live_bytes == 1024
    assert storage_bytes((x, v, t, s, parts)) == 512


def test_out_resize_counts_the_growth() -> None:
    with MemoryMeter() as meter:
        x = torch.randn(8, 16)  # 512
        z = torch.empty(0)  # 0 bytes
        torch.add(x, 1, out=z)  # out= resizes z's storage to 512 bytes
        assert meter.live_bytes == 1024
    del z


def test_shared_storage_counts_once() -> None:
    with MemoryMeter() as meter:
        x = torch.randn(10, 10)  # 400
        y = torch.empty(0).set_(x.untyped_storage(), 0, (100,))  # a second tensor, same storage
        d = x.detach()
        assert meter.live_bytes == 400
        del x, d
        assert meter.live_bytes == 400  # y still holds the storage
        del y
        assert meter.live_bytes == 0


def test_freeing_lowers_live_at_once() -> None:
    with MemoryMeter() as meter:
        a = torch.ones(100)  # 400
        b = torch.ones(50)  # 200
        assert meter.live_bytes == 600
        del a
        assert meter.live_bytes == 200
        del b
        assert meter.live_bytes == 0
    assert meter.peak_bytes == 600


def test_freeing_garbage_cycles_inside_the_meter_does_not_deadlock() -> None:
    # A weakref callback can fire from a cyclic GC pass triggered by an allocation inside
    # the meter's own locked bookkeeping; the lock must be re-entrant.
    class Cycle:
        def __init__(self, t: torch.Tensor) -> None:
            self.me = self
            self.t = t

    old = gc.get_threshold()
    try:
        with MemoryMeter() as meter:
            for threshold in range(2, 30):
                gc.set_threshold(threshold, 10, 10)
                for _ in range(40):
                    Cycle(torch.ones(4))
                    y = torch.ones(4) * 2
            gc.set_threshold(*old)
            gc.collect()
            assert meter.live_bytes == storage_bytes(y)
    finally:
        gc.set_threshold(*old)


def test_mark_segments_peaks() -> None:
    with MemoryMeter() as meter:
        a = torch.ones(100)  # live 400
        m1 = meter.mark("one")  # peak since enter: 400
        del a  # live 0
        b = torch.ones(50)  # live 200
        m2 = meter.mark("two")  # peak since m1: 400 (live at m1 was 400)
        c = torch.ones(25)  # live 300
        del b, c  # live 0
        m3 = meter.mark("three")  # peak since m2: 300
        meter.reset_peak()
        d = torch.ones(10)  # live 40
        m4 = meter.mark("four")
    assert m1 == MeterMark("one", 400, 400)
    assert m2 == MeterMark("two", 200, 400)
    assert m3 == MeterMark("three", 0, 300)
    assert m4 == MeterMark("four", 40, 40)
    assert meter.marks == [m1, m2, m3, m4]
    assert meter.peak_bytes == 400
    del d


def test_storages_from_before_enter_do_not_count() -> None:
    x = torch.randn(8, 16)
    with MemoryMeter() as meter:
        x.add_(1)
        v = x.view(-1)
        parts = x.split(4)  # a Tensor[] of views of an outside storage
        rows = x.unbind(0)
        assert meter.live_bytes == 0
        y = x * 2  # a new storage: counts
        assert meter.live_bytes == 512
    assert storage_bytes((v, parts, rows)) == 512
    del y


def test_device_filter() -> None:
    net = _linear_stack(3, 16, bias=False, relu=False)
    x = torch.randn(4, 16)
    with MemoryMeter(device_type="cuda") as cuda_only:
        net(x).sum().backward()
    assert cuda_only.live_bytes == 0 and cuda_only.peak_bytes == 0
    with MemoryMeter(device_type="cpu") as cpu_only:
        y = net(x)
    assert cpu_only.live_bytes == 3 * 4 * 16 * F32
    del y


def test_cuda_readings_are_none_without_cuda() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        pytest.skip("CUDA is initialised here")
    with MemoryMeter() as meter:
        torch.ones(4)
    assert meter.cuda_live_bytes is None and meter.cuda_peak_bytes is None


def test_storage_bytes() -> None:
    x = torch.zeros(10, 10)  # 400 bytes
    y = torch.zeros(5)  # 20 bytes
    assert storage_bytes(x) == 400
    assert storage_bytes(x[0]) == 400  # a view counts its whole storage
    assert storage_bytes({"a": x, "b": [x.t(), y, 3, "s"], "c": (None,)}) == 420
    assert storage_bytes([]) == 0


# ---------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_allocator_peak_covers_dispatch_peak() -> None:
    torch.manual_seed(0)
    net = _linear_stack(6, 256, bias=False, relu=True).cuda()
    x = torch.randn(128, 256, device="cuda")
    torch.cuda.synchronize()
    with MemoryMeter() as meter:
        net(x).sum().backward()
    assert meter.peak_bytes > 0
    assert meter.cuda_peak_bytes is not None
    assert meter.cuda_peak_bytes >= meter.peak_bytes


class _Converting(TorchDispatchMode):
    """Calls ``to`` below autograd, as a selective-checkpoint policy's own ops do."""

    def __init__(self) -> None:
        super().__init__()
        self.made: list[torch.Tensor] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.relu.default:
            self.made += [out.to(torch.bool), out.to(torch.float32), out.reshape(-1)]
        return out


def test_a_copy_made_by_to_below_autograd_is_counted_and_an_alias_is_not() -> None:
    x = torch.randn(64, 32)
    with MemoryMeter() as meter, _Converting() as converting:
        y = torch.relu(x)
    # relu's output, and its bool copy: ``to(float32)`` and ``reshape`` return it.
    bool_copy, same, view = converting.made
    assert same is y and view.data_ptr() == y.data_ptr()
    assert meter.live_bytes == y.nbytes + bool_copy.nbytes
