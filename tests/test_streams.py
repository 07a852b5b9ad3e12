"""nbtools.devices' stream calls against torch's own stream helpers (CUDA): the same current stream, the same
stream inside and after a side-stream block, work queued there ordered as torch orders it."""
import pytest
import torch

from nbtools import devices


def _same(a: torch.cuda.Stream, b: torch.cuda.Stream) -> bool:
    return (a.stream_id, a.device_index, a.device_type) == \
        (b.stream_id, b.device_index, b.device_type)


@pytest.fixture(params=[True, False], ids=["fast", "torch"])
def fast(request, monkeypatch):
    monkeypatch.setattr(devices, "FAST", request.param)
    return request.param


@pytest.mark.gpu
def test_current_is_torchs_current_stream(fast):
    dev = torch.device("cuda", torch.cuda.current_device())
    assert _same(devices.current(dev), torch.cuda.current_stream(dev))
    assert _same(devices.current(dev.index), torch.cuda.current_stream(dev))
    assert _same(devices.current(torch.device("cuda")), torch.cuda.current_stream())
    side = torch.cuda.Stream(dev)
    with torch.cuda.stream(side):
        assert _same(devices.current(dev), side)


@pytest.mark.gpu
def test_entered_sets_and_restores_the_stream(fast):
    dev = torch.device("cuda", torch.cuda.current_device())
    before = torch.cuda.current_stream(dev)
    side, other = torch.cuda.Stream(dev), torch.cuda.Stream(dev)
    with devices.entered(side):
        assert _same(torch.cuda.current_stream(dev), side)
        with devices.entered(other):                       # nested
            assert _same(torch.cuda.current_stream(dev), other)
        assert _same(torch.cuda.current_stream(dev), side)
    assert _same(torch.cuda.current_stream(dev), before)
    with pytest.raises(KeyError):                           # restored on an error too
        with devices.entered(side):
            raise KeyError("x")
    assert _same(torch.cuda.current_stream(dev), before)


@pytest.mark.gpu
def test_work_in_entered_and_recorded_events_keep_their_order(fast):
    """A long kernel queued on a side stream inside ``entered``, an event recorded after it
    with ``record``: the main stream's wait on that event orders its read after the write."""
    dev = torch.device("cuda", torch.cuda.current_device())
    side = torch.cuda.Stream(dev)
    x = torch.zeros(1 << 22, device=dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    event = torch.cuda.Event()
    with devices.entered(side):
        torch.cuda._sleep(20_000_000)                      # ~10 ms of GPU time before it
        x.fill_(3.0)
        devices.record(event, dev)                         # on the side stream
    assert not event.query()                               # still behind the sleep
    torch.cuda.current_stream(dev).wait_event(event)
    assert float(x.sum()) == 3.0 * x.numel()


def test_a_torch_without_the_c_calls_takes_torchs_helpers(monkeypatch):
    """Where torch lacks a C call the shortcut uses, the answer is no, once, and kept."""
    monkeypatch.setattr(devices, "fast_ready", None)
    monkeypatch.setattr(devices, "c_set_stream", None)
    assert devices.fast_ok(0) is False and devices.fast_ready is False
    monkeypatch.setattr(devices, "c_set_stream", lambda **kw: None)
    assert devices.fast_ok(0) is False                     # decided once, not asked again
