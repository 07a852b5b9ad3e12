"""Table files and vector files handed over by anyone are data: opening one never hangs (a FIFO,
a device), never writes through a symbolic link into another file, and a forged header gives
a clear error (RowFileError / ValueError naming what is wrong), not a crash deep inside."""
import json
import os
import threading

import numpy as np
import pytest
import torch

from nbtools import OffloadedEmbedding, OffloadOptimizer
from nbtools.rowfile import HEADER, MAGIC, VERSION, RowFile, RowFileError, leftovers
from nbtools.rowfile.format import write_header

WAIT_S = 20          # a call that has not returned by then is hanging


def _returns(call, fifo=None):
    """What ``call()`` raised (or returned), failing the test if it has not come back within
    WAIT_S seconds; a reader hanging in the open of ``fifo`` is then let go (a writer opens
    and closes it) so that the test run goes on."""
    got = {}

    def run():
        try:
            got["value"] = call()
        except BaseException as e:          # noqa: BLE001 (the caller looks at it)
            got["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(WAIT_S)
    if t.is_alive():
        if fifo is not None:
            try:
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass
            t.join(5)
        pytest.fail(f"the call hung (no answer within {WAIT_S} s)")
    if "value" in got and hasattr(got["value"], "close"):
        got["value"].close()
    return got.get("error", got.get("value"))


def _forged(path, fields: dict, size: int = 2 * HEADER, raw: bytes | None = None):
    body = raw if raw is not None else json.dumps(fields).encode()
    head = MAGIC + VERSION.to_bytes(4, "little") + len(body).to_bytes(4, "little") + body
    path.write_bytes(head.ljust(size, b"\0")[:max(size, len(head))])
    return path


# --- row files -------------------------------------------------------------------------------

@pytest.mark.parametrize("writable", [True, False])
def test_rowfile_open_of_a_fifo_is_refused_not_waited_on(tmp_path, writable):
    p = tmp_path / "shared" / "t.nbrows"
    p.parent.mkdir()
    os.mkfifo(p)
    got = _returns(lambda: RowFile.open(p, writable=writable), fifo=p)
    assert isinstance(got, RowFileError), got
    assert "FIFO" in str(got) and "t.nbrows" in str(got)


def test_rowfile_open_of_a_device_is_refused(tmp_path):
    p = tmp_path / "t.nbrows"
    p.symlink_to("/dev/zero")
    got = _returns(lambda: RowFile.open(p, writable=False))       # the link followed: a device
    assert isinstance(got, RowFileError) and "character device" in str(got), got
    got = _returns(lambda: RowFile.open(p))                        # writable: the link refused
    assert isinstance(got, RowFileError) and "symbolic link" in str(got), got


def test_writable_open_through_a_symlink_leaves_its_target_unchanged(tmp_path):
    mine = tmp_path / "mine" / "table.nbrows"
    f = RowFile.create(mine, 10, 8, {"dtype": "uint8"})
    f.write(np.array([0]), np.full((1, 8), 3, np.uint8))
    f.close()
    before = mine.read_bytes()
    link = tmp_path / "shared" / "t.nbrows"
    link.parent.mkdir()
    link.symlink_to(mine)
    with pytest.raises(RowFileError, match=r"symbolic link.*os\.path\.realpath"):
        RowFile.open(link)
    assert mine.read_bytes() == before
    with RowFile.open(link, writable=False) as g:              # read-only: followed, unchanged
        out = np.zeros((1, 8), np.uint8)
        g.read(np.array([0]), out)
        assert out.tolist() == [[3] * 8]
    assert mine.read_bytes() == before
    with RowFile.open(os.path.realpath(link)) as g:            # the real path: written
        g.write(np.array([1]), np.full((1, 8), 5, np.uint8))
    assert mine.read_bytes() != before


GOOD = {"num_rows": 4, "row_bytes": 8, "stride": 8, "data_offset": HEADER, "dtype": "uint8",
        "clean": True}


@pytest.mark.parametrize("change, what", [
    ({"stride": 0}, "stride is 0"),
    ({"stride": 0, "num_rows": 10 ** 15}, "stride is 0"),
    ({"row_bytes": 0}, "row_bytes is 0"),
    ({"num_rows": -1}, "num_rows is -1"),
    ({"num_rows": True}, "num_rows is True, not an integer"),
    ({"stride": "8"}, "stride is '8', not an integer"),
    ({"row_bytes": 8.0}, "row_bytes is 8.0, not an integer"),
    ({"data_offset": None}, "data_offset is None, not an integer"),
    ({"data_offset": 16}, "data_offset is 16; it must be at least 4,096"),
    ({"data_offset": HEADER + 512}, "data_offset 4,608 is not a multiple of 4,096"),
    ({"stride": 4, "row_bytes": 8}, "stride 4 is less than row_bytes 8"),
    ({"num_rows": 2 ** 70}, "num_rows is"),
    ({"packed": "yes"}, "packed is 'yes', not true or false"),
    ({"clean": "no"}, "clean is 'no', not true or false"),
    ({"clean": False, "writer": [1, 2]}, r"writer is \[1, 2\], not an object"),
    ({"stride": None, "delete": "stride"}, "stride is 'missing'"),
])
def test_forged_headers_are_refused_naming_the_field(tmp_path, change, what):
    fields = {**GOOD, **change}
    if "delete" in change:
        del fields[change["delete"]], fields["delete"]
    p = _forged(tmp_path / "t.nbrows", fields)
    for writable in (False, True):
        with pytest.raises(RowFileError, match=f"its header is damaged: {what}"):
            RowFile.open(p, writable=writable)


def test_forged_header_json_is_refused(tmp_path):
    p = _forged(tmp_path / "a.nbrows", None, raw=b"[1, 2, 3]")
    with pytest.raises(RowFileError, match="its header is damaged: its JSON is a list"):
        RowFile.open(p, writable=False)
    body = json.dumps(GOOD).encode()
    head = MAGIC + VERSION.to_bytes(4, "little") + (10 ** 6).to_bytes(4, "little") + body
    p.write_bytes(head.ljust(2 * HEADER, b"\0"))
    with pytest.raises(RowFileError, match="its JSON is said to take 1,000,000 bytes"):
        RowFile.open(p, writable=False)


def test_huge_num_rows_beyond_the_file_is_refused(tmp_path):
    p = _forged(tmp_path / "t.nbrows", {**GOOD, "num_rows": 10 ** 15})
    with pytest.raises(RowFileError, match=r"truncated: 8,192 bytes, its header says "
                       r"8,000,000,000,004,096"):
        RowFile.open(p, writable=False)
    # a packed file is read in whole 4 KiB blocks: its last block must be there
    p = _forged(tmp_path / "p.nbrows", {**GOOD, "packed": True, "num_rows": 4, "stride": 32},
                size=HEADER + 128)
    with pytest.raises(RowFileError, match="truncated.*whole 4,096-byte blocks"):
        RowFile.open(p, writable=False)


def test_a_sane_forged_header_still_opens(tmp_path):
    p = _forged(tmp_path / "t.nbrows", GOOD)
    with RowFile.open(p, writable=False) as f:
        out = np.ones((1, 8), np.uint8)
        f.read(np.array([3]), out)
        assert out.tolist() == [[0] * 8]


def test_leftovers_skips_fifos_and_links(tmp_path):
    os.mkfifo(tmp_path / "pipe.nbrows")
    f = RowFile.create(tmp_path / "mine" / "dead.nbrows", 2, 8)
    f.close()
    # as its writer left it when it died: unclean, a writer no process is, and no lock held
    fd = os.open(f.path, os.O_RDWR)
    write_header(fd, {**f.meta, "clean": False, "writer": {**f.meta["writer"],
                                                           "pid": 2 ** 31 - 1}})
    os.close(fd)
    (tmp_path / "link.nbrows").symlink_to(tmp_path / "mine" / "dead.nbrows")
    got = _returns(lambda: leftovers(tmp_path))
    assert got == []
    assert [x["path"] for x in _returns(lambda: leftovers(tmp_path / "mine"))] == \
        [str(tmp_path / "mine" / "dead.nbrows")]


# --- vector files (from_pretrained, load_row_state) ----------------------------------------

def test_from_pretrained_of_a_fifo_is_refused_not_waited_on(tmp_path):
    p = tmp_path / "vectors.npy"
    os.mkfifo(p)
    got = _returns(lambda: OffloadedEmbedding.from_pretrained(p, device="cpu"), fifo=p)
    assert isinstance(got, ValueError) and "FIFO" in str(got) and "vectors.npy" in str(got), got


def test_from_pretrained_of_a_device_link_is_refused(tmp_path):
    p = tmp_path / "vectors.npy"
    p.symlink_to("/dev/zero")
    got = _returns(lambda: OffloadedEmbedding.from_pretrained(p, device="cpu"))
    assert isinstance(got, ValueError) and "character device" in str(got), got


def test_from_pretrained_of_a_forged_npy_header_is_refused(tmp_path):
    p = tmp_path / "vectors.npy"
    hdr = "{'descr': '<f4', 'fortran_order': False, 'shape': (1000000000000, 64), }"
    hdr = hdr + " " * (118 - len(hdr)) + "\n"
    p.write_bytes(b"\x93NUMPY\x01\x00" + len(hdr).to_bytes(2, "little") + hdr.encode()
                  + bytes(256))
    with pytest.raises(ValueError, match=r"vectors\.npy' is truncated or its header is damaged: "
                       r"the header says float32 values of shape \(1000000000000, 64\), "
                       r"256,000,000,000,000 bytes"):
        OffloadedEmbedding.from_pretrained(p, device="cpu")


def test_from_pretrained_follows_a_link_to_a_regular_file(tmp_path):
    w = np.arange(12, dtype=np.float32).reshape(6, 2)
    np.save(tmp_path / "real.npy", w)
    (tmp_path / "vectors.npy").symlink_to(tmp_path / "real.npy")
    t = OffloadedEmbedding.from_pretrained(tmp_path / "vectors.npy", device="cpu")
    assert torch.equal(t(torch.arange(6)), torch.from_numpy(w))


def test_a_memory_map_whose_file_became_a_fifo_is_read_through_the_map(tmp_path):
    """The map's file is read with pread, by name: a FIFO put at that name is not waited on
    (the rows come through the mapping instead)."""
    w = np.arange(12, dtype=np.float32).reshape(6, 2)
    p = tmp_path / "vectors.npy"
    np.save(p, w)
    arr = np.load(p, mmap_mode="r")
    os.remove(p)
    os.mkfifo(p)
    got = _returns(lambda: OffloadedEmbedding.from_pretrained(arr, device="cpu"), fifo=p)
    assert isinstance(got, OffloadedEmbedding), got
    assert torch.equal(got(torch.arange(6)), torch.from_numpy(w))


def test_load_row_state_of_a_fifo_is_refused(tmp_path):
    table = OffloadedEmbedding(6, 2, device="cpu")
    opt = OffloadOptimizer(torch.optim.Adam, table, lr=0.1)
    p = tmp_path / "exp_avg.npy"
    os.mkfifo(p)
    got = _returns(lambda: opt.load_row_state(table, "exp_avg", p, step=1), fifo=p)
    assert isinstance(got, ValueError) and "FIFO" in str(got), got
