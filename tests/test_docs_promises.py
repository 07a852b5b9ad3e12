"""What the documents promise in figures and calls, checked against the code on a CPU: a disk
table's ``cache_stats()`` without a GPU cache (docs/disk.md), and ``nbtools.plan``'s bytes per
row for every weight and state dtype of the table in docs/rowwise.md, "Bytes per row"."""
import pathlib
import re

import pytest
import torch

import nbtools

ROOT = pathlib.Path(__file__).resolve().parents[1]


# --- docs/disk.md: `repr(table)` and `table.cache_stats()` give each level's hit rate ----------

def test_a_disk_table_with_only_a_ram_cache_reports_its_hit_rate(tmp_path):
    table = nbtools.OffloadedEmbedding(20_000, 16, placement="disk", disk_dir=str(tmp_path),
                                       host_cache_bytes=256 << 10)     # 4,096 rows of 64 B
    opt = nbtools.OffloadOptimizer(torch.optim.Adagrad, table, lr=0.05)
    stats = table.cache_stats()
    assert stats["ram_lookups"] == 0 and stats["ram_hit_rate"] != stats["ram_hit_rate"]  # NaN
    assert "hit rate n/a" in repr(table)
    g = torch.Generator().manual_seed(0)
    looked = 0
    for _ in range(6):
        ids = torch.randint(0, 3_000, (800,), generator=g)
        looked += ids.unique().numel()            # RAM counts a lookup's unique rows
        table(ids).sum().backward()
        opt.step()
        opt.zero_grad()
    stats = table.cache_stats()
    assert "hit_rate" not in stats and "capacity_rows" not in stats    # (no GPU level)
    assert stats["ram_lookups"] == looked
    assert stats["ram_hits"] + stats["ram_ahead_hits"] + stats["ram_misses"] == looked
    assert 0 < stats["ram_hit_rate"] < 1
    assert stats["ram_hit_rate"] == stats["ram_hits"] / looked
    assert stats["ram_capacity_rows"] == table.disk.ram.capacity_rows
    shown = re.search(r"RAM cache [\d,]+ rows \([^)]*, hit rate (\d+)%\)", repr(table))
    assert shown and int(shown.group(1)) == round(100 * stats["ram_hit_rate"]), repr(table)
    table.close()


def test_a_table_in_memory_without_a_cache_has_no_stats():
    table = nbtools.OffloadedEmbedding(100, 4, device="cpu")
    nbtools.OffloadOptimizer(torch.optim.SGD, table, lr=0.1)
    assert table.cache_stats() == {}


# --- docs/rowwise.md, "Bytes per row": `nbtools.plan(...).disk_row_bytes` --------------------

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
_OPTIMIZERS = {"Adam": "adam", "Adagrad": "adagrad", "PartialRowWiseAdam": "partial_rowwise_adam",
               "RowWiseAdagrad": "rowwise_adagrad"}


def _bytes_per_row_table():
    """``[(weights, state, optimizer name, bytes)]`` from rowwise.md's table at dim 128."""
    text = (ROOT / "docs" / "rowwise.md").read_text()
    lines = text[text.index("## Bytes per row"):].splitlines()
    header = next(line for line in lines if line.startswith("| weights / state"))
    names = [c.strip() for c in header.strip("|").split("|")[1:]]
    rows = []
    for line in lines[lines.index(header) + 2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip().strip("*") for c in line.strip("|").split("|")]
        weights, state = (c.strip() for c in cells[0].split("/"))
        for name, value in zip(names, cells[1:]):
            rows.append((weights, state, name, int(value.replace(",", ""))))
    return rows


def test_the_bytes_per_row_table_is_read_whole():
    rows = _bytes_per_row_table()
    assert len(rows) == 12 and ("bf16", "bf16", "RowWiseAdagrad", 258) in rows


@pytest.mark.parametrize("weights, state, name, nbytes", _bytes_per_row_table())
def test_plan_gives_the_documented_bytes_per_row(weights, state, name, nbytes):
    p = nbtools.plan(1000, 128, _OPTIMIZERS[name], dtype=_DTYPES[weights],
                     state_dtype=_DTYPES[state])
    assert p.disk_row_bytes == nbytes
    assert p.state_dtype == str(_DTYPES[state]).replace("torch.", "")


def test_plan_takes_state_dtype_as_the_table_does():
    # the default: float32 state for bf16 weights, as the table's
    assert nbtools.plan(10, 128, "rowwise_adagrad", dtype=torch.bfloat16).state_dtype == "float32"
    p = nbtools.plan(10, 128, "rowwise_adagrad", dtype=torch.bfloat16,
                     state_dtype=torch.bfloat16)
    assert "per-row state: sum in bfloat16" in str(p)
    table = nbtools.OffloadedEmbedding(10, 128, device="cpu", dtype=torch.bfloat16,
                                       state_dtype=torch.bfloat16)
    nbtools.OffloadOptimizer(nbtools.RowWiseAdagrad, table, lr=0.1)
    assert table.rows.row_bytes == p.host_bytes // 10      # the padded row, 288 bytes
    with pytest.raises(ValueError, match="state_dtype"):   # narrower than the weights
        nbtools.plan(10, 4, "adam", state_dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="state_dtype"):
        nbtools.plan(10, 4, "adam", state_dtype=torch.int32)
    assert nbtools.plan(10, 4, "sgd", dtype=torch.bfloat16).state_dtype == ""   # no state
