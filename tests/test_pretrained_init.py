"""from_pretrained builds its table without nn.Embedding's N(0, 1) draw (every row is written
next), and only that table: the next table built draws as usual."""
import pytest
import torch

from nbtools import OffloadedEmbedding


def test_from_pretrained_draws_no_initial_rows(monkeypatch, tmp_path):
    source = torch.arange(12.).view(4, 3)
    drawn = []
    normal_ = torch.Tensor.normal_

    def counted(self, *args, **kwargs):
        drawn.append(tuple(self.shape))
        return normal_(self, *args, **kwargs)
    monkeypatch.setattr(torch.Tensor, "normal_", counted)
    for placement, extra in (("host", {}), ("disk", {"disk_dir": str(tmp_path)})):
        t = OffloadedEmbedding.from_pretrained(source, device="cpu", placement=placement, **extra)
        assert torch.equal(t.weight, source), placement
        t.close()
    assert drawn == []
    OffloadedEmbedding(4, 3, device="cpu")          # outside from_pretrained: drawn again
    assert drawn == [(4, 3)]


def test_a_failed_from_pretrained_leaves_the_next_table_initialised():
    with pytest.raises(ValueError):
        OffloadedEmbedding.from_pretrained(torch.full((4, 3), float("nan")), device="cpu")
    t = OffloadedEmbedding(50, 4, device="cpu")
    assert 0.5 < float(t.weight.std()) < 1.5       # N(0, 1), not left-over memory
